"""Kernel launch settings as data: JSON files keyed by shape, device and dtype, nearest batch size.

One file per (experts, N, K, bits, group_size, device name, dtype) in engines/quant/configs/,
named like `E=8,N=28672,K=4096,bits=4,group_size=128,device_name=NVIDIA_H200,dtype=bfloat16.json`
and holding {"<tokens>": {"block_m": .., "block_n": .., "block_k": .., "num_warps": ..,
"num_stages": ..}}; the entry whose token count is nearest the call's is used. `tune.py` writes
them on a GPU. Without a file a size-based default applies; the interpreter always gets one config.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from engines.quant.qweight import QuantFormatError

CONFIG_DIR = Path(__file__).with_name("configs")


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes of the quantized matmul kernel. block_k must divide the group size (one
    scale per row per K step) and all blocks be powers of two >= 16 (tl.dot's minimum)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise QuantFormatError(f"KernelConfig.{name}: must be a power of two >= 16, got {v}")


# The interpreter runs each program in numpy: few, larger programs keep tests fast, and
# multi-config autotuning fails there, so it always gets this one.
INTERPRETER_CONFIG = KernelConfig(block_m=16, block_n=32, block_k=32, num_warps=1, num_stages=1)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def device_key(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return name.replace(" ", "_")


def config_file_name(experts: int, n: int, k: int, bits: int, group_size: int, device_name: str,
                     dtype: torch.dtype) -> str:
    dt = str(dtype).removeprefix("torch.")
    return f"E={experts},N={n},K={k},bits={bits},group_size={group_size},device_name={device_name},dtype={dt}.json"


def parse_table(data: object, where: str) -> dict[int, KernelConfig]:
    if not isinstance(data, dict) or not data:
        raise QuantFormatError(f"{where}: expected a non-empty object of token count -> config")
    try:
        return {int(m): KernelConfig(**cfg) for m, cfg in data.items()}
    except (TypeError, ValueError) as exc:
        raise QuantFormatError(f"{where}: bad entry ({exc}); keys are token counts, values have "
                               f"block_m, block_n, block_k, num_warps, num_stages") from None


@functools.cache
def load_table(path: Path) -> dict[int, KernelConfig] | None:
    """The tuned table in `path`, or None if there is none. Memoized: these files are read-only
    data that a process looks up twice per MoE layer per step."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return parse_table(json.loads(text), str(path))
    except json.JSONDecodeError as exc:
        raise QuantFormatError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None


def default_config(m: int, bits: int = 4) -> KernelConfig:
    """Untuned fallback by token count: small M is weight-bandwidth bound, so keep the M tile
    small and the N tile wide; large M is compute bound, so grow both. 3-bit codes straddle
    32-bit words and are gathered per element: the large tile with 3 stages asked an H200 for
    307,200 bytes of shared memory (it has 232,448; tests/quant/test_kernels.py
    test_gpu_fused_moe_large, 2026-12-04), so 3-bit gets half the N tile and 2 stages there."""
    if m <= 32:
        return KernelConfig(16, 64, 64, num_warps=4, num_stages=3)
    if m <= 256:
        return KernelConfig(32, 64, 64, num_warps=4, num_stages=3)
    if bits == 3:
        return KernelConfig(64, 64, 64, num_warps=4, num_stages=2)
    return KernelConfig(64, 128, 64, num_warps=8, num_stages=3)


def nearest(table: dict[int, KernelConfig], m: int) -> KernelConfig:
    return table[min(table, key=lambda b: (abs(b - m), b))]


def pick_config(experts: int, n: int, k: int, bits: int, group_size: int, dtype: torch.dtype,
                m: int, device: torch.device, config_dir: Path = CONFIG_DIR) -> KernelConfig:
    """Settings for an [m, k] x [experts, n, k] quantized matmul on `device`."""
    if interpreting():
        cfg = INTERPRETER_CONFIG
    else:
        table = load_table(config_dir / config_file_name(experts, n, k, bits, group_size, device_key(device), dtype))
        cfg = nearest(table, m) if table else default_config(m, bits)
    return replace(cfg, block_k=min(cfg.block_k, group_size))


def write_table(path: Path, table: dict[int, KernelConfig]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(m): asdict(c) for m, c in sorted(table.items())}, indent=1) + "\n")
    tmp.replace(path)
    load_table.cache_clear()

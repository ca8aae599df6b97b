"""Tune the quantized-matmul kernel on a GPU and write the winners as config files (configs.py).

    python -m engines.quant.tune --experts 8 --hidden 4096 --intermediate 14336 --bits 4 --group-size 128
    python -m engines.quant.tune --experts 1 --n 14336 --k 4096 --bits 4 --group-size 128   # dense

Times every candidate tile setting at each row count with triton.testing.do_bench and keeps
the fastest. Needs CUDA; on a machine without it, it says so and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from engines.base import EngineError
from engines.quant.configs import CONFIG_DIR, KernelConfig, config_file_name, device_key, write_table
from engines.quant.qweight import quantize_rtn

# Row counts (token->expert assignments) tuned by default; lookups take the nearest.
DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def candidates(group_size: int, rows_per_expert: int) -> list[KernelConfig]:
    """Tile settings worth timing: block_k divides the group; no M tile far beyond the rows an
    expert gets (its extra rows are masked work)."""
    max_m = max(16, 1 << (max(rows_per_expert, 1) - 1).bit_length())
    return [
        KernelConfig(bm, bn, bk, warps, stages)
        for bm in (16, 32, 64, 128) if bm <= max_m
        for bn in (32, 64, 128, 256)
        for bk in (32, 64, 128) if bk <= group_size
        for warps in (4, 8)
        for stages in (2, 3, 4)
    ]


def tune_gemm(experts: int, n: int, k: int, bits: int, group_size: int, dtype: torch.dtype,
              rows_list: tuple[int, ...] = DEFAULT_ROWS, swiglu: bool = False,
              seed: int = 0) -> dict[int, KernelConfig]:
    """Best KernelConfig per row count for an [rows, k] x [experts, n, k] quantized matmul."""
    if not torch.cuda.is_available():
        raise EngineError("kernel tuning needs a CUDA device; none is visible")
    import triton.testing  # noqa: PLC0415  (GPU-only path)

    from engines.quant.triton_kernels import qmm  # noqa: PLC0415

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(experts, n, k, device="cuda", dtype=dtype, generator=gen) * 0.02
    qw = quantize_rtn(w, bits, group_size)
    out_n = n // 2 if swiglu else n
    table: dict[int, KernelConfig] = {}
    for rows in rows_list:
        ids = torch.randint(0, experts, (rows,), device="cuda", generator=gen)
        counts = torch.bincount(ids, minlength=experts).tolist()
        a = torch.randn(rows, k, device="cuda", dtype=dtype, generator=gen)
        timings = {}
        for cfg in candidates(group_size, -(-rows // experts)):
            try:
                timings[cfg] = triton.testing.do_bench(
                    lambda cfg=cfg: qmm(a, qw, counts, out_n, swiglu=swiglu, config=cfg))
            except Exception as exc:  # noqa: BLE001  (a tile that does not fit this GPU: skip it)
                print(f"  skip {cfg}: {type(exc).__name__}", file=sys.stderr)
        best = min(timings, key=timings.get)
        print(f"rows={rows}: {best} {timings[best] * 1e3:.1f} us")
        table[rows] = best
    return table


def tune(experts: int, n: int, k: int, bits: int, group_size: int, dtype: torch.dtype,
         swiglu: bool = False, config_dir: Path = CONFIG_DIR) -> Path:
    """Tune one GEMM shape and write its config file; returns the file's path."""
    table = tune_gemm(experts, n, k, bits, group_size, dtype, swiglu=swiglu)
    path = config_dir / config_file_name(experts, n, k, bits, group_size, device_key(torch.device("cuda")), dtype)
    write_table(path, table)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engines.quant.tune", description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=1)
    p.add_argument("--hidden", type=int, help="MoE: tune gate_up [E, 2I, D] and down [E, D, I]")
    p.add_argument("--intermediate", type=int)
    p.add_argument("--n", type=int, help="dense: output features")
    p.add_argument("--k", type=int, help="dense: input features")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--config-dir", type=Path, default=CONFIG_DIR)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.hidden and args.intermediate:
        jobs = [(2 * args.intermediate, args.hidden, True), (args.hidden, args.intermediate, False)]
    elif args.n and args.k:
        jobs = [(args.n, args.k, False)]
    else:
        p.error("give --hidden and --intermediate (MoE), or --n and --k (dense)")
    try:
        for n, k, swiglu in jobs:
            print(f"wrote {tune(args.experts, n, k, args.bits, args.group_size, dtype, swiglu, args.config_dir)}")
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

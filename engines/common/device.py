"""Device and dtype choice shared by the torch engines: float32 on CPU, bf16 on CUDA by default."""

from __future__ import annotations

import torch

from engines.base import EngineError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(name: str | None) -> torch.device:
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise EngineError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {name!r} requested but this torch ({torch.__version__}) sees no CUDA device; "
                          "use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise EngineError(f"device {name!r} is not supported; use cpu, cuda or cuda:N")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None or name == "auto":
        if device.type == "cpu":
            return torch.float32  # bf16 matmuls are ~10x slower on AVX2 CPUs
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in DTYPES:
        raise EngineError(f"unknown dtype {name!r}; valid: float32, float16, bfloat16")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

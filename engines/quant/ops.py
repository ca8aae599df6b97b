"""The public quantized ops, each resolved once per process between Triton and a torch reference.

Triton (triton_kernels.py) when CUDA is available, the torch references below otherwise; the
environment variable PWBENCH_KERNELS=torch|triton overrides, and TRITON_INTERPRET=1 lets
`triton` run on CPU tensors (slowly: tests only). The references are also the kernels' test
oracle. Inputs are checked once here for both; triton is imported only on its path.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.base import EngineError
from engines.quant.configs import interpreting
from engines.quant.qweight import QuantFormatError, QuantizedExperts, QuantizedWeight, dequantize
from engines.runtime.experts import Dispatch, grouped_swiglu
from engines.runtime.weights import DenseExperts

KERNELS_ENV = "PWBENCH_KERNELS"
IMPLEMENTATIONS = ("torch", "triton")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def kernel_impl() -> str:
    """The implementation the ops use, "triton" or "torch", decided on first use. Tests that
    change PWBENCH_KERNELS call `kernel_impl.cache_clear()` so the next op resolves again."""
    choice = os.environ.get(KERNELS_ENV, "").strip().lower()
    if choice and choice not in IMPLEMENTATIONS:
        raise EngineError(f"{KERNELS_ENV} must be one of {IMPLEMENTATIONS}, got {choice!r}")
    has_triton = importlib.util.find_spec("triton") is not None
    if not choice:
        return "triton" if has_triton and torch.cuda.is_available() else "torch"
    if choice == "triton" and not has_triton:
        raise EngineError(f"{KERNELS_ENV}=triton, but triton is not installed")
    if choice == "triton" and not (torch.cuda.is_available() or interpreting()):
        raise EngineError(f"{KERNELS_ENV}=triton needs a CUDA device, or TRITON_INTERPRET=1 to run on CPU")
    return choice


# --- torch references: dequantize, then the runtime's dense math (same order of every sum) -----


def dequant_matmul_reference(x: Tensor, qw: QuantizedWeight) -> Tensor:
    """x [T, in] -> x @ dequantize(qw)^T [T, out], in x's dtype."""
    return F.linear(x, dequantize(qw, x.dtype))


class _DequantizedStack:
    """Expert e of a stacked weight, dequantized when indexed: grouped_swiglu only indexes
    experts that have tokens, so idle experts cost nothing."""

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype) -> None:
        self._qw, self._dtype = qw, dtype

    def __getitem__(self, e: int) -> Tensor:
        return dequantize(self._qw.expert(e), self._dtype)


def fused_moe_reference(x: Tensor, d: Dispatch, experts: QuantizedExperts) -> Tensor:
    """x [T, D] -> sum over each token's experts of weight * SwiGLU expert(x), like grouped_swiglu."""
    gate_up, down = (_DequantizedStack(w, x.dtype) for w in (experts.gate_up, experts.down))
    return grouped_swiglu(x, d, DenseExperts(gate_up, down))  # type: ignore[arg-type]  (indexable stand-ins)


# --- the public ops ---------------------------------------------------------------------------


def _check_x(x: Tensor, features: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] != features:
        raise QuantFormatError(f"{what}: x must be [T, {features}], got {list(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise QuantFormatError(f"{what}: x dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")


def _check_device(x: Tensor, qw: QuantizedWeight, what: str) -> None:
    if qw.device != x.device:
        raise QuantFormatError(f"{what}: x is on {x.device} but the weight is on {qw.device}")


def dequant_matmul(x: Tensor, qw: QuantizedWeight) -> Tensor:
    """x [T, in] @ dequantize(qw)^T -> [T, out] in x's dtype; qw is one matrix [out, in]."""
    if qw.lead:
        raise QuantFormatError(f"dequant_matmul: expects one matrix, got a stack {list(qw.lead)}")
    _check_x(x, qw.shape[1], "dequant_matmul")
    _check_device(x, qw, "dequant_matmul")
    if kernel_impl() == "triton":
        from engines.quant import triton_kernels  # noqa: PLC0415  (Triton only on this path)

        return triton_kernels.dequant_matmul(x, qw)
    return dequant_matmul_reference(x, qw)


def fused_moe(x: Tensor, dispatch: Dispatch, experts: QuantizedExperts) -> Tensor:
    """x [T, D], tokens sorted by expert (the runtime's Dispatch), quantized gate_up [E, 2I, D]
    and down [E, D, I] -> [T, D]: sum over each token's experts of routing weight *
    down(silu(gate(x)) * up(x)), the semantics of engines.runtime.experts.grouped_swiglu."""
    _check_x(x, experts.gate_up.shape[1], "fused_moe")
    _check_device(x, experts.gate_up, "fused_moe")
    n = dispatch.token_index.numel()
    if len(dispatch.counts) != experts.num_experts or sum(dispatch.counts) != n or dispatch.weights.numel() != n:
        raise QuantFormatError(
            f"fused_moe: dispatch has {len(dispatch.counts)} expert counts summing to {sum(dispatch.counts)}, "
            f"{n} token indices and {dispatch.weights.numel()} weights; the layer has {experts.num_experts} experts"
        )
    if kernel_impl() == "triton":
        from engines.quant import triton_kernels  # noqa: PLC0415

        return triton_kernels.fused_moe(x, dispatch, experts)
    return fused_moe_reference(x, dispatch, experts)

"""The public quantized ops, each resolved once per process between Triton and a torch reference.
`fused_moe` runs pwbench's packed group-wise experts (QuantizedExperts) and gpt-oss's MXFP4
experts (engines/runtime/mxfp4.py's Mxfp4Experts), either with per-expert biases and the clamp.

Triton (triton_kernels.py) when CUDA is available, the torch references below otherwise; the
environment variable PWBENCH_KERNELS=torch|triton overrides, and TRITON_INTERPRET=1 lets
`triton` run on CPU tensors (slowly: tests only). The references are also the kernels' test
oracle. Inputs are checked once here for both; triton is imported only on its path. Weights
quantized one group per row of an odd width (not a multiple of the kernel's K tiles) always take
the torch path.
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
from engines.quant.qweight import (
    SUPPORTED_GROUP_SIZES,
    QuantFormatError,
    QuantizedExperts,
    QuantizedWeight,
    dequantize,
)
from engines.runtime.experts import Dispatch, grouped_swiglu
from engines.runtime.mxfp4 import Mxfp4Experts, Mxfp4Weight, mxfp4_moe_reference
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


def fused_moe_reference(x: Tensor, d: Dispatch, experts: QuantizedExperts | Mxfp4Experts) -> Tensor:
    """x [T, D] -> sum over each token's experts of weight * SwiGLU expert(x), like grouped_swiglu
    (biases and the clamp included when the experts have them)."""
    if isinstance(experts, Mxfp4Experts):
        return mxfp4_moe_reference(x, d, experts)
    gate_up, down = (_DequantizedStack(w, x.dtype) for w in (experts.gate_up, experts.down))
    stand_in = DenseExperts(gate_up, down, experts.gate_up_bias, experts.down_bias, experts.clamp)  # type: ignore[arg-type]
    return grouped_swiglu(x, d, stand_in)


def mxfp4_matmul_reference(x: Tensor, w: Mxfp4Weight) -> Tensor:
    """x [T, in] -> x @ dequantize(w)^T [T, out], in x's dtype."""
    return F.linear(x, w.dequantize(x.dtype))


# --- the public ops ---------------------------------------------------------------------------


def _check_x(x: Tensor, features: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] != features:
        raise QuantFormatError(f"{what}: x must be [T, {features}], got {list(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise QuantFormatError(f"{what}: x dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")


def _check_device(x: Tensor, qw: QuantizedWeight | Mxfp4Weight, what: str) -> None:
    if qw.device != x.device:
        raise QuantFormatError(f"{what}: x is on {x.device} but the weight is on {qw.device}")


def _tiles(w: QuantizedWeight | Mxfp4Weight) -> bool:
    """Whether the Triton kernel takes w: its K steps never cross a group (MXFP4's 32 always fit)."""
    return isinstance(w, Mxfp4Weight) or w.group_size in SUPPORTED_GROUP_SIZES


def dequant_matmul(x: Tensor, qw: QuantizedWeight) -> Tensor:
    """x [T, in] @ dequantize(qw)^T -> [T, out] in x's dtype; qw is one matrix [out, in]."""
    if qw.lead:
        raise QuantFormatError(f"dequant_matmul: expects one matrix, got a stack {list(qw.lead)}")
    _check_x(x, qw.shape[1], "dequant_matmul")
    _check_device(x, qw, "dequant_matmul")
    if kernel_impl() == "triton" and _tiles(qw):
        from engines.quant import triton_kernels  # noqa: PLC0415  (Triton only on this path)

        return triton_kernels.dequant_matmul(x, qw)
    return dequant_matmul_reference(x, qw)


def mxfp4_matmul(x: Tensor, w: Mxfp4Weight) -> Tensor:
    """x [T, in] @ dequantize(w)^T -> [T, out] in x's dtype; w is one MXFP4 matrix [out, in]."""
    if w.lead:
        raise QuantFormatError(f"mxfp4_matmul: expects one matrix, got a stack {list(w.lead)}")
    _check_x(x, w.shape[1], "mxfp4_matmul")
    _check_device(x, w, "mxfp4_matmul")
    if kernel_impl() == "triton":
        from engines.quant import triton_kernels  # noqa: PLC0415  (Triton only on this path)

        return triton_kernels.dequant_matmul(x, w)
    return mxfp4_matmul_reference(x, w)


def fused_moe(x: Tensor, dispatch: Dispatch, experts: QuantizedExperts | Mxfp4Experts) -> Tensor:
    """x [T, D], tokens sorted by expert (the runtime's Dispatch), quantized gate_up [E, 2I, D]
    and down [E, D, I] (group-wise or MXFP4) -> [T, D]: sum over each token's experts of
    routing weight * down(silu(gate(x)) * up(x)) (gpt-oss: with biases and the clamped
    SwiGLU), the semantics of engines.runtime.experts.grouped_swiglu."""
    _check_x(x, experts.gate_up.shape[1], "fused_moe")
    _check_device(x, experts.gate_up, "fused_moe")
    n = dispatch.token_index.numel()
    if len(dispatch.counts) != experts.num_experts or sum(dispatch.counts) != n or dispatch.weights.numel() != n:
        raise QuantFormatError(
            f"fused_moe: dispatch has {len(dispatch.counts)} expert counts summing to {sum(dispatch.counts)}, "
            f"{n} token indices and {dispatch.weights.numel()} weights; the layer has {experts.num_experts} experts"
        )
    if kernel_impl() == "triton" and _tiles(experts.gate_up) and _tiles(experts.down):
        from engines.quant import triton_kernels  # noqa: PLC0415

        return triton_kernels.fused_moe(x, dispatch, experts)
    return fused_moe_reference(x, dispatch, experts)

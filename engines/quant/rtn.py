"""Round-to-nearest group-wise quantization, as a quantize-dequantize reference in torch.

Groups run along the input dimension (the last one), `group_size` weights per scale, as in
GPTQ/AWQ checkpoints. Asymmetric: w ~ (q - zero) * scale with q in [0, 2^bits - 1].
Symmetric: w ~ q * scale with q in [-2^(bits-1), 2^(bits-1) - 1]. This is the oracle packed
formats and kernels are checked against, and the cheapest way to ask "what does b bits do to
quality" without a kernel.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from engines.base import EngineError
from engines.runtime.weights import DenseExperts

SUPPORTED_BITS = (2, 3, 4, 8)


def rtn_fake_quantize(w: Tensor, bits: int, group_size: int, symmetric: bool = False) -> Tensor:
    """w [..., out, in] -> the dequantized RTN approximation, same shape and dtype."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size <= 0 or w.shape[-1] % group_size:
        raise ValueError(f"group_size {group_size} must divide the input dimension {w.shape[-1]}")
    g = w.float().reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = (g.abs().amax(-1, keepdim=True) / qmax).clamp(min=1e-10)
        q = torch.clamp(torch.round(g / scale), -qmax - 1, qmax)
        deq = q * scale
    else:
        qmax = 2**bits - 1
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((hi - lo) / qmax).clamp(min=1e-10)
        zero = torch.round(-lo / scale)
        q = torch.clamp(torch.round(g / scale) + zero, 0, qmax)
        deq = (q - zero) * scale
    return deq.reshape(w.shape).to(w.dtype)


def fake_quantized(dense: dict[int, DenseExperts], bits: int, group_size: int = 32) -> dict[int, DenseExperts]:
    """Every layer's routed expert weights RTN quantize-dequantized (new tensors; `dense`
    untouched); biases and the SwiGLU clamp carried over exact.
    `group_size` 0: one group per output row, the plain per-channel RTN GPTQ (arXiv 2210.17323)
    compares against; otherwise groups of that many inputs (capped at the row length, which it
    must divide)."""
    if bits not in SUPPORTED_BITS:
        raise EngineError(f"expert_bits must be one of {SUPPORTED_BITS} (or 16 for full precision), got {bits}")
    rows = sorted({w.shape[-1] for experts in dense.values() for w in (experts.gate_up, experts.down)})
    odd = [row for row in rows if row % min(group_size or row, row)]
    if odd:
        common = math.gcd(*rows)  # the fitting sizes are its divisors: suggest the largest below the asked one
        fit = max(g for g in range(1, min(group_size, common) + 1) if common % g == 0)
        raise EngineError(f"expert group size {group_size} does not divide the expert rows ({'/'.join(map(str, odd))} "
                          f"inputs; all rows: {'/'.join(map(str, rows))}): set expert_group={fit} (it divides every "
                          "row), or 0 for one group per row")
    out = {}
    for i, experts in dense.items():
        ws = []
        for w in (experts.gate_up, experts.down):
            row = w.shape[-1]
            ws.append(rtn_fake_quantize(w, bits, min(group_size or row, row)))
        # Biases (gpt-oss) are a few numbers per expert: kept exact, as the clamp.
        out[i] = DenseExperts(*ws, experts.gate_up_bias, experts.down_bias, experts.clamp)
    return out

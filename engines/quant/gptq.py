"""GPTQ (Frantar et al., 2023): quantize one weight matrix so that its output on the calibration
inputs changes least.

Columns (inputs) are quantized one at a time; each column's rounding error is spread over the
columns not yet quantized, weighted by the inverse of the Hessian H = 2 XᵀX / n of the layer's
inputs (upper Cholesky factor, as in the reference implementation). Updates are applied lazily
in blocks of columns, so the large matmul runs once per block. Group parameters (scale, zero)
are chosen when a group's first column is reached, from the already-updated weights, with the
same rounding as quantize_rtn. `act_order` quantizes columns by decreasing H diagonal and
records the resulting groups in `g_idx`. Calibration and the MoE plumbing live in calibrate.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engines.quant.qweight import (
    QuantFormatError,
    QuantizedWeight,
    check_scheme,
    pack,
    quantize_rtn,
    resolve_group,
    unpack,
)

# Columns updated together before the lazy update of the rest (the reference's 128).
BLOCK_COLUMNS = 128
# Cholesky of a damped Hessian can still fail on degenerate inputs: retry with 10x the damping.
DAMP_RETRIES = 3


def hessian(x: Tensor) -> Tensor:
    """x [n, in] -> H = 2 XᵀX / n [in, in] in float32 (zeros for n = 0)."""
    x = x.float()
    return 2 * x.T @ x / max(1, x.shape[0])


def _inverse_cholesky(h: Tensor, damp_percent: float) -> Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1."""
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    mean_diag = h.diagonal().mean().clamp(min=1e-8)
    damp = damp_percent
    for _ in range(DAMP_RETRIES):
        try:
            chol = torch.linalg.cholesky(h + damp * mean_diag * eye)
            return torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)
        except torch.linalg.LinAlgError:
            damp *= 10
    raise QuantFormatError(f"gptq: the Hessian is not positive definite even with damping {damp / 10:g}; "
                           "raise damp_percent or give more calibration tokens")


def group_params(w: Tensor, bits: int, symmetric: bool, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """w [out, g] (one group of columns) -> (scale [out], zero code [out]) in float32, the scale
    already rounded to `scale_dtype` so codes are chosen against the value that is stored."""
    qw = quantize_rtn(w, bits, w.shape[1], symmetric, scale_dtype=torch.float32)
    zero = unpack(qw)[1][:, 0].float()
    # A float16 scale must stay a positive normal number (all-zero groups round to 1e-10 in rtn).
    scale = qw.scales[:, 0].clamp(min=torch.finfo(scale_dtype).tiny).to(scale_dtype).float()
    return scale, zero


def gptq_quantize(w: Tensor, h: Tensor, bits: int, group_size: int, symmetric: bool = False, *,
                  damp_percent: float = 0.01, act_order: bool = False,
                  scale_dtype: torch.dtype = torch.float16) -> QuantizedWeight:
    """w [out, in], H [in, in] (hessian() of the layer's inputs) -> record with scales in `scale_dtype`.

    Input columns that never see a non-zero input (H diagonal 0) keep their weights and are
    rounded to nearest: the reference zeroes them, which is harmless on the calibration data
    but not on other inputs.
    """
    out, inp = w.shape
    check_scheme(bits, group_size, inp, "gptq")
    group_size = resolve_group(group_size, inp)
    if h.shape != (inp, inp):
        raise QuantFormatError(f"gptq: Hessian must be [{inp}, {inp}] for a [{out}, {inp}] weight, got {list(h.shape)}")
    if not 0 <= damp_percent < 1:
        raise QuantFormatError(f"gptq: damp_percent must be in [0, 1), got {damp_percent}")
    W = w.float().clone()
    H = h.float().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    perm = torch.argsort(H.diagonal(), descending=True, stable=True) if act_order else None
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    hinv = _inverse_cholesky(H, damp_percent)
    maxq = (1 << bits) - 1
    codes = torch.empty(out, inp, dtype=torch.int32, device=W.device)
    scales = torch.empty(out, inp // group_size, dtype=torch.float32, device=W.device)
    zeros = torch.empty_like(scales)
    # Blocks hold whole groups, so a group's parameters come from columns already updated.
    block = -(-BLOCK_COLUMNS // group_size) * group_size
    for i1 in range(0, inp, block):
        i2 = min(i1 + block, inp)
        w1 = W[:, i1:i2].clone()
        err = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:
                g = col // group_size
                scales[:, g], zeros[:, g] = group_params(w1[:, i : i + group_size], bits, symmetric, scale_dtype)
            scale, zero = scales[:, col // group_size], zeros[:, col // group_size]
            q = torch.clamp(torch.round(w1[:, i] / scale) + zero, 0, maxq)
            codes[:, col] = q.to(torch.int32)
            e = (w1[:, i] - (q - zero) * scale) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err[:, i] = e
        W[:, i2:] -= err @ hinv[i1:i2, i2:]
    g_idx = None
    if perm is not None:
        inverse = torch.argsort(perm)
        codes = codes[:, inverse]
        g_idx = (torch.arange(inp, device=W.device) // group_size)[inverse]
    return pack(codes, scales.to(scale_dtype), None if symmetric else zeros.to(torch.int32), bits, group_size, g_idx)

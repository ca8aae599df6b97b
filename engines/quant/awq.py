"""AWQ (Lin et al., 2024): activation-aware per-input-channel scales, searched on calibration data.

A weight W [out, in] fed x is rewritten as (W·diag(s))·(x/s): exact in full precision, but the
input channels with large activations get larger weights and so smaller relative rounding
error. `s = mean|x|^alpha`, normalised by sqrt(max·min), for alpha on a grid over [0, 1]; the
alpha whose round-to-nearest quantization gives the least output error on the calibration
inputs wins (alpha = 0 is plain RTN, so the search never does worse than RTN on those inputs).

Where the 1/s goes is the caller's choice (calibrate.py): for routed experts' gate/up it is
one scale for all experts of a layer, folded into the RMSNorm before the router (see there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.quant.rtn import rtn_fake_quantize

GRID = 20  # alpha in {0, 1/20, ..., 1}; clip ratios 1, 0.95, ..., 0.55
MAX_SHRINK = 0.5
CLIP_TOKENS = 512  # AutoAWQ's n_sample_token for the clip search
CLIP_ROWS = 1024  # rows per chunk of the clip search ([rows, groups, tokens] floats at once)


@dataclass(frozen=True)
class ScaleChoice:
    alpha: float
    scale: Tensor  # [in] float32; the weight is multiplied by it, its input divided
    loss: float  # output MSE at this alpha
    rtn_loss: float  # output MSE at alpha = 0 (plain round-to-nearest)


def act_scale(x: Tensor) -> Tensor:
    """x [n, in] -> mean |x| per input channel [in] in float32 (AutoAWQ's get_act_scale)."""
    return x.float().abs().mean(0) if x.shape[0] else torch.ones(x.shape[1], device=x.device)


def candidate_scale(stat: Tensor, alpha: float) -> Tensor:
    """mean|x|^alpha, clamped away from 0 and normalised so that max·min = 1 (AutoAWQ's rule)."""
    s = stat.pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def fake_quantize(w: Tensor, scale: Tensor, bits: int, group_size: int, symmetric: bool) -> Tensor:
    """What W [..., out, in] becomes when W·diag(s) is quantized and the scale taken back out.

    The unpacked reference rounding (rtn.py): it differs from the packed format's only in
    groups of one sign, which is noise for a search criterion and saves packing every candidate.
    """
    return rtn_fake_quantize(w.float() * scale, bits, group_size, symmetric) / scale


def search_scale(stat: Tensor, loss: Callable[[Tensor], float], grid: int = GRID) -> ScaleChoice:
    """The scale on the alpha grid minimising `loss(scale)` (the caller's output MSE)."""
    best: ScaleChoice | None = None
    rtn_loss = float("nan")
    for step in range(grid + 1):
        alpha = step / grid
        s = candidate_scale(stat, alpha)
        value = loss(s)
        if step == 0:
            rtn_loss = value
        if best is None or value < best.loss:
            best = ScaleChoice(alpha, s, value, rtn_loss)
    assert best is not None
    return ScaleChoice(best.alpha, best.scale, best.loss, rtn_loss)


def linear_loss(x: Tensor, w: Tensor, bits: int, group_size: int, symmetric: bool) -> Callable[[Tensor], float]:
    """loss(s) = mean ||x Ŵᵀ - x Wᵀ||² for Ŵ = fake_quantize(W, s): one linear layer's output error."""
    x = x.float()
    reference = x @ w.float().T

    def loss(s: Tensor) -> float:
        return float((x @ fake_quantize(w, s, bits, group_size, symmetric).T - reference).pow(2).mean())

    return loss


def search_clip(x: Tensor, w: Tensor, bits: int, group_size: int, symmetric: bool, grid: int = GRID) -> Tensor:
    """w [out, in] with each (row, group) clipped to ±r·max|w| for the r minimising the error of the
    group's partial output x_g·w_gᵀ over (a strided sample of) x [n, in]."""
    if x.shape[0] == 0:
        return w
    x = x.float()[:: max(1, x.shape[0] // CLIP_TOKENS)]
    out, inp = w.shape
    xg = x.view(x.shape[0], inp // group_size, group_size)
    clipped = []
    for r0 in range(0, out, CLIP_ROWS):
        wg = w[r0 : r0 + CLIP_ROWS].float().view(-1, inp // group_size, group_size)
        amax = wg.abs().amax(-1, keepdim=True)
        best, best_err = amax, None
        for step in range(int(MAX_SHRINK * grid)):
            limit = amax * (1 - step / grid)
            q = rtn_fake_quantize(torch.maximum(torch.minimum(wg, limit), -limit), bits, group_size, symmetric)
            err = torch.einsum("ngk,ogk->ogn", xg, q - wg).pow(2).mean(-1, keepdim=True)
            if best_err is None:
                best_err = err
            better = err < best_err
            best, best_err = torch.where(better, limit, best), torch.where(better, err, best_err)
        clipped.append(torch.maximum(torch.minimum(wg, best), -best).view(-1, inp))
    return torch.cat(clipped)

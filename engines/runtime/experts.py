"""Routing and expert computation: tokens grouped by expert, one matmul per expert per step.

Shapes: T tokens, A experts per token, E experts, D hidden, I expert intermediate.
`route` picks experts; `dispatch` sorts the T*A assignments by expert so each expert's
tokens are contiguous (the layout every expert kernel consumes); `grouped_swiglu` is the
torch reference expert compute. Other weight formats plug in their own compute function
with the same signature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.runtime.weights import DenseExperts, MLPWeights


def route(x: Tensor, router: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """x [T, D] -> (expert ids [T, A], weights [T, A] in x's dtype). Softmax in float32."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(x.dtype)


@dataclass
class Dispatch:
    """The T*A token->expert assignments sorted by expert id."""

    token_index: Tensor  # [T*A] row of x for each sorted assignment
    weights: Tensor  # [T*A] routing weight of each sorted assignment
    counts: list[int]  # [E] assignments per expert, on the host (loop bounds)


def dispatch(ids: Tensor, weights: Tensor, counts: list[int]) -> Dispatch:
    """`counts` = bincount of ids (on the host); the caller moves it so the copy is accounted."""
    order = torch.argsort(ids.flatten(), stable=True)
    return Dispatch(order // ids.shape[1], weights.flatten()[order], counts)


def swiglu(x: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """x [n, D], gate_up [2I, D] (gate rows first), down [D, I] -> [n, D]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def dense_mlp(x: Tensor, w: MLPWeights) -> Tensor:
    return swiglu(x, w.gate_up, w.down)


def grouped_swiglu(x: Tensor, d: Dispatch, experts: DenseExperts) -> Tensor:
    """Reference expert compute: x [T, D] -> sum over each token's experts of weight * expert(x)."""
    xs = x[d.token_index]
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(d.counts):
        if n:
            out[start : start + n] = swiglu(xs[start : start + n], experts.gate_up[e], experts.down[e])
            start += n
    out *= d.weights[:, None]
    # Assignments are in ascending expert order, so each token's sum runs in the same order as
    # transformers' per-expert loop: identical float results, not just close ones.
    return torch.zeros_like(x).index_add_(0, d.token_index, out)

"""Routing, dispatch and the expert seam: `ExpertBackend`, where routed experts live and run.

Shapes: T tokens, A experts per token, E experts, D hidden, I expert intermediate.
`route` picks experts; `dispatch` sorts the T*A assignments by expert so each expert's
tokens are contiguous (the layout every expert kernel consumes). An `ExpertBackend` gets
`forward(layer, x, dispatch)`: the dispatch names the experts that have tokens, so a backend
that keeps weights elsewhere fetches exactly those first (through the TransferLedger). Its
storage is addressable per (layer, expert). `ResidentBackend` (every expert on the device, any
stacked record and compute) and the torch reference compute `grouped_swiglu` live here; the
quantized backend is built in engines/quant/load.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.runtime.gemm import PackedWeight, linear, pack, packed_bytes
from engines.runtime.weights import DenseExperts, MLPWeights


def route(x: Tensor, router: Tensor, top_k: int, normalize: bool, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [T, D] -> (expert ids [T, A], weights [T, A] in x's dtype). Softmax in float32."""
    probs = torch.softmax(F.linear(x, router, bias).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(x.dtype)


def route_groups(x: Tensor, router: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int,
                 normalize: bool, scale: float) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 / GLM-4.5 routing, x [T, D] -> (ids [T, A], weights [T, A]). In float32:
    sigmoid scores; the correction bias steers which experts are chosen, not their weight;
    only the `topk_group` groups with the best two-expert sums compete."""
    scores = torch.sigmoid(F.linear(x.float(), router.float()))
    choice = scores + bias.float()
    T, E = choice.shape
    groups = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)  # [T, n_group]
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(topk_group, dim=-1).indices, True)
    choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, (weights * scale).to(x.dtype)


@dataclass
class Dispatch:
    """The T*A token->expert assignments sorted by expert id."""

    token_index: Tensor  # [T*A] row of x for each sorted assignment
    weights: Tensor  # [T*A] routing weight of each sorted assignment
    counts: list[int]  # [E] assignments per expert, on the host (loop bounds)

    @property
    def active(self) -> list[int]:
        """Experts with at least one token, ascending."""
        return [e for e, n in enumerate(self.counts) if n]


def dispatch(ids: Tensor, weights: Tensor, counts: list[int]) -> Dispatch:
    """`counts` = bincount of ids (on the host); the caller moves it so the copy is accounted."""
    order = torch.argsort(ids.flatten(), stable=True)
    return Dispatch(order // ids.shape[1], weights.flatten()[order], counts)


def swiglu(x: Tensor, gate_up: Tensor | PackedWeight, down: Tensor | PackedWeight, gate_up_bias: Tensor | None = None,
           down_bias: Tensor | None = None, clamp: tuple[float, float] | None = None) -> Tensor:
    """x [n, D], gate_up [2I, D] (gate rows first), down [D, I] -> [n, D]; either weight may
    be packed (engines/runtime/gemm.py). With `clamp`
    (limit, alpha), gpt-oss's variant: gate <= limit, |up| <= limit, gate * sigmoid(alpha *
    gate) * (up + 1)."""
    gate, up = linear(x, gate_up, gate_up_bias).chunk(2, dim=-1)
    if clamp is None:
        return linear(F.silu(gate).mul_(up), down, down_bias)
    limit, alpha = clamp
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return linear((up + 1) * (gate * torch.sigmoid(gate * alpha)), down, down_bias)


def dense_mlp(x: Tensor, w: MLPWeights) -> Tensor:
    return swiglu(x, w.gate_up, w.down)


def segments(d: Dispatch) -> dict[int, slice]:
    """Expert -> its rows in the sorted assignments (experts with tokens only)."""
    out, start = {}, 0
    for e, n in enumerate(d.counts):
        if n:
            out[e] = slice(start, start + n)
            start += n
    return out


def combine(x: Tensor, d: Dispatch, out: Tensor) -> Tensor:
    """Per-assignment expert outputs [T*A, D] -> each token's routing-weighted sum [T, D].
    Assignments are in ascending expert order, so each token's sum runs in the same order as
    transformers' per-expert loop: identical float results, whatever order experts ran in."""
    out *= d.weights[:, None]
    return torch.zeros_like(x).index_add_(0, d.token_index, out)


def grouped_swiglu(x: Tensor, d: Dispatch, experts: DenseExperts) -> Tensor:
    """Reference expert compute: x [T, D] -> sum over each token's experts of weight * expert(x)."""
    xs = x[d.token_index]
    out = torch.empty_like(xs)
    gu_bias, down_bias = getattr(experts, "gate_up_bias", None), getattr(experts, "down_bias", None)
    clamp = getattr(experts, "clamp", None)
    for e, rows in segments(d).items():
        out[rows] = swiglu(xs[rows], experts.gate_up[e], experts.down[e],
                           None if gu_bias is None else gu_bias[e], None if down_bias is None else down_bias[e], clamp)
    return combine(x, d, out)


@dataclass
class PackedExperts:
    """One layer's experts as `grouped_swiglu` reads them, each matrix packed (gemm.pack)."""

    gate_up: list[PackedWeight | Tensor]  # [E] of [2I, D]
    down: list[PackedWeight | Tensor]  # [E] of [D, I]


class ExpertBackend(ABC):
    """Owns the routed-expert weights of every MoE layer and computes them.

    `forward` runs layer `layer`'s experts over `x` as `d` dispatches it (sum over each token's
    experts of routing weight * expert(x)). Storage is per (layer, expert): `expert_bytes` is
    what one expert holds on the device, which may differ between experts once formats mix.
    `step_stats` reports this step's expert traffic and resets it.
    """

    def __init__(self) -> None:
        self._stats: Counter[str] = Counter()

    @property
    def copies_overlap(self) -> bool:
        """--simulate: this backend's copies run beside compute (prefetch), not waited for."""
        return False

    @abstractmethod
    def forward(self, layer: int, x: Tensor, d: Dispatch) -> Tensor: ...

    @abstractmethod
    def layers(self) -> list[int]:
        """The MoE layers whose experts this backend holds, ascending."""

    @abstractmethod
    def expert_bytes(self, layer: int, expert: int) -> int:
        """Device bytes of one expert's weights as stored."""

    def prefetch(self, layer: int) -> None:  # noqa: B027  (an optional hook: a no-op by default)
        """Start making `layer`'s experts resident ahead of use (no-op when they always are)."""

    def prepack(self) -> int:
        """Pack the full-precision experts that stay resident for MKL's GEMM where that applies
        (engines/runtime/gemm.py: a CPU float32 run); the packed bytes (0: none)."""
        return 0

    def device_bytes(self) -> int:
        """Device bytes held for routed experts now."""
        return sum(self.expert_bytes(i, e) for i in self.layers() for e in range(self.num_experts(i)))

    @abstractmethod
    def num_experts(self, layer: int) -> int: ...

    def step_stats(self) -> dict[str, int]:
        """Since the previous call: `expert_bytes_read`, the bytes of the experts that ran at
        their stored size (which experts ran is the router's counts, StepOutput.experts_hit);
        then reset."""
        stats, self._stats = self._stats, Counter()
        return {"expert_bytes_read": stats["expert_bytes_read"]}

    def simulate(self, layer: int, d: Dispatch, upcoming: tuple[int, list[int]] | None = None) -> None:
        """A simulated step (--simulate): what `forward` decides and counts for `d`'s experts, with
        no compute (`d` carries only counts; `upcoming` is the next MoE layer and its experts,
        most tokens first, for a backend that prefetches). Backends whose experts always stay
        resident just count; one that moves experts runs its residency decisions and copies."""
        self._count(layer, d)

    def simulate_step(self, layers: list[int], counts: Any) -> Any:
        """A simulated step's `simulate` for every MoE layer at once, where the backend can: counts
        [len(layers), E] (numpy) are the tokens per expert; returns each expert's stored bytes as
        the step ran them ([len(layers), E], for pricing), or None, and the executor calls
        `simulate` layer by layer (the default; a backend whose decisions depend on layer order)."""
        return None

    def _count(self, layer: int, d: Dispatch) -> None:
        """Record the experts `d` runs in `layer` (backends call this from forward)."""
        self.count_experts(layer, d.counts)

    def count_experts(self, layer: int, counts: list[int]) -> None:
        """Record the experts with tokens in `counts` (per expert) as run in `layer`."""
        self._stats["expert_bytes_read"] += sum(self.expert_bytes(layer, e) for e, n in enumerate(counts) if n)

    def count_bytes(self, nbytes: int) -> None:
        """Record `nbytes` of experts run (a simulated step's layers counted at once, engines/sim/executor.py)."""
        self._stats["expert_bytes_read"] += nbytes


class StackedBackend(ExpertBackend):
    """An ExpertBackend over one stacked record per MoE layer (`stacks`: layer -> a record with
    `num_experts` and `expert_nbytes(e)`, the same for every e of a stack): layers, expert
    counts and per-expert bytes follow from it, the bytes computed once (looked up per expert
    that runs, every step)."""

    def __init__(self, stacks: Mapping[int, Any]) -> None:
        super().__init__()
        self.stacks = stacks
        self._expert_bytes = {i: w.expert_nbytes(0) for i, w in stacks.items()}

    def layers(self) -> list[int]:
        return sorted(self.stacks)

    def num_experts(self, layer: int) -> int:
        return self.stacks[layer].num_experts

    def expert_bytes(self, layer: int, expert: int) -> int:
        return self._expert_bytes[layer]

    def count_experts(self, layer: int, counts: list[int]) -> None:
        self._stats["expert_bytes_read"] += self._expert_bytes[layer] * (len(counts) - counts.count(0))


class ResidentBackend(StackedBackend):
    """Every layer's experts resident on the device in one stacked record per layer, run by
    `compute(x, dispatch, record)`: DenseExperts with `grouped_swiglu` for `moe`, packed
    QuantizedExperts with the fused kernel for the static engines. A record has
    `nbytes()`, `expert_nbytes(e)` (the same for every e of a stack) and `num_experts`."""

    def __init__(self, layers: dict[int, Any],
                 compute: Callable[[Tensor, Dispatch, Any], Tensor] | None = None) -> None:
        super().__init__(layers)
        self._compute = compute or grouped_swiglu
        self._packed: dict[int, PackedExperts] = {}  # layer -> packed copies (prepack)
        self._device_bytes: int | None = None

    def forward(self, layer: int, x: Tensor, d: Dispatch) -> Tensor:
        self._count(layer, d)
        if layer in self._packed:
            return grouped_swiglu(x, d, self._packed[layer])
        return self._compute(x, d, self.stacks[layer])

    def prepack(self) -> int:
        """Dense bias-free stacks run by `grouped_swiglu` (engine moe's) get packed copies."""
        if self._compute is not grouped_swiglu:
            return 0
        for i, w in self.stacks.items():
            if (isinstance(w, DenseExperts) and getattr(w, "gate_up_bias", None) is None
                    and getattr(w, "clamp", None) is None):
                self._packed[i] = PackedExperts([pack(t) for t in w.gate_up], [pack(t) for t in w.down])
        return sum(packed_bytes(p.gate_up) + packed_bytes(p.down) for p in self._packed.values())

    def weights(self, layer: int) -> Any:
        """Layer `layer`'s stacked expert record (the compute's input)."""
        return self.stacks[layer]

    def device_bytes(self) -> int:
        if self._device_bytes is None:  # the stacks never change: summed once (every step asks)
            self._device_bytes = sum(w.nbytes() for w in self.stacks.values())
        return self._device_bytes

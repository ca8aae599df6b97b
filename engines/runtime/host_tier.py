"""`HostTierBackend`: routed experts kept in the host tier (pinned on CUDA) and copied to device
buffers when used; the base that engine offload's cache and moegen's streaming ring share.
`ExpertSlots` are those device buffers: k experts of one stack's shape, weights and (gpt-oss)
biases, computed with the stack's SwiGLU (clamped or not) exactly as `grouped_swiglu` computes
the resident stack. A host tier of `Mxfp4Experts` (a gpt-oss MXFP4 folder served as stored)
has `Mxfp4Slots` instead: the 4-bit blocks, scale bytes and biases of k experts, copied as
stored and computed by `mxfp4_expert_forward` (the same values as the dequantized load).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engines.runtime.copies import CopyEngine, CopyHandle
from engines.runtime.experts import StackedBackend, swiglu
from engines.runtime.mxfp4 import Mxfp4Expert, Mxfp4Experts, mxfp4_expert_forward
from engines.runtime.weights import DenseExperts


def _each(w: DenseExperts) -> tuple[Tensor | None, ...]:
    """An expert stack's per-expert tensors, in copy order (weights, then the biases or None)."""
    return w.gate_up, w.down, w.gate_up_bias, w.down_bias


@dataclass
class ExpertSlots:
    """k device buffers each holding one expert of a stack's shape: gate_up [k, 2I, D], down
    [k, D, I] and, for a stack with biases, gate_up_bias [k, 2I] and down_bias [k, D]."""

    gate_up: Tensor
    down: Tensor
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None
    clamp: tuple[float, float] | None = None

    @classmethod
    def like(cls, w: DenseExperts, k: int, device: torch.device) -> ExpertSlots:
        """k zeroed slots shaped as one expert of `w` (its biases too when it has them)."""
        bufs = [None if t is None else torch.zeros((k, *t.shape[1:]), dtype=t.dtype, device=device) for t in _each(w)]
        return cls(*bufs, clamp=w.clamp)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self.gate_up.shape[0]

    def nbytes(self) -> int:
        """The buffers' bytes (allocated once, full or not)."""
        return sum(t.numel() * t.element_size() for t in self._tensors() if t is not None)

    def _tensors(self) -> tuple[Tensor | None, ...]:
        return self.gate_up, self.down, self.gate_up_bias, self.down_bias

    def copies(self, slot: int, host: DenseExperts, expert: int) -> list[tuple[Tensor, Tensor]]:
        """The (device slot, host) pairs that load `host`'s expert `expert` into `slot`."""
        return [(dst[slot], src[expert]) for dst, src in zip(self._tensors(), _each(host))
                if dst is not None and src is not None]

    def copy_size(self, host: DenseExperts, expert: int) -> tuple[int, int]:
        """(bytes, transfers) of `copies(slot, host, expert)`'s pairs, from shapes alone (a
        simulated run counts a copy without slicing meta tensors)."""
        sizes = [src[expert].numel() * src.element_size() for dst, src in zip(self._tensors(), _each(host))
                 if dst is not None and src is not None]
        return sum(sizes), len(sizes)

    def run(self, slot: int, x: Tensor) -> Tensor:
        """The expert in `slot` over its rows x [n, D] -> [n, D]."""
        gu_bias, down_bias = self.gate_up_bias, self.down_bias
        return swiglu(x, self.gate_up[slot], self.down[slot], None if gu_bias is None else gu_bias[slot],
                      None if down_bias is None else down_bias[slot], self.clamp)


@dataclass
class Mxfp4Slots:
    """k device buffers each holding one MXFP4 expert as stored: `parts` maps each of
    Mxfp4Expert.tensors()'s names (gate_up/down blocks and scales, the biases) to [k, ...]."""

    parts: dict[str, Tensor]
    clamp: tuple[float, float] | None = None

    @classmethod
    def like(cls, w: Mxfp4Experts, k: int, device: torch.device) -> Mxfp4Slots:
        """k zeroed slots shaped as one expert of `w` (its blocks, scales and biases)."""
        return cls({name: torch.zeros((k, *t.shape), dtype=t.dtype, device=device)
                    for name, t in w.expert(0).tensors().items()}, w.clamp)

    def __len__(self) -> int:
        return next(iter(self.parts.values())).shape[0]

    def nbytes(self) -> int:
        """The buffers' bytes: 4-bit blocks, scale bytes and biases (allocated once)."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def copies(self, slot: int, host: Mxfp4Experts, expert: int) -> list[tuple[Tensor, Tensor]]:
        """The (device slot, host) pairs that load `host`'s expert `expert` into `slot`: the
        stored bytes, nothing dequantized."""
        src = host.expert(expert).tensors()
        return [(dst[slot], src[name]) for name, dst in self.parts.items()]

    def copy_size(self, host: Mxfp4Experts, expert: int) -> tuple[int, int]:
        """(bytes, transfers) of `copies(slot, host, expert)`'s pairs: the stored bytes."""
        src = host.expert(expert).tensors()
        sizes = [src[name].numel() * src[name].element_size() for name in self.parts]
        return sum(sizes), len(sizes)

    def run(self, slot: int, x: Tensor) -> Tensor:
        """The expert in `slot` over its rows x [n, D] -> [n, D]."""
        expert = Mxfp4Expert.from_tensors({name: t[slot] for name, t in self.parts.items()}, self.clamp)
        return mxfp4_expert_forward(x, expert)


Slots = ExpertSlots | Mxfp4Slots
HostStack = DenseExperts | Mxfp4Experts


def slots_like(w: HostStack, k: int, device: torch.device) -> Slots:
    """k device slots for experts of the host stack `w` (MXFP4 slots for an MXFP4 stack)."""
    return Mxfp4Slots.like(w, k, device) if isinstance(w, Mxfp4Experts) else ExpertSlots.like(w, k, device)


def host_stack(w: HostStack, copies: CopyEngine) -> HostStack:
    """`w` moved to the host tier (pinned on CUDA), in the same record type."""

    def host(t: Tensor | None) -> Tensor | None:
        return None if t is None else copies.host(t)

    if isinstance(w, Mxfp4Experts):
        return Mxfp4Experts(w.gate_up.map_tensors(copies.host), w.down.map_tensors(copies.host),
                            host(w.gate_up_bias), host(w.down_bias), w.clamp)
    return DenseExperts(*(host(t) for t in _each(w)), w.clamp)  # type: ignore[misc]


class HostTierBackend(StackedBackend):
    """Experts kept in the host tier (`host`: MoE layer -> DenseExperts at full precision, or
    Mxfp4Experts as an MXFP4 folder stores them; biases and clamp included) and copied to
    device slots when used: what OffloadBackend and moegen's StreamingBackend share."""

    def __init__(self, experts: dict[int, HostStack], copies: CopyEngine) -> None:
        self.copies = copies
        self.host = {i: host_stack(w, copies) for i, w in experts.items()}
        super().__init__(self.host)
        self._copy_size: dict[int, tuple[int, int]] = {}  # layer -> (bytes, transfers) of one expert's copy

    def copy_in(self, slots: Slots, slot: int, layer: int, expert: int) -> tuple[CopyHandle, int]:
        """Copy host expert `expert` of `layer` into device slot `slot` of `slots`: the handle and
        the bytes copied. A simulated run counts the copy from the layer's expert size (every
        expert of a stack has one), memoised, without slicing its meta tensors."""
        if self.copies.simulated:
            size = self.copy_size_of(layer, slots)
            return self.copies.counted("h2d", *size, tag="experts"), size[0]
        pairs = slots.copies(slot, self.host[layer], expert)
        return self.copies.h2d(pairs, tag="experts"), sum(src.numel() * src.element_size() for _, src in pairs)

    def copy_size_of(self, layer: int, slots: Slots) -> tuple[int, int]:
        """(bytes, transfers) of copying one of `layer`'s experts into `slots` (every expert of a
        stack has one size), memoised."""
        size = self._copy_size.get(layer)
        if size is None:
            size = self._copy_size[layer] = slots.copy_size(self.host[layer], 0)
        return size

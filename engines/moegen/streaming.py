"""StreamingBackend: routed experts in the host tier, streamed through a ring of device slots.

Module-based batching runs each layer's experts once per step over every token routed to
them, so an expert crosses the link at most once per step whatever the batch size (that is
where MoE-Gen's bytes per token come from). Some experts may stay resident (the plan sizes
them from the budget); the others stream through `slots` device buffers, in one FIFO order:
layer by layer, expert by expert.

- `prefetch(layer)` queues the layer's streamed experts and issues copies while slots are
  free, so the next layer's weights copy while this layer computes (the executor calls it a
  layer ahead when the batch is large enough that every expert will run);
- `forward(layer)` drops queued, not yet issued experts that got no tokens, runs resident
  experts first (while copies land), then each streamed one as its copy lands; a slot frees
  when its expert has run and takes the next queued copy.

Every decision is made on the calling thread from the routing alone, so bytes and transfers
are deterministic; only the copies' timing is the link's. Each expert runs the same SwiGLU (its
biases and clamp included, for gpt-oss: a slot holds an expert's biases beside its weights) on
the same rows as in the resident backend and `combine` sums in expert order: identical output.
"""

from __future__ import annotations

import time
from collections import deque

import torch
from torch import Tensor

from engines.runtime.copies import CopyEngine, CopyHandle
from engines.runtime.experts import Dispatch, combine, segments, swiglu
from engines.runtime.gemm import PackedWeight, pack, packed_bytes
from engines.runtime.host_tier import ExpertSlots, HostTierBackend
from engines.runtime.weights import DenseExperts

Key = tuple[int, int]  # (layer, expert)


class StreamingBackend(HostTierBackend):
    def __init__(self, experts: dict[int, DenseExperts], slots: int, resident: set[Key], copies: CopyEngine,
                 device: torch.device) -> None:
        shapes = {(tuple(w.gate_up.shape[1:]), tuple(w.down.shape[1:]), w.gate_up_bias is None, w.down_bias is None,
                   w.clamp) for w in experts.values()}
        if len(shapes) > 1:
            raise ValueError(f"streamed experts must share one shape (and biases, clamp) across layers, "
                             f"got {sorted(shapes, key=repr)}")
        streamed = sum(w.num_experts for w in experts.values()) - len(resident)
        if streamed and slots < 1:
            raise ValueError(f"{streamed} experts stream and need at least one device slot, got {slots}")
        super().__init__(experts, copies)
        # Resident experts stay where loading put them (own storage, so the stacks can go): each
        # one slot of its own, weights and biases.
        self.resident: dict[Key, ExpertSlots] = {}
        for i, e in sorted(resident):
            own = ExpertSlots.like(experts[i], 1, device)
            for dst, src in own.copies(0, experts[i], e):
                dst.copy_(src)
            self.resident[(i, e)] = own
        first = next(iter(experts.values()))
        n = slots if streamed else 0
        self.ring = ExpertSlots.like(first, n, device)
        self._free: deque[int] = deque(range(n))
        self._queue: deque[Key] = deque()  # streamed experts queued, not yet issued, FIFO
        self._issued: dict[Key, tuple[int, CopyHandle]] = {}  # slot and copy of experts in flight or landed
        self._queued_layers: set[int] = set()
        self._stall = 0.0  # compute's wait for expert copies this step
        self._packed: dict[Key, tuple[PackedWeight | Tensor, PackedWeight | Tensor]] = {}  # prepack
        self._device_bytes: int | None = None

    def prepack(self) -> int:
        """Resident bias-free experts get packed copies (a linear with a bias runs F.linear
        anyway); streamed ones land in a slot each step, where packing would cost what it saves."""
        self._packed = {k: (pack(s.gate_up[0]), pack(s.down[0])) for k, s in self.resident.items()
                        if s.gate_up_bias is None and s.down_bias is None}
        return sum(packed_bytes(pair) for pair in self._packed.values())

    # -- ExpertBackend -----------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Resident experts and the ring's slots, weights and biases (allocated once, full or not)."""
        if self._device_bytes is None:  # both fixed at load: summed once
            self._device_bytes = sum(s.nbytes() for s in self.resident.values()) + self.ring.nbytes()
        return self._device_bytes

    def num_slots(self) -> int:
        return len(self.ring)

    def prefetch(self, layer: int) -> None:
        if layer in self._queued_layers or layer not in self.host:
            return
        self._enqueue(layer, range(self.num_experts(layer)))

    def _enqueue(self, layer: int, experts) -> None:
        self._queued_layers.add(layer)
        self._queue.extend((layer, e) for e in experts if (layer, e) not in self.resident)
        self._issue()

    @property
    def copies_overlap(self) -> bool:
        return True

    def forward(self, layer: int, x: Tensor, d: Dispatch) -> Tensor:
        return self._run(layer, x, d)  # type: ignore[return-value]

    def simulate(self, layer: int, d: Dispatch, upcoming: tuple[int, list[int]] | None = None) -> None:
        """The same queue, ring and copies as `forward`, no compute (--simulate; `d` carries only
        counts). `upcoming` is not used: the executor queues a layer ahead (`prefetch`) as it does
        in a measured run."""
        self._run(layer, None, d)

    def _run(self, layer: int, x: Tensor | None, d: Dispatch) -> Tensor | None:
        """`forward`'s decisions in order; with x None (a simulated step) every compute is skipped."""
        self._count(layer, d)
        rows = segments(d)
        if layer not in self._queued_layers:  # not queued ahead: copy exactly the experts with tokens
            self._enqueue(layer, rows)
        else:  # queued ahead: copies not yet issued for experts that got no tokens are dropped
            self._queue = deque(k for k in self._queue if k[0] != layer or k[1] in rows)
            self._issue()
        xs = x[d.token_index] if x is not None else None
        out = torch.empty_like(xs) if xs is not None else None
        if xs is not None:
            for e in rows:
                if (layer, e) in self.resident:
                    packed = self._packed.get((layer, e))
                    out[rows[e]] = (swiglu(xs[rows[e]], *packed, clamp=self.ring.clamp) if packed is not None
                                    else self.resident[(layer, e)].run(0, xs[rows[e]]))
        # This layer's streamed experts are at the head of the FIFO (earlier layers are done).
        for e in range(self.num_experts(layer)):
            key = (layer, e)
            if key in self.resident or (key not in self._issued and key not in self._queue):
                continue
            if key not in self._issued:  # queued for want of a slot: the one freed last fits it
                self._issue()
            slot, handle = self._issued.pop(key)
            if e in rows:
                t0 = time.perf_counter()
                handle.wait()
                self._stall += time.perf_counter() - t0
                if xs is not None:
                    out[rows[e]] = self.ring.run(slot, xs[rows[e]])
                self._stats["streamed_experts"] += 1
            else:  # prefetched a layer ahead, then routed no token
                self._stats["streamed_unused"] += 1
            self._free.append(slot)
            self._issue()
        self._queued_layers.discard(layer)
        return combine(x, d, out) if x is not None else None

    def step_stats(self) -> dict[str, float]:
        """Also: experts streamed (used / unused) and, for the expert copies alone, the link's
        busy time (bytes / bandwidth; with the CPU link model) and compute's wait for them, so
        the expert stream's overlap shows apart from synchronous activation copies."""
        stats = dict(self._stats)
        out: dict[str, float] = dict(super().step_stats())
        out["streamed_experts"] = stats.get("streamed_experts", 0)
        out["streamed_unused"] = stats.get("streamed_unused", 0)
        if self.copies.bytes_per_s is not None:
            out["expert_copy_busy_s"] = stats.get("streamed_bytes", 0) / self.copies.bytes_per_s
            out["expert_copy_stall_s"] = self._stall
        self._stall = 0.0
        return out

    # -- copies ------------------------------------------------------------------------------------
    def _issue(self) -> None:
        """Issue queued copies, in order, into free slots. A slot is reused only after its
        expert ran; on CUDA the copy stream waits for the compute stream first (copies.py)."""
        while self._queue and self._free:
            layer, e = key = self._queue.popleft()
            slot = self._free.popleft()
            handle, nbytes = self.copy_in(self.ring, slot, layer, e)
            self._stats["streamed_bytes"] += nbytes
            self._issued[key] = (slot, handle)

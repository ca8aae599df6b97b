"""Routed experts in the host tier, a device cache of expert slots per layer: `OffloadBackend`.

Every expert lives in the host tier (pinned on CUDA): at full precision, or, for a gpt-oss
MXFP4 folder served as stored, its 4-bit blocks, scale bytes and biases (`Mxfp4Experts`: slots,
copies and bytes are then those, and each expert runs `mxfp4_expert_forward`). Each MoE layer
has `slots` device buffers, each able to hold one expert; `ExpertCache` maps experts to slots
and picks victims by policy (`lru`: least recently used; `lfu`: fewest uses, ties to the
least recent). A layer's forward:

1. issues a copy for every expert the router picked that is not resident, into a free slot or
   a victim's (never a slot whose expert this layer still has to run);
2. with `prefetch`, predicts the next MoE layer's experts by running that layer's router on
   this layer's normalized hidden states and issues their copies too (the copy runs while
   this layer computes);
3. runs resident experts first, then each missing one as its copy lands; when slots ran out,
   the slot of an expert already run takes the next missing one.

Every decision (hit, miss, victim, prefetch) is made on the calling thread from the routing
alone, so the bytes and transfers are deterministic for a schedule; only the copies' timing
is the link's. Results are bit-identical to the resident backend: each expert runs the same
SwiGLU (with its biases and clamp, for gpt-oss) on the same rows and `combine` sums them in
expert order. A slot holds an expert's biases beside its weights: they travel and count with it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.runtime.copies import CopyEngine, CopyHandle
from engines.runtime.experts import Dispatch, combine, segments
from engines.runtime.host_tier import HostStack, HostTierBackend, Slots, slots_like

POLICIES = ("lru", "lfu")

# (layer, hidden states [T, D] at that layer's MoE input) -> the next MoE layer and the
# experts predicted for it, most likely first; None when there is no next MoE layer.
Predictor = Callable[[int, Tensor], "tuple[int, list[int]] | None"]


class ExpertCache:
    """Which expert holds which of one layer's device slots, and who leaves next."""

    def __init__(self, num_slots: int, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.slot_of: dict[int, int] = {}
        self.free = list(range(num_slots - 1, -1, -1))
        self.last_use: dict[int, int] = {}
        self.uses: Counter[int] = Counter()
        self.loading: dict[int, CopyHandle] = {}  # copies issued, not yet waited for
        self.prefetched: set[int] = set()  # loaded by the previous layer's prediction

    def touch(self, expert: int, tick: int) -> None:
        self.last_use[expert] = tick
        self.uses[expert] += 1

    def victim(self, keep: set[int]) -> int | None:
        """The resident expert to evict (none of `keep`), or None when every one is kept."""
        candidates = [e for e in self.slot_of if e not in keep]
        if not candidates:
            return None
        if self.policy == "lfu":
            return min(candidates, key=lambda e: (self.uses[e], self.last_use.get(e, -1), e))
        return min(candidates, key=lambda e: (self.last_use.get(e, -1), e))

    def place(self, expert: int, keep: set[int]) -> tuple[int, int | None] | None:
        """A slot for `expert`: (slot, evicted expert or None), or None when none can be freed."""
        if self.free:
            slot, evicted = self.free.pop(), None
        else:
            evicted = self.victim(keep)
            if evicted is None:
                return None
            slot = self.slot_of.pop(evicted)
            self.loading.pop(evicted, None)
            self.prefetched.discard(evicted)
        self.slot_of[expert] = slot
        return slot, evicted


class OffloadBackend(HostTierBackend):
    """Experts in the host tier, `slots` device slots per MoE layer (see the module docstring)."""

    def __init__(self, experts: dict[int, HostStack], slots: int, copies: CopyEngine, device: torch.device,
                 policy: str = "lru", predictor: Predictor | None = None) -> None:
        if slots < 1:
            raise ValueError(f"need at least one expert slot per layer, got {slots}")
        super().__init__(experts, copies)
        self.predictor = predictor
        self.slot_buffers: dict[int, Slots] = {}
        self.caches: dict[int, ExpertCache] = {}
        for i, w in experts.items():
            k = min(slots, w.num_experts)
            self.slot_buffers[i] = slots_like(w, k, device)
            self.caches[i] = ExpertCache(k, policy)
        self._tick = 0

    # -- ExpertBackend ---------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """The slots' buffers, weights and biases (allocated once, full or not)."""
        return sum(s.nbytes() for s in self.slot_buffers.values())

    @property
    def copies_overlap(self) -> bool:
        return self.predictor is not None

    def slots(self, layer: int) -> int:
        return len(self.slot_buffers[layer])

    def forward(self, layer: int, x: Tensor, d: Dispatch) -> Tensor:
        return self._run(layer, x, d)

    def simulate(self, layer: int, d: Dispatch, upcoming: tuple[int, list[int]] | None = None) -> None:
        """The same hits, misses, victims and copies as `forward`, no compute (--simulate). With
        prefetch on, the prediction is `upcoming` (the next MoE layer's experts the simulator
        routes, most tokens first): an exact predictor, where the measured one guesses."""
        self._run(layer, None, d, upcoming)

    def _run(self, layer: int, x: Tensor | None, d: Dispatch,
             upcoming: tuple[int, list[int]] | None = None) -> Tensor | None:
        """`forward`'s decisions in order; with x None (a simulated step) every compute is skipped."""
        self._count(layer, d)
        self._tick += 1
        cache, rows = self.caches[layer], segments(d)
        needed = list(rows)
        self._stats["prefetch_used"] += len(cache.prefetched.intersection(needed))
        cache.prefetched.clear()
        self._stats["expert_cache_hits"] += sum(e in cache.slot_of for e in needed)
        missing = [e for e in needed if e not in cache.slot_of]
        self._stats["expert_cache_misses"] += len(missing)
        pending = set(needed)
        queue = self._fetch(layer, missing, pending)
        if self.predictor is not None:
            self._prefetch(self.predictor(layer, x) if x is not None else upcoming)
        xs = x[d.token_index] if x is not None else None
        out = torch.empty_like(xs) if xs is not None else None
        order = [e for e in needed if e not in missing] + missing
        for e in order:
            if e not in cache.slot_of:  # slots ran out at issue: one has been freed since
                queue = self._fetch(layer, queue, pending)
            handle = cache.loading.pop(e, None)
            if handle is not None:
                handle.wait()
            slot = cache.slot_of[e]
            if xs is not None:
                out[rows[e]] = self.slot_buffers[layer].run(slot, xs[rows[e]])
            cache.touch(e, self._tick)
            pending.discard(e)
        return combine(x, d, out) if x is not None else None

    def step_stats(self) -> dict[str, int]:
        stats = dict(self._stats)
        out = super().step_stats()
        for key in ("expert_cache_hits", "expert_cache_misses", "prefetch_issued", "prefetch_used"):
            out[key] = stats.get(key, 0)
        return out

    # -- copies ----------------------------------------------------------------------------------
    def _fetch(self, layer: int, experts: list[int], keep: set[int]) -> list[int]:
        """Issue copies for `experts` in order while slots can be had; returns the rest."""
        for n, e in enumerate(experts):
            if not self._load(layer, e, keep):
                return experts[n:]
        return []

    def _load(self, layer: int, expert: int, keep: set[int]) -> bool:
        cache = self.caches[layer]
        placed = cache.place(expert, keep)
        if placed is None:
            return False
        slot, _ = placed
        cache.loading[expert], _ = self.copy_in(self.slot_buffers[layer], slot, layer, expert)
        return True

    def _prefetch(self, guess: tuple[int, list[int]] | None) -> None:
        if guess is None:
            return
        nxt, experts = guess
        cache = self.caches[nxt]
        want = experts[: self.slots(nxt)]
        keep = set(want)
        for e in want:
            if e not in cache.slot_of and self._load(nxt, e, keep):
                self._stats["prefetch_issued"] += 1
                cache.prefetched.add(e)


def next_layer_router(routers: dict[int, Tensor], top_k: int) -> Predictor:
    """Predict the next MoE layer's experts by applying its router to this layer's normalized
    hidden states (the residual stream changes little between adjacent layers): experts ranked
    by how many tokens would pick them in their top-k, most first."""
    layers = sorted(routers)
    following = dict(zip(layers, layers[1:]))

    def predict(layer: int, h: Tensor) -> tuple[int, list[int]] | None:
        nxt = following.get(layer)
        if nxt is None:
            return None
        ids = torch.topk(F.linear(h, routers[nxt]), top_k, dim=-1).indices
        counts = torch.bincount(ids.flatten(), minlength=routers[nxt].shape[0]).tolist()
        return nxt, [e for e in sorted(range(len(counts)), key=lambda e: (-counts[e], e)) if counts[e]]

    return predict

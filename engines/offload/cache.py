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

import numpy as np
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
        last = self.last_use
        if self.policy == "lfu":
            uses = self.uses
            ranked = min(((uses[e], last.get(e, -1), e) for e in self.slot_of if e not in keep), default=None)
        else:
            ranked = min(((last.get(e, -1), e) for e in self.slot_of if e not in keep), default=None)
        return None if ranked is None else ranked[-1]

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
        self._loads: Counter[int] | None = None  # a simulated step's copies per layer, counted at its end
        self._held: tuple[list[int], np.ndarray] | None = None  # simulate_step's layers and bytes per expert
        self._device_bytes: int | None = None

    # -- ExpertBackend ---------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """The slots' buffers, weights and biases (allocated once, full or not)."""
        if self._device_bytes is None:
            self._device_bytes = sum(s.nbytes() for s in self.slot_buffers.values())
        return self._device_bytes

    @property
    def copies_overlap(self) -> bool:
        return self.predictor is not None

    def slots(self, layer: int) -> int:
        return len(self.slot_buffers[layer])

    def forward(self, layer: int, x: Tensor, d: Dispatch) -> Tensor:
        """The layer's decisions (`_decide`) with each expert computed in its slot as it comes."""
        self._count(layer, d)
        rows = segments(d)
        xs = x[d.token_index]
        out = torch.empty_like(xs)
        slots = self.slot_buffers[layer]

        def run(e: int, slot: int) -> None:
            out[rows[e]] = slots.run(slot, xs[rows[e]])

        self._decide(layer, list(rows), x, run)
        return combine(x, d, out)

    def simulate(self, layer: int, d: Dispatch, upcoming: tuple[int, list[int]] | None = None) -> None:
        """The same hits, misses, victims and copies as `forward`, no compute (--simulate). With
        prefetch on, the prediction is `upcoming` (the next MoE layer's experts the simulator
        routes, most tokens first): an exact predictor, where the measured one guesses."""
        self._count(layer, d)
        self._decide(layer, list(segments(d)), upcoming)

    def simulate_step(self, layers: list[int], counts: np.ndarray) -> np.ndarray:
        """`simulate` for every layer of a simulated step, in layer order (each layer's hits,
        victims and prefetches depend on the previous ones), in one call: the same decisions, with
        each layer's copies counted in one ledger record at the end (the ledger keeps sums) and the
        prediction, with prefetch on, the next layer's experts by tokens. Returns every expert's
        stored bytes ([len(layers), E]: all of a layer's are resident or copied in to run)."""
        if self._held is None or self._held[0] != layers:
            per_layer = np.array([self.expert_bytes(layer, 0) for layer in layers], dtype=np.int64)
            self._held = list(layers), np.repeat(per_layer[:, None], counts.shape[1], axis=1)
        held = self._held[1]
        self.count_bytes(int(held[counts > 0].sum()))
        rows = counts.tolist()
        last = len(layers) - 1
        self._loads = loads = Counter()
        try:
            for k, layer in enumerate(layers):
                upcoming = None
                if self.predictor is not None and k < last:
                    nxt = rows[k + 1]
                    upcoming = layers[k + 1], sorted((e for e, c in enumerate(nxt) if c), key=lambda e: -nxt[e])
                self._decide(layer, [e for e, c in enumerate(rows[k]) if c], upcoming)
        finally:
            self._loads = None
        nbytes = transfers = 0
        for layer, n in loads.items():
            b, t = self.copy_size_of(layer, self.slot_buffers[layer])
            nbytes, transfers = nbytes + n * b, transfers + n * t
        if transfers:
            self.copies.counted("h2d", nbytes, transfers, tag="experts")
        return held

    def _decide(self, layer: int, needed: list[int], predict: Tensor | tuple[int, list[int]] | None,
                run: Callable[[int, int], None] | None = None) -> None:
        """One layer's hits, misses, copies and prefetches for the experts `needed` (ascending),
        in order: resident experts first, then each missing one as its copy lands (`run(expert,
        slot)` computes it). `predict`: this layer's hidden states for the predictor, or (a
        simulated layer) the next layer's experts themselves."""
        self._tick += 1
        tick, cache, stats = self._tick, self.caches[layer], self._stats
        slot_of, loading = cache.slot_of, cache.loading
        stats["prefetch_used"] += len(cache.prefetched.intersection(needed))
        cache.prefetched.clear()
        hits, missing = [], []
        for e in needed:
            (hits if e in slot_of else missing).append(e)
        stats["expert_cache_hits"] += len(hits)
        stats["expert_cache_misses"] += len(missing)
        pending = set(needed)
        queue = self._fetch(layer, missing, pending)
        if self.predictor is not None:
            self._prefetch(self.predictor(layer, predict) if isinstance(predict, Tensor) else predict)
        for e in hits + missing:
            if e not in slot_of:  # slots ran out at issue: one has been freed since
                queue = self._fetch(layer, queue, pending)
            handle = loading.pop(e, None)
            if handle is not None:
                handle.wait()
            if run is not None:
                run(e, slot_of[e])
            cache.touch(e, tick)
            pending.discard(e)

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
        if self._loads is not None:  # a simulated step (simulate_step): its copies are counted at its end
            self._loads[layer] += 1
            cache.loading[expert] = self.copies.done()
            return True
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

"""PagedWeight's per-step controller: before each step the arbiter sees the KV demand and gives
the expert pages what the budget leaves (and the KV pool what the pages leave); after it, the
bit-width series, the quality feedback (measured errors move the sensitivities; a layer over
the threshold pins its worst experts one width up) and the tables that trace them.

Per request it keeps the precision that served it (`request_bits`): every (token, MoE layer,
routed expert) choice computed for the request, prompt tokens included, counts once at the
width that expert computed at in that step; and whether any of those steps was a transition
step (a bit-width move started in it, or its copies were in flight while it computed).

Widths are reported in bits per weight: on an MXFP4 checkpoint its own width (formats.MXFP4)
counts 4.25 in `mean_bits`, `request_bits` and the `expert_bits` table, and is named
`experts_at_mxfp4_bits` in the step extras.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import torch

from engines.pagedweight.arbiter import Arbiter, Choice, solve_greedy
from engines.pagedweight.backend import FeedbackSample, Move, PagedWeightBackend
from engines.pagedweight.formats import weight_bits, width_name
from engines.pagedweight.importance import Importance, Key
from engines.runtime.batch import StepBatch
from engines.runtime.engine import Controller
from engines.runtime.kv_cache import PagedKVCache
from engines.runtime.scheduler import Scheduler

MISS_COST = 10.0  # sensitivity of an expert not resident (fetched on demand at its lowest width)


@dataclass
class PagedExperts:
    """The experts' host-tier stores behind `backend`, with what the arbiter weighs them by:
    measured sensitivity per width, routing importance, each expert's quality floor (lowest
    width within max_expert_error) and its floor on the device (0: it may leave)."""

    backend: PagedWeightBackend
    bit_widths: tuple[int, ...]
    sensitivity: dict[Key, dict[int, float]]
    importance: Importance
    quality: dict[Key, int]
    floors: dict[Key, int]
    group_size: int = 32  # the group size the quantized versions use (may differ from the asked one)
    notes: list[str] = field(default_factory=list)  # for the run's notes (e.g. a group size that did not fit)
    mxfp4: bool = False  # an MXFP4 checkpoint's stores: width formats.MXFP4 is its own MXFP4

    def weight_bits(self, bits: int) -> float:
        """Bits per weight of a width as reported (MXFP4's 4.25; 0: not resident)."""
        return weight_bits(bits, self.mxfp4)

    def floor_bytes(self) -> int:
        """Every expert at its floor, plus the on-demand staging slots when a floor is 0."""
        b = self.backend
        return b.staging_bytes + sum(s.nbytes(self.floors[k]) if self.floors[k] else 0 for k, s in b.stores.items())


@dataclass(frozen=True)
class PageBudget:
    """What the pages share the device with: `budget_bytes` less the dense weights and a
    `reserved` buffer (moegen's KV staging under engine full), and the KV blocks when
    `kv_on_device` (`kv_reserve_bytes` of them planned for at start; None: a quarter)."""

    budget_bytes: int
    dense_bytes: int
    kv_block_bytes: int
    kv_on_device: bool = True
    reserved_bytes: int = 0
    kv_reserve_bytes: int | None = None

    @property
    def pages(self) -> int:
        return self.budget_bytes - self.dense_bytes - self.reserved_bytes


@dataclass
class RequestBits:
    """The widths one request's computed tokens met: summed and lowest over its routed choices."""

    choices: int = 0
    bits_sum: int = 0  # quarter bits per weight, summed over the choices
    bits_min: int | None = None  # quarter bits per weight
    in_transition: bool = False
    steps: int = 0

    def row(self, request_id: str) -> dict[str, Any]:
        low = self.bits_min
        return {"request_id": request_id, "expert_choices": self.choices,
                "bits_mean": self.bits_sum / 4 / self.choices if self.choices else None,
                "bits_min": None if low is None else low // 4 if low % 4 == 0 else low / 4,
                "in_transition": self.in_transition, "steps": self.steps}


class PagedController(Controller):
    def __init__(self, cfg: Any, paged: PagedExperts, room: PageBudget) -> None:
        self.cfg, self.paged, self.room = cfg, paged, room
        self.backend = paged.backend
        self.engine_step = 0
        self.events: list[dict[str, Any]] = []
        self.matrix: list[dict[str, Any]] = []
        self.served: dict[str, RequestBits] = {}
        self._pin_moves: list[Move] = []  # moves the quality feedback started after this step's compute
        self._floor_bytes: int | None = None  # paged.floor_bytes(), kept until a pin changes the floors
        self._refused: set[tuple[Key, int]] = set()  # pins refused for lack of KV room (recorded once)
        self._shapes: dict[Key, tuple[int, int]] = {}  # key -> (quality, floor) its row was made for
        self._rows: dict[Key, list[Choice]] = {}  # key -> its options() list, kept across steps
        self._stale: set[Key] = set()  # keys whose list _apply_feedback made stale
        self.shape_version = 0  # raised when a key's widths change: the arbiter's `shape` token

    # -- start: the widths the budget allows, copied in, handed to the arbiter ---------------------
    def start(self, kv: PagedKVCache, scheduler: Scheduler) -> None:
        self.kv, self.scheduler = kv, scheduler
        cfg, p, room = self.cfg, self.paged, self.room
        reserve = 0
        if room.kv_on_device:
            reserve = room.kv_reserve_bytes if room.kv_reserve_bytes is not None else room.pages // 4
            reserve = min(max(reserve, room.kv_block_bytes), room.pages - p.floor_bytes())
        initial = solve_greedy(self.options(), room.pages - reserve - self.backend.staging_bytes, p.floors,
                               weights=p.importance.values())
        for key, bits in initial.bits.items():
            if bits:
                self.backend.start_move(key, bits)
        self.backend.commit()
        self.arbiter = Arbiter(hysteresis=cfg.hysteresis, min_residence_steps=cfg.min_residence_steps,
                               transition_bytes_per_step=cfg.transition_bytes_per_step,
                               transfer=lambda key, a, b: self.backend.stores[key].transfer_bytes(a, b),
                               floors=p.floors, initial=dict(initial.bits),
                               replan_every=cfg.replan_every)

    def options(self) -> dict[Key, list[Choice]]:
        """Every expert's choices, each key's in increasing bytes (what the arbiter sorts them by),
        with costs per unit of importance: a choice's cost is its sensitivity (0 at an exact
        width; MISS_COST at 0 bits, when the expert may leave). The arbiter weighs them by
        `importance.values()`, so the lists change only with a key's quality floor, floor or
        sensitivities (all three only in `_apply_feedback`, which marks its list stale) and are kept:
        no per-step rebuild of every expert's choices."""
        stores, rows = self.backend.stores, self._rows
        if not rows:
            for key, store in stores.items():
                rows[key] = self._row(key, store)
        while self._stale:  # replaced in place: the keys keep the stores' order (the arbiter's ties)
            key = self._stale.pop()
            rows[key] = self._row(key, stores[key])
        return rows

    def _row(self, key: Key, store: Any) -> list[Choice]:
        """`key`'s choices per unit of importance, in increasing bytes."""
        p = self.paged
        quality, floor, sens = p.quality[key], p.floors[key], p.sensitivity[key]
        shape = (quality, floor)
        if self._shapes.get(key) != shape:  # a width's bytes are the store's: walked once per shape
            self._shapes[key] = shape
            self.shape_version += 1
        # Never below the quality floor (with floor_bits 0 the floor in p.floors is 0:
        # the expert may leave the device, but not sit on it at a width over the bound).
        widths = sorted((store.nbytes(b), b, b in store.exact_bits) for b in p.bit_widths if b >= quality)
        row = [Choice(0, 0, MISS_COST)] if floor == 0 else []  # it may leave the device
        return row + [Choice(b, n, 0.0 if exact else sens[b]) for n, b, exact in widths]

    def kv_demand_blocks(self) -> int:
        """Blocks the running requests need to finish, plus what the queue would take next:
        waiting requests in admission order (the scheduler admits first come, first served)
        while they fit the pool as it is with every expert at its floor. A request that would
        not fit even then waits either way, so no expert is demoted for it."""
        alloc, sched = self.kv.allocator, self.scheduler
        need = sum(alloc.blocks_for(len(s.request.prompt_ids) + s.request.max_new_tokens) for s in sched.running)
        room = max(0, sched.max_num_seqs - len(sched.running))
        for s in islice(sched.waiting, room):
            more = alloc.blocks_for(len(s.request.prompt_ids) + s.request.max_new_tokens)
            if need + more > alloc.num_blocks:
                break
            need += more
        return need

    # -- around each step ----------------------------------------------------------------------------
    def before_step(self) -> None:
        backend, room, alloc = self.backend, self.room, self.kv.allocator
        backend.take_token_bits()  # rows of forwards outside a step belong to no request
        landed = {m.key for m in backend.commit()}
        self.arbiter.commit([m for m in self.arbiter.inflight if m.key in landed], self.engine_step)
        block = self.kv.block_bytes
        # What the pages, the staging slots and (KV on the device) the KV blocks share.
        pages, on_device = room.pages, room.kv_on_device
        kv_bytes = min(self.kv_demand_blocks(), alloc.num_blocks) * block if on_device else 0
        decision = self.arbiter.plan(self.engine_step, max(0, pages - backend.staging_bytes - kv_bytes), self.options(),
                                     shape=self.shape_version, weights=self.paged.importance.values())
        if decision.cancelled:
            backend.cancel([m.key for m in decision.cancelled])
        moved = promotions = demotions = deferred = 0
        # What the pages may hold while moves are in flight: a promotion's new buffers exist
        # beside the version they replace until the commit, so one that would take the device
        # over the budget now waits (the arbiter plans it again next step). Cached KV blocks do
        # not count: lowering the KV capacity below drops them.
        limit = pages - (alloc.num_used * block if on_device else 0)
        used = backend.device_bytes()  # walked once; a promotion adds its new buffers
        for move in decision.moves:
            promote = move.to_bits > move.from_bits
            if promote and used + backend.move_bytes(move.key, move.to_bits) > limit:
                self.arbiter.abort([move])
                deferred += 1
                continue
            started = backend.start_move(move.key, move.to_bits)
            used = used + started.nbytes if promote else backend.device_bytes()  # a demotion may free parts
            moved += started.nbytes
            promotions += promote
            demotions += move.to_bits < move.from_bits
            if started.handle is None:
                self.arbiter.commit([move], self.engine_step)
        if on_device:
            blocks = max(0, (pages - backend.device_bytes()) // block)
            alloc.set_capacity(min(blocks, alloc.num_blocks))
        every = self.cfg.feedback_every
        backend.step_index = self.engine_step
        backend.feedback_due = every > 0 and self.engine_step % every == every - 1
        self._moves = (decision.fits, moved, promotions, demotions, deferred, len(backend.pending))

    def after_step(self, batch: StepBatch | None) -> Mapping[str, float]:
        self.paged.importance.end_step()
        fits, moved, promotions, demotions, deferred, inflight = self._moves
        extras = {**self._observe(fits, moved, promotions, demotions), "deferred_promotions": deferred,
                  "moves_in_flight": inflight}
        for move in self._pin_moves:  # the feedback's pins are moves of this step too
            extras["promotions"] += move.to_bits > move.from_bits
            extras["demotions"] += move.to_bits < move.from_bits
            extras["move_bytes"] += move.nbytes
        self._pin_moves = []
        transition = bool(extras["promotions"] or extras["demotions"] or inflight)
        self._serve(batch, self.backend.take_token_bits(), transition)
        self.engine_step += 1
        return extras

    def _serve(self, batch: StepBatch | None, token_bits: torch.Tensor | None, transition: bool) -> None:
        """Add the step's per-row widths to each request its chunks computed."""
        if batch is None or token_bits is None:
            return
        n = len(batch.chunks)
        chunk = torch.repeat_interleave(torch.arange(n), torch.tensor([c.length for c in batch.chunks]))
        total = torch.zeros(n, dtype=torch.long).index_add_(0, chunk, token_bits[0])
        lowest = torch.full((n,), torch.iinfo(torch.long).max).scatter_reduce_(0, chunk, token_bits[1], "amin")
        choices = torch.zeros(n, dtype=torch.long).index_add_(0, chunk, token_bits[2])
        for c, s, low, n in zip(batch.chunks, total.tolist(), lowest.tolist(), choices.tolist()):
            rec = self.served.setdefault(c.seq.request.request_id, RequestBits())
            rec.steps += 1
            rec.in_transition = rec.in_transition or transition
            if n:
                rec.choices += n
                rec.bits_sum += s
                rec.bits_min = low if rec.bits_min is None else min(rec.bits_min, low)

    def _observe(self, fits: bool, moved: int, promotions: int, demotions: int) -> dict[str, float]:
        backend, p = self.backend, self.paged
        # From the backend's tally of held widths, not a walk over every expert: widths are
        # multiples of 1/4 bit, so count x width sums exactly what the walk summed.
        held = backend.width_counts()
        mean = sum(n * p.weight_bits(b) for b, n in held.items()) / len(backend.stores)
        extras: dict[str, float] = {"engine_step": self.engine_step, "mean_bits": mean,
                                    "promotions": promotions, "demotions": demotions, "move_bytes": moved,
                                    "floors_fit": int(fits)}
        for b in (*p.bit_widths, 0):
            extras[f"experts_at_{width_name(b, p.mxfp4)}_bits"] = held.get(b, 0)
        feedback = backend.take_feedback() if backend.feedback_due else None
        extras.update(feedback_checks=0, fallbacks=0)
        if feedback is not None and feedback.layer_error:
            extras.update(feedback_checks=1, feedback_error_max=max(feedback.layer_error.values()),
                          feedback_rows=feedback.rows, feedback_s=feedback.seconds, feedback_bytes=feedback.bytes)
            extras["fallbacks"] = self._apply_feedback(feedback)
        if self.engine_step % max(1, self.cfg.matrix_every) == 0:
            self.matrix += [{"engine_step": self.engine_step, "layer": k[0], "expert": k[1],
                             "bits": p.weight_bits(backend.bits(k)), "importance": p.importance[k]}
                            for k in backend.stores]
        return extras

    def _apply_feedback(self, sample: FeedbackSample) -> int:
        """Measured errors move the sensitivity estimates; a layer over the threshold has its
        experts that measured over it (or, if none alone, all it sampled) pinned one width up."""
        cfg, p, backend = self.cfg, self.paged, self.backend
        w = cfg.feedback_weight
        for key, (bits, err) in sample.expert_error.items():
            old = p.sensitivity[key][bits]
            p.sensitivity[key][bits] = (1 - w) * old + w * err
            self._stale.add(key)
        pinned = 0
        for layer, err in sample.layer_error.items():
            if err <= cfg.feedback_threshold:
                continue
            sampled = {k: v for k, v in sample.expert_error.items() if k[0] == layer}
            worst = [k for k, (_, e) in sampled.items() if e > cfg.feedback_threshold] or list(sampled)
            for key in worst:
                bits = sampled[key][0]
                higher = min(b for b in p.bit_widths if b > bits)
                if p.floors[key] < higher:
                    if not self._pin_leaves_room(key, higher):
                        if (key, higher) in self._refused:  # recorded once per expert and width
                            continue
                        self._refused.add((key, higher))
                        self.events.append({"engine_step": self.engine_step, "layer": layer, "expert": key[1],
                                            "layer_error": err, "expert_error": sampled[key][1], "from_bits": bits,
                                            "floor_bits": p.floors[key], "refused_bits": higher})
                        continue
                    p.floors[key] = higher
                    self._floor_bytes = None
                    # Its quality floor rises with it (the widths it may hold, and fetch at).
                    p.quality[key] = max(p.quality[key], higher)
                    self._stale.add(key)
                    backend.fetch_bits[key] = max(backend.fetch_bits.get(key, 0), higher)
                    if self.arbiter.raise_floor(key, higher, self.engine_step):
                        backend.cancel([key])
                        self._pin_moves.append(backend.start_move(key, higher))
                    pinned += 1
                    self.events.append({"engine_step": self.engine_step, "layer": layer, "expert": key[1],
                                        "layer_error": err, "expert_error": sampled[key][1], "from_bits": bits,
                                        "floor_bits": higher, "refused_bits": 0})
        return pinned

    def _floor_room_blocks(self, extra: int = 0) -> int | None:
        """KV blocks the pages leave with every expert at its floor (plus `extra` bytes of floors);
        None when the KV is not on the device."""
        room = self.room
        if not room.kv_on_device:
            return None
        if self._floor_bytes is None:  # every store walked once per change of the floors
            self._floor_bytes = self.paged.floor_bytes()
        return max(0, room.pages - self._floor_bytes - extra) // room.kv_block_bytes

    def max_request_tokens(self) -> int | None:
        blocks = self._floor_room_blocks()
        return None if blocks is None else blocks * self.kv.allocator.block_size

    def _pin_leaves_room(self, key: Key, bits: int) -> bool:
        """Whether raising `key`'s floor to `bits` leaves the KV every request in flight needs
        (alone, at its full length): floors are never demoted, so a pin that took that room would
        leave the request waiting forever. A refused pin is an event with refused_bits (the width
        it would have pinned; 0 on a pin)."""
        p, sched = self.paged, self.scheduler
        store = self.backend.stores[key]
        old = p.floors[key]
        extra = store.nbytes(bits) - (store.nbytes(old) if old else 0)
        blocks = self._floor_room_blocks(extra)
        if blocks is None:
            return True
        alloc = self.kv.allocator
        need = max((alloc.blocks_for(len(s.request.prompt_ids) + s.request.max_new_tokens)
                    for s in [*sched.running, *sched.waiting]), default=0)
        return blocks >= need

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        imp = self.paged.importance
        usage = [{"layer": k[0], "expert": k[1], "tokens": n, "routing_mass": imp.total_mass[k]}
                 for k, n in sorted(imp.total_tokens.items())]
        return {"expert_bits": list(self.matrix), "expert_usage": usage, "fallbacks": list(self.events),
                "request_bits": [rec.row(rid) for rid, rec in self.served.items()]}

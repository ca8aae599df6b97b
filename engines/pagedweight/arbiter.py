"""The bit-width arbiter: which precision each routed expert holds, step after step, given the
bytes left after KV. Each step's knapsack is mckp.py's (its objective, greedy and floors).

`Arbiter` keeps the assignment across steps (never reset per epoch) and adds these rules:
- hysteresis: an optional re-plan (a fresh greedy over the keys free to move) is adopted only
  if cost(base) - cost(new) > hysteresis * cost(base) + min_gain, where base is the goal
  adopted earlier (while it still fits and beats the current assignment) or else the current
  assignment; a goal once adopted is pursued over later steps without re-passing the test, so
  deferred moves complete;
- re-plan period: the optional re-plan runs once `replan_every` steps have passed since the
  latest one (1: every step) or when the capacity differs from the latest one's; on other
  steps the goal is the base. Forced demotions and the walk toward the goal run every step;
- residence: a key changed (committed) at step s is not changed by optional moves before
  s + min_residence_steps;
- transition budget: optional moves (promotions, and the demotions that make room for them)
  may copy at most `transition_bytes_per_step` per step; the rest are deferred.
Forced demotions (current bytes > capacity) come first and ignore these rules (their bytes
still count against the step's budget), but pick by the same greedy: first among free keys,
then by cancelling in-flight promotions, then among all keys not in flight.
Moves are in flight until `commit` (or `abort`): a promotion becomes current only then.
Pure Python and deterministic: no randomness, no clock; ties follow the options' key order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from engines.pagedweight.mckp import (  # noqa: F401  (Allocation, POLISH_KEYS, solve_exact: re-exported)
    POLISH_KEYS,
    Allocation,
    Choice,
    Key,
    Options,
    Weights,
    _allowed,
    _cost,
    _demote,
    _greedy_pick,
    solve_exact,
    solve_greedy,
)


@dataclass(frozen=True)
class Move:
    key: Key
    from_bits: int
    to_bits: int
    bytes_moved: int  # bytes copied or written (transfer budget), not the change in residency
    forced: bool = False  # needed to fit the capacity: not subject to budget or residence


@dataclass(frozen=True)
class Decision:
    """`target` and `cost` are formed when first read (the controller reads neither), from the
    plan's choices and the `weights` it was given: a caller that reads them must not change
    those weights in place before."""

    step: int
    moves: tuple[Move, ...]  # issue in this order: forced first, room made before each promotion
    cancelled: tuple[Move, ...]  # in-flight promotions dropped to fit: abort their copies
    nbytes: int  # resident bytes once this step's moves (and those still in flight) complete
    fits: bool  # False: even the floors exceed the capacity; queue or preempt requests
    goal: Mapping[Key, Choice] = field(repr=False)  # each key's option where the adopted plan leads
    pick: Mapping[Key, Choice] = field(repr=False)  # each key's option once this step's moves land
    weights: Weights = field(repr=False)

    @cached_property
    def target(self) -> dict[Key, int]:
        """The goal's bits per key: where the adopted plan leads once deferred moves run."""
        return {k: o.bits for k, o in self.goal.items()}

    @cached_property
    def cost(self) -> float:
        return _cost(self.pick, self.weights)


TransferFn = Callable[[Key, int, int], int]  # (key, from_bits, to_bits) -> bytes moved


class Arbiter:
    """Stateful per-step planner over `solve_greedy`; see the module docstring for the rules.

    transfer: "bitplane" (promotion copies the missing planes, demotion drops planes: 0),
    "requantize" (any change writes the whole new version), or a `TransferFn`.
    initial: the bits each key holds at load; keys not named start at their floor option.
    """

    def __init__(self, *, hysteresis: float = 0.02, min_gain: float = 0.0, min_residence_steps: int = 0,
                 transition_bytes_per_step: int | None = None, transfer: str | TransferFn = "bitplane",
                 floors: Mapping[Key, int] | None = None, initial: Mapping[Key, int] | None = None,
                 replan_every: int = 1) -> None:
        if hysteresis < 0 or min_gain < 0:
            raise ValueError(f"hysteresis and min_gain must be >= 0, got {hysteresis}, {min_gain}")
        if min_residence_steps < 0:
            raise ValueError(f"min_residence_steps must be >= 0, got {min_residence_steps}")
        if transition_bytes_per_step is not None and transition_bytes_per_step < 0:
            raise ValueError(f"transition_bytes_per_step must be >= 0 or None, got {transition_bytes_per_step}")
        if isinstance(replan_every, bool) or not isinstance(replan_every, int) or replan_every < 1:
            raise ValueError(f"replan_every must be an integer >= 1, got {replan_every!r}")
        if not callable(transfer) and transfer not in ("bitplane", "requantize"):
            raise ValueError(f"transfer must be 'bitplane', 'requantize' or a callable, got {transfer!r}")
        self.hysteresis, self.min_gain = hysteresis, min_gain
        self.min_residence_steps = min_residence_steps
        self.transition_bytes_per_step = transition_bytes_per_step
        self.transfer = transfer
        self.replan_every = replan_every
        self._replanned: tuple[int, int] | None = None  # (step, capacity) of the latest optional re-plan
        self.floors = dict(floors or {})
        self.bits: dict[Key, int] = dict(initial or {})  # committed: what the device holds
        self.changed_at: dict[Key, int] = {}  # step of each key's last committed change
        self._inflight: dict[Key, Move] = {}
        self._goal: dict[Key, Choice] = {}  # each key's option in the latest plan's goal (its `target`)
        self._step: int | None = None
        self._floors_version = 0  # raised by raise_floor: the cached widths (see _widths) are stale
        self._shape_cache: tuple | None = None  # ((shape, floors version), keep, pos) from _widths

    @property
    def inflight(self) -> tuple[Move, ...]:
        return tuple(self._inflight.values())

    @property
    def target(self) -> dict[Key, int]:
        """The latest plan's goal, in bits per key (a key whose floor was raised since: dropped)."""
        return {k: o.bits for k, o in self._goal.items()}

    def _bytes_moved(self, key: Key, src: Choice, dst: Choice) -> int:
        if callable(self.transfer):
            return int(self.transfer(key, src.bits, dst.bits))
        if self.transfer == "bitplane":
            return max(dst.nbytes - src.nbytes, 0)
        return dst.nbytes

    def _resident(self, key: Key, step: int) -> bool:
        """Still inside its residence window: optional moves must leave it alone."""
        return key in self.changed_at and step < self.changed_at[key] + self.min_residence_steps

    def _widths(self, options: Options, shape: Hashable | None,
                weights: Weights | None) -> tuple[dict[Key, list[Choice]], dict[Key, dict[int, int]]]:
        """`_allowed(options, self.floors)` and each key's bits -> index in its allowed list.

        With a `shape` token the checks and the floor filter are done once per change of the
        token (or of the floors) and reused: options in the controller's order (strictly
        increasing bytes) keep that order, so only the costs differ from step to step."""
        token = (shape, self._floors_version)
        cache = self._shape_cache
        if shape is not None and cache is not None and cache[0] == token and len(cache[2]) == len(options):
            keep = cache[1]
            if keep is None and isinstance(options, dict):  # no floor removes an option: as given
                return options, cache[2]
            keep = keep or {}
            allowed = {k: opts if keep.get(k) is None else [opts[i] for i in keep[k]] for k, opts in options.items()}
            return allowed, cache[2]
        allowed = _allowed(options, self.floors, weights)
        if missing := [k for k in self.bits if k not in allowed]:
            raise ValueError(f"options lack tracked keys {missing[:5]}")
        for k, opts in allowed.items():
            self.bits.setdefault(k, opts[0].bits)
        pos = {k: {o.bits: i for i, o in enumerate(opts)} for k, opts in allowed.items()}
        self._shape_cache = None
        if shape is not None and all(all(a.nbytes < b.nbytes for a, b in zip(opts, opts[1:]))
                                     for opts in options.values()):
            keep = {}
            for k, opts in options.items():
                kept = tuple(i for i, o in enumerate(opts) if o.bits >= self.floors.get(k, 0))
                if len(kept) < len(opts):
                    keep[k] = kept
            self._shape_cache = (token, keep or None, pos)
        return allowed, pos

    def plan(self, step: int, capacity: int, options: Options, shape: Hashable | None = None,
             weights: Weights | None = None) -> Decision:
        """This step's decision for the bytes `capacity` over `options`.

        shape: a token the caller changes whenever any key's (bits, nbytes) options change
        (None: check them every step). weights: a key's option costs are weights[key] x
        choice.cost (None: the choices' costs as they are), so a caller whose costs are
        importance x sensitivity can keep one list per key and pass the importances."""
        if self._step is not None and step < self._step:
            raise ValueError(f"step went backwards: {step} after {self._step}")
        self._step = step
        allowed, pos = self._widths(options, shape, weights)
        w = dict.fromkeys(allowed, 1.0) if weights is None else weights
        inflight, bits = self._inflight, self.bits
        eff = {}  # the assignment once in-flight moves land: what bytes are promised to
        total = 0
        for k, opts in allowed.items():
            m = inflight.get(k)
            b = bits[k] if m is None else m.to_bits
            i = pos[k].get(b)
            if i is None:
                raise ValueError(f"key {k!r} holds {b} bits, not an allowed option {sorted(pos[k])}")
            o = eff[k] = opts[i]
            total += o.nbytes
        keys = list(allowed)
        moves: list[Move] = []
        cancelled: list[Move] = []
        budget = math.inf if self.transition_bytes_per_step is None else self.transition_bytes_per_step

        if total > capacity:
            total = self._force(step, capacity, allowed, pos, w, eff, cancelled)
            for k in keys:
                if k not in self._inflight and eff[k].bits != self.bits[k]:
                    src = allowed[k][pos[k][self.bits[k]]]
                    m = Move(k, self.bits[k], eff[k].bits, self._bytes_moved(k, src, eff[k]), True)
                    moves.append(m)
                    self._inflight[k] = m
                    budget -= m.bytes_moved
        full_budget = budget

        # Free keys: neither in flight nor inside their residence window (the few that are, in a set).
        wait = self.min_residence_steps
        held = {k for k, at in self.changed_at.items() if step < at + wait}
        held.update(inflight)
        free = [k for k in keys if k not in held] if held else keys
        room_free = capacity - sum(eff[k].nbytes for k in held if k in eff)
        goal = self._adopt(step, capacity, free, allowed, pos, w, eff, room_free)
        self._goal = eff | goal  # before the walk below moves eff toward the goal

        # Walk toward the goal: promotions by saving per byte, each preceded by the cheapest
        # goal demotions that make its room; stop spending at the transfer budget.
        moving = [k for k, o in goal.items() if o.bits != eff[k].bits]
        order = {k: i for i, k in enumerate(keys)} if moving else {}
        ups, downs = [], []
        for k in moving:
            o = goal[k]
            add, saved = o.nbytes - eff[k].nbytes, w[k] * eff[k].cost - w[k] * o.cost
            if add < 0:  # by added cost per byte freed, as in the greedy
                downs.append((saved / add, -saved, order[k], k))
            else:  # by cost saved per byte added, best first
                ups.append((-saved / add if add else -math.inf, order[k], k))
        ups.sort()
        downs.sort()
        d = 0
        for _, _, k in ups:
            add = goal[k].nbytes - eff[k].nbytes
            fund = []
            room = capacity - total
            j = d
            while room < add and j < len(downs):
                fund.append(downs[j][3])
                room += eff[downs[j][3]].nbytes - goal[downs[j][3]].nbytes
                j += 1
            if room < add:
                break  # cannot happen for a goal that fits; kept as a guard
            batch = [Move(f, eff[f].bits, goal[f].bits, self._bytes_moved(f, eff[f], goal[f])) for f in fund]
            batch.append(Move(k, eff[k].bits, goal[k].bits, self._bytes_moved(k, eff[k], goal[k])))
            spend = sum(m.bytes_moved for m in batch)
            # A batch larger than the whole budget goes alone on a step that spent nothing,
            # so a big page is not deferred forever.
            alone = spend > full_budget and budget == full_budget and full_budget > 0
            if spend > budget and not alone:
                continue
            for m in batch:
                moves.append(m)
                self._inflight[m.key] = m
                total += goal[m.key].nbytes - eff[m.key].nbytes
                eff[m.key] = goal[m.key]
            budget -= spend
            d = j
            if alone:
                break

        return Decision(step, tuple(moves), tuple(cancelled), total, total <= capacity, self._goal, eff, w)

    def _force(self, step: int, capacity: int, allowed: dict[Key, list[Choice]], pos: dict[Key, dict[int, int]],
               w: Weights, eff: dict[Key, Choice], cancelled: list[Move]) -> int:
        """Demote `eff` in place until it fits: free keys, then in-flight promotions, then all."""
        total = sum(o.nbytes for o in eff.values())
        free = [k for k in allowed if k not in self._inflight and not self._resident(k, step)]
        total = self._demote_among(free, capacity, allowed, w, eff, total)
        if total > capacity:
            order = {k: i for i, k in enumerate(allowed)}
            ranked = []
            for k, m in self._inflight.items():
                src, dst = allowed[k][pos[k][m.from_bits]], eff[k]
                if dst.nbytes > src.nbytes:
                    freed, added = dst.nbytes - src.nbytes, w[k] * src.cost - w[k] * dst.cost
                    ranked.append((added / freed, added, order[k], k))
            for *_, k in sorted(ranked):
                if total <= capacity:
                    break
                m = self._inflight.pop(k)
                cancelled.append(m)
                src = allowed[k][pos[k][m.from_bits]]
                total -= eff[k].nbytes - src.nbytes
                eff[k] = src
        if total > capacity:
            total = self._demote_among([k for k in allowed if k not in self._inflight], capacity, allowed, w, eff,
                                       total)
        return total

    @staticmethod
    def _demote_among(keys: list[Key], capacity: int, allowed: dict[Key, list[Choice]], w: Weights,
                      eff: dict[Key, Choice], total: int) -> int:
        pick = {k: eff[k] for k in keys}
        fixed = total - sum(o.nbytes for o in pick.values())
        sub = _demote({k: allowed[k] for k in keys}, pick, capacity - fixed, w)
        eff.update(pick)
        return fixed + sub

    def _adopt(self, step: int, capacity: int, free: list[Key], allowed: dict[Key, list[Choice]],
               pos: dict[Key, dict[int, int]], w: Weights, eff: dict[Key, Choice], room: int) -> dict[Key, Choice]:
        """The goal for the free keys: the earlier goal or the current bits, unless the fresh
        greedy (on a re-plan step) beats that base by the hysteresis margin."""
        every = len(free) == len(eff)  # every key free (free is then the keys in eff's order)
        keep = dict(eff) if every else {k: eff[k] for k in free}
        replan = self._replanned is None or step >= self._replanned[0] + self.replan_every or \
            capacity != self._replanned[1]
        if replan:
            self._replanned = (step, capacity)
            cand, picked = _greedy_pick(allowed if every else {k: allowed[k] for k in free}, room, w)
        base, base_cost = keep, None
        # The earlier goal, where it leads anywhere else than the current bits (else it is `keep`,
        # as costly, and `keep` stays the base).
        goal = self._goal
        if any((g := goal.get(k)) is not None and g.bits != o.bits for k, o in keep.items()):
            old = {}
            for k, o in keep.items():
                g = goal.get(k)
                i = pos[k].get(o.bits if g is None else g.bits)
                if i is None:  # an earlier goal no longer allowed (a floor rose): the current bits
                    old = None
                    break
                old[k] = allowed[k][i]
            if old is not None and sum(o.nbytes for o in old.values()) <= room:
                old_cost, base_cost = _cost(old, w), _cost(keep, w)
                if old_cost < base_cost:
                    base, base_cost = old, old_cost
        if not replan:
            return base
        if base_cost is None:
            base_cost = _cost(base, w)
        if cand.fits and base_cost - cand.cost > self.hysteresis * base_cost + self.min_gain:
            return picked
        return base

    def commit(self, moves: Iterable[Move], step: int | None = None) -> None:
        """Moves that completed: their bits become current, changed at `step` (default: the
        step of the latest plan)."""
        at = self._step if step is None else step
        for m in moves:
            if self._inflight.get(m.key) != m:
                raise ValueError(f"move {m} is not in flight")
            del self._inflight[m.key]
            self.bits[m.key] = m.to_bits
            self.changed_at[m.key] = at

    def raise_floor(self, key: Key, bits: int, step: int) -> bool:
        """Pin `key` to at least `bits` from now on (the quality feedback's fallback). If it
        holds (or is moving to) less, the caller moves it up at once, outside any plan: its
        in-flight move, if any, is dropped, and `bits` becomes its committed width, changed at
        `step`. Returns whether the caller must make that move."""
        self.floors[key] = max(self.floors.get(key, 0), bits)
        self._floors_version += 1
        held = self._inflight[key].to_bits if key in self._inflight else self.bits.get(key, 0)
        if held >= bits:
            return False
        self._inflight.pop(key, None)
        self._goal = {k: o for k, o in self._goal.items() if k != key}  # a new dict: a Decision holds the old
        self.bits[key] = bits
        self.changed_at[key] = step
        return True

    def abort(self, moves: Iterable[Move]) -> None:
        """Moves that will not complete (a copy dropped): the key keeps its committed bits."""
        for m in moves:
            if self._inflight.get(m.key) != m:
                raise ValueError(f"move {m} is not in flight")
            del self._inflight[m.key]

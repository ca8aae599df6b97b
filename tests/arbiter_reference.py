"""The arbiter as it was before its per-step caches (engines/pagedweight/arbiter.py at 2fc6b0e),
kept verbatim below this note as the slow reference the fast one must match decision for decision
(tests/unit/test_arbiter_incremental.py). Not used by the engine.

REFERENCE: The bit-width arbiter: which precision each routed expert holds, given the bytes left after KV.

Objective. Every key (layer, expert) takes exactly one `Choice(bits, nbytes, cost)`; cost is
importance x sensitivity(bits) (0 at 16 bits, a miss cost at bits 0 = not resident). Minimise
the summed cost with the summed bytes <= capacity: a multiple-choice knapsack (MCKP).

Greedy (`solve_greedy`). Start each key at its cheapest allowed option, then demote by the
least added cost per byte freed (ties: added cost, key order, higher bits). From a key's
current option the step is to the fewer-bytes option of least slope: the next vertex of the
lower convex hull of its (bytes, cost) points. Why the hull: costs need not be convex in
bytes (4 bits may cost hardly more than 8, 3 bits far more), so 16->8 can look expensive per
byte while 16->4 is cheap, and a greedy that looks one level down demotes the wrong key.
A step that would close the deficit may free far more than needed, so it is only recorded as
a finish; smaller steps go on while they cost less than the best finish, which is taken at the
end. A promotion pass then fills the slack by the most cost saved per byte added (so a start
from a current assignment also serves a capacity that grew). With many keys the rounding
loss is about one step's cost, a small share of the total; with few keys (<= POLISH_KEYS)
it can be a large share, so those get a local search: set one key to another option, re-fit
the rest, keep any strict improvement. `solve_exact` is the DP oracle for tests.

Floors. `floors[key]` removes options below those bits. If even the floors do not fit, both
solvers return the floors (least bytes allowed per key) with `fits=False`; the arbiter does
not drop floors: the engine must queue or preempt requests until the KV demand falls.

`Arbiter` keeps the assignment across steps (never reset per epoch) and adds three rules:
- hysteresis: an optional re-plan is adopted only if cost(base) - cost(new) >
  hysteresis * cost(base) + min_gain, where base is the goal adopted earlier (while it still
  fits and beats the current assignment) or else the current assignment; a goal once adopted
  is pursued over later steps without re-passing the test, so deferred moves complete;
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

import heapq
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

Key = Hashable  # (layer, expert) in the engine; any hashable here


class Choice(NamedTuple):  # a tuple: the controller makes ~5 per expert per step (a dataclass is 5x slower to build)
    bits: int  # 16, 8, 4, 3, 2, or 0 = not resident
    nbytes: int
    cost: float  # importance x sensitivity(bits), or the miss cost at bits 0


Options = Mapping[Key, Sequence[Choice]]

# Instances up to this many keys get the local search after the greedy (see the docstring).
POLISH_KEYS = 12  # ~10 ms at 10 keys in CPython; ~200 ms at 32, too slow per step


@dataclass(frozen=True)
class Allocation:
    bits: dict[Key, int]
    nbytes: int
    cost: float
    fits: bool  # False: even the floors exceed the capacity (bits is then the floors)


def _allowed(options: Options, floors: Mapping[Key, int] | None) -> dict[Key, list[Choice]]:
    """Each key's options at or above its floor, sorted by (bytes, cost): [0] is its floor pick."""
    out = {}
    for key, opts in options.items():
        if len({o.bits for o in opts}) != len(opts):
            raise ValueError(f"options[{key!r}] repeats a bit width: {[o.bits for o in opts]}")
        # Options in strictly increasing bytes (the controller's order) are already sorted.
        prev, ordered = -1, True
        for o in opts:
            if o.nbytes <= prev:
                ordered = False
                break
            prev = o.nbytes
        if not ordered and any(o.nbytes < 0 for o in opts):  # ordered: every nbytes > -1
            raise ValueError(f"options[{key!r}] has negative nbytes")
        floor = floors.get(key, 0) if floors else 0
        ok = [o for o in opts if o.bits >= floor]
        if not ordered:
            ok.sort(key=_rank)
        if not ok:
            raise ValueError(f"floors[{key!r}]={floor} leaves no option; bits are {sorted(o.bits for o in opts)}")
        out[key] = ok
    return out


def _rank(o: Choice) -> tuple[int, float, int]:
    return o.nbytes, o.cost, -o.bits


def _top(opts: list[Choice]) -> Choice:
    return min(opts, key=lambda o: (o.cost, o.nbytes, -o.bits))


def _down(opts: list[Choice], cur: Choice, below: float = math.inf) -> tuple[tuple[float, float, int], Choice] | None:
    """Least-slope demotion from `cur` freeing under `below` bytes: the next lower-hull vertex
    (the nearest one on a tie)."""
    best = None
    for o in opts:
        freed = cur.nbytes - o.nbytes
        if 0 < freed < below:
            added = o.cost - cur.cost
            rank = (added / freed, added, -o.bits)
            if best is None or rank < best[0]:
                best = (rank, o)
    return best


def _up(opts: list[Choice], cur: Choice, slack: int) -> tuple[tuple[float, float, int], Choice] | None:
    """Promotion from `cur` within `slack` bytes saving the most cost per byte added."""
    best = None
    for o in opts:
        added = o.nbytes - cur.nbytes
        saved = cur.cost - o.cost
        if 0 < added <= slack and saved > 0:
            rank = (-saved / added, -saved, -o.bits)
            if best is None or rank < best[0]:
                best = (rank, o)
    return best


def _closing(opts: list[Choice], cur: Choice, deficit: int) -> tuple[float, int, Choice] | None:
    """The option of least added cost freeing at least `deficit` bytes from `cur`."""
    return min(((o.cost - cur.cost, -o.bits, o) for o in opts if cur.nbytes - o.nbytes >= deficit),
               key=lambda c: c[:2], default=None)


def _demote(allowed: dict[Key, list[Choice]], pick: dict[Key, Choice], capacity: int) -> int:
    """Demote `pick` in place until its bytes fit (or every key is at its floor); the total.

    Steps go in order of added cost per byte freed. A step that would close the deficit is
    only recorded as a way to finish (with its key's cheapest closing option), since it may
    free far more than needed; the walk goes on with smaller steps while they cost less than
    the best finish so far, and ends on the cheapest finish found (a min-cost cover greedy)."""
    keys = list(allowed)
    total = sum(pick[k].nbytes for k in keys)
    if total <= capacity:
        return total
    heap = []
    for i, k in enumerate(keys):
        if (d := _down(allowed[k], pick[k])) is not None:
            heap.append((*d[0][:2], i, d[0][2], d[1]))
    heapq.heapify(heap)
    log: list[tuple[Key, Choice]] = []  # applied steps, with the option each replaced
    spent = 0.0
    best: tuple[float, int, Key, Choice] | None = None  # (total added, steps kept, key, option)
    # One entry per key, replaced only when that key is popped: no stale entries to skip.
    while heap and (best is None or spent < best[0]):
        _, added, i, _, o = heapq.heappop(heap)
        k, deficit = keys[i], total - capacity
        if pick[k].nbytes - o.nbytes < deficit:
            log.append((k, pick[k]))
            total -= pick[k].nbytes - o.nbytes
            spent += added
            pick[k] = o
            d = _down(allowed[k], o)
        else:
            finishes = [(k, _closing(allowed[k], pick[k], deficit))]
            if best is None:
                # The first time the deficit can be closed, also try every key's single
                # move (the knapsack's "best single item" guard).
                finishes += [(j, _closing(allowed[j], pick[j], deficit)) for j in keys]
            for j, c in finishes:
                if c is not None and (best is None or spent + c[0] < best[0]):
                    best = (spent + c[0], len(log), j, c[2])
            d = _down(allowed[k], pick[k], below=deficit)
        if d is not None:
            heapq.heappush(heap, (*d[0][:2], i, d[0][2], d[1]))
    if best is None:
        return total  # every key at its least bytes and still over: the floors do not fit
    for k, prev in reversed(log[best[1]:]):
        total += prev.nbytes - pick[k].nbytes
        pick[k] = prev
    _, _, k, o = best
    total -= pick[k].nbytes - o.nbytes
    pick[k] = o
    return total


def _promote(allowed: dict[Key, list[Choice]], pick: dict[Key, Choice], capacity: int) -> int:
    """Fill the slack in place by the best cost saved per byte added; the total."""
    keys = list(allowed)
    total = sum(pick[k].nbytes for k in keys)
    slack = capacity - total
    heap = []
    for i, k in enumerate(keys):
        if (u := _up(allowed[k], pick[k], slack)) is not None:
            heap.append((*u[0][:2], i, u[0][2], u[1]))
    heapq.heapify(heap)
    # Lazy: slack only shrinks, so an entry's rank bounds what its key can do now; the top
    # entry is the true best if it still fits, else its key is re-ranked under the new slack.
    while heap:
        _, _, i, _, o = heapq.heappop(heap)
        k = keys[i]
        if o.nbytes - pick[k].nbytes <= slack:
            slack -= o.nbytes - pick[k].nbytes
            pick[k] = o
        if (u := _up(allowed[k], pick[k], slack)) is not None:
            heapq.heappush(heap, (*u[0][:2], i, u[0][2], u[1]))
    return capacity - slack


def _plan(pick: Mapping[Key, Choice], capacity: int) -> Allocation:
    nbytes = sum(o.nbytes for o in pick.values())
    return Allocation({k: o.bits for k, o in pick.items()}, nbytes, sum(o.cost for o in pick.values()),
                      nbytes <= capacity)


def _fit(allowed: dict[Key, list[Choice]], pick: dict[Key, Choice], capacity: int, fixed: Key) -> bool:
    """Demote then fill every key but `fixed` in place around it; False if it cannot fit."""
    rest = {k: opts for k, opts in allowed.items() if k != fixed}
    room = capacity - pick[fixed].nbytes
    if sum(opts[0].nbytes for opts in rest.values()) > room:
        return False
    sub = {k: pick[k] for k in rest}
    _demote(rest, sub, room)
    _promote(rest, sub, room)
    pick.update(sub)
    return True


def _polish(allowed: dict[Key, list[Choice]], pick: dict[Key, Choice], capacity: int) -> dict[Key, Choice]:
    """Local search: set one key to another option and re-fit the others, both from the
    current picks and from the cheapest ones; take any strict improvement, until none."""
    top = {k: _top(opts) for k, opts in allowed.items()}
    cost = sum(o.cost for o in pick.values())
    improved = True
    while improved:
        improved = False
        for k, opts in allowed.items():
            for o in opts:
                for src in (pick, top):
                    if o is pick[k]:
                        break
                    trial = dict(src)
                    trial[k] = o
                    if not _fit(allowed, trial, capacity, k):
                        break  # the floors of the rest do not fit beside o: neither source can
                    c = sum(x.cost for x in trial.values())
                    # Strictly better by more than float noise, so the search cannot cycle.
                    if c < cost - 1e-12 * max(1.0, abs(cost)):
                        pick, cost, improved = trial, c, True
    return pick


def _greedy(allowed: dict[Key, list[Choice]], capacity: int, start: dict[Key, Choice] | None = None,
            polish_keys: int = POLISH_KEYS) -> Allocation:
    if sum(opts[0].nbytes for opts in allowed.values()) > capacity:
        return _plan({k: opts[0] for k, opts in allowed.items()}, capacity)
    pick = dict(start) if start is not None else {k: _top(opts) for k, opts in allowed.items()}
    _demote(allowed, pick, capacity)
    _promote(allowed, pick, capacity)
    if len(allowed) <= polish_keys:
        pick = _polish(allowed, pick, capacity)
    return _plan(pick, capacity)


def solve_greedy(options: Options, capacity: int, floors: Mapping[Key, int] | None = None,
                 start: Mapping[Key, int] | None = None, polish_keys: int = POLISH_KEYS) -> Allocation:
    """Hull greedy for the MCKP, then the local search if there are <= `polish_keys` keys (0: never).

    From `start` (key -> bits) instead of each key's cheapest option if given."""
    allowed = _allowed(options, floors)
    first = None
    if start is not None:
        by_bits = {k: {o.bits: o for o in opts} for k, opts in allowed.items()}
        missing = [k for k in allowed if start.get(k) not in by_bits[k]]
        if missing:
            raise ValueError(f"start bits not among the allowed options for keys {missing[:5]}")
        first = {k: by_bits[k][start[k]] for k in allowed}
    return _greedy(allowed, capacity, first, polish_keys)


def solve_exact(options: Options, capacity: int, floors: Mapping[Key, int] | None = None) -> Allocation:
    """Exact MCKP by DP over keys: reachable byte totals -> least cost, dominated totals pruned.

    Exponential in the worst case (about 5^keys totals); meant for <= 12 keys, as a test oracle."""
    allowed = _allowed(options, floors)
    if sum(opts[0].nbytes for opts in allowed.values()) > capacity:
        return _plan({k: opts[0] for k, opts in allowed.items()}, capacity)
    states: dict[int, tuple[float, tuple[Choice, ...]]] = {0: (0.0, ())}
    for opts in allowed.values():
        grown: dict[int, tuple[float, tuple[Choice, ...]]] = {}
        for b, (c, picks) in states.items():
            for o in opts:
                nb, nc = b + o.nbytes, c + o.cost
                if nb <= capacity and (nb not in grown or nc < grown[nb][0]):
                    grown[nb] = (nc, (*picks, o))
        # A total is worth keeping only if it is cheaper than every smaller total.
        states, best = {}, math.inf
        for nb in sorted(grown):
            if grown[nb][0] < best:
                states[nb], best = grown[nb], grown[nb][0]
    _, picks = min(states.values(), key=lambda s: s[0])
    return _plan(dict(zip(allowed, picks)), capacity)


@dataclass(frozen=True)
class Move:
    key: Key
    from_bits: int
    to_bits: int
    bytes_moved: int  # bytes copied or written (transfer budget), not the change in residency
    forced: bool = False  # needed to fit the capacity: not subject to budget or residence


@dataclass(frozen=True)
class Decision:
    step: int
    target: dict[Key, int]  # the goal: where the adopted plan leads once deferred moves run
    moves: tuple[Move, ...]  # issue in this order: forced first, room made before each promotion
    cancelled: tuple[Move, ...]  # in-flight promotions dropped to fit: abort their copies
    nbytes: int  # resident bytes once this step's moves (and those still in flight) complete
    cost: float
    fits: bool  # False: even the floors exceed the capacity; queue or preempt requests


TransferFn = Callable[[Key, int, int], int]  # (key, from_bits, to_bits) -> bytes moved


class Arbiter:
    """Stateful per-step planner over `solve_greedy`; see the module docstring for the rules.

    transfer: "bitplane" (promotion copies the missing planes, demotion drops planes: 0),
    "requantize" (any change writes the whole new version), or a `TransferFn`.
    initial: the bits each key holds at load; keys not named start at their floor option.
    """

    def __init__(self, *, hysteresis: float = 0.02, min_gain: float = 0.0, min_residence_steps: int = 0,
                 transition_bytes_per_step: int | None = None, transfer: str | TransferFn = "bitplane",
                 floors: Mapping[Key, int] | None = None, initial: Mapping[Key, int] | None = None) -> None:
        if hysteresis < 0 or min_gain < 0:
            raise ValueError(f"hysteresis and min_gain must be >= 0, got {hysteresis}, {min_gain}")
        if min_residence_steps < 0:
            raise ValueError(f"min_residence_steps must be >= 0, got {min_residence_steps}")
        if transition_bytes_per_step is not None and transition_bytes_per_step < 0:
            raise ValueError(f"transition_bytes_per_step must be >= 0 or None, got {transition_bytes_per_step}")
        if not callable(transfer) and transfer not in ("bitplane", "requantize"):
            raise ValueError(f"transfer must be 'bitplane', 'requantize' or a callable, got {transfer!r}")
        self.hysteresis, self.min_gain = hysteresis, min_gain
        self.min_residence_steps = min_residence_steps
        self.transition_bytes_per_step = transition_bytes_per_step
        self.transfer = transfer
        self.floors = dict(floors or {})
        self.bits: dict[Key, int] = dict(initial or {})  # committed: what the device holds
        self.changed_at: dict[Key, int] = {}  # step of each key's last committed change
        self._inflight: dict[Key, Move] = {}
        self._target: dict[Key, int] = {}
        self._step: int | None = None

    @property
    def inflight(self) -> tuple[Move, ...]:
        return tuple(self._inflight.values())

    def _bytes_moved(self, key: Key, src: Choice, dst: Choice) -> int:
        if callable(self.transfer):
            return int(self.transfer(key, src.bits, dst.bits))
        if self.transfer == "bitplane":
            return max(dst.nbytes - src.nbytes, 0)
        return dst.nbytes

    def _resident(self, key: Key, step: int) -> bool:
        """Still inside its residence window: optional moves must leave it alone."""
        return key in self.changed_at and step < self.changed_at[key] + self.min_residence_steps

    def plan(self, step: int, capacity: int, options: Options) -> Decision:
        if self._step is not None and step < self._step:
            raise ValueError(f"step went backwards: {step} after {self._step}")
        self._step = step
        allowed = _allowed(options, self.floors)
        if missing := [k for k in self.bits if k not in allowed]:
            raise ValueError(f"options lack tracked keys {missing[:5]}")
        by_bits = {k: {o.bits: o for o in opts} for k, opts in allowed.items()}
        for k, opts in allowed.items():
            self.bits.setdefault(k, opts[0].bits)
        eff = {}  # the assignment once in-flight moves land: what bytes are promised to
        for k in allowed:
            b = self._inflight[k].to_bits if k in self._inflight else self.bits[k]
            if b not in by_bits[k]:
                raise ValueError(f"key {k!r} holds {b} bits, not an allowed option {sorted(by_bits[k])}")
            eff[k] = by_bits[k][b]
        keys = list(allowed)
        total = sum(o.nbytes for o in eff.values())
        moves: list[Move] = []
        cancelled: list[Move] = []
        budget = math.inf if self.transition_bytes_per_step is None else self.transition_bytes_per_step

        if total > capacity:
            total = self._force(step, capacity, allowed, by_bits, eff, cancelled)
            for k in keys:
                if k not in self._inflight and eff[k].bits != self.bits[k]:
                    m = Move(k, self.bits[k], eff[k].bits, self._bytes_moved(k, by_bits[k][self.bits[k]], eff[k]), True)
                    moves.append(m)
                    self._inflight[k] = m
                    budget -= m.bytes_moved
        full_budget = budget

        free = [k for k in keys if k not in self._inflight and not self._resident(k, step)]
        room_free = capacity - (total - sum(eff[k].nbytes for k in free))
        goal = self._adopt(free, allowed, by_bits, eff, room_free)
        self._target = {k: eff[k].bits for k in keys} | {k: o.bits for k, o in goal.items()}

        # Walk toward the goal: promotions by saving per byte, each preceded by the cheapest
        # goal demotions that make its room; stop spending at the transfer budget.
        order = {k: i for i, k in enumerate(keys)}
        ups, downs = [], []
        for k, o in goal.items():
            if o.bits != eff[k].bits:
                add, saved = o.nbytes - eff[k].nbytes, eff[k].cost - o.cost
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

        return Decision(step, dict(self._target), tuple(moves), tuple(cancelled), total,
                        sum(o.cost for o in eff.values()), total <= capacity)

    def _force(self, step: int, capacity: int, allowed: dict[Key, list[Choice]],
               by_bits: dict[Key, dict[int, Choice]], eff: dict[Key, Choice], cancelled: list[Move]) -> int:
        """Demote `eff` in place until it fits: free keys, then in-flight promotions, then all."""
        total = sum(o.nbytes for o in eff.values())
        free = [k for k in allowed if k not in self._inflight and not self._resident(k, step)]
        total = self._demote_among(free, capacity, allowed, eff, total)
        if total > capacity:
            order = {k: i for i, k in enumerate(allowed)}
            ranked = []
            for k, m in self._inflight.items():
                src, dst = by_bits[k][m.from_bits], eff[k]
                if dst.nbytes > src.nbytes:
                    freed, added = dst.nbytes - src.nbytes, src.cost - dst.cost
                    ranked.append((added / freed, added, order[k], k))
            for *_, k in sorted(ranked):
                if total <= capacity:
                    break
                m = self._inflight.pop(k)
                cancelled.append(m)
                total -= eff[k].nbytes - by_bits[k][m.from_bits].nbytes
                eff[k] = by_bits[k][m.from_bits]
        if total > capacity:
            total = self._demote_among([k for k in allowed if k not in self._inflight], capacity, allowed, eff, total)
        return total

    @staticmethod
    def _demote_among(keys: list[Key], capacity: int, allowed: dict[Key, list[Choice]],
                      eff: dict[Key, Choice], total: int) -> int:
        pick = {k: eff[k] for k in keys}
        fixed = total - sum(o.nbytes for o in pick.values())
        sub = _demote({k: allowed[k] for k in keys}, pick, capacity - fixed)
        eff.update(pick)
        return fixed + sub

    def _adopt(self, free: list[Key], allowed: dict[Key, list[Choice]], by_bits: dict[Key, dict[int, Choice]],
               eff: dict[Key, Choice], room: int) -> dict[Key, Choice]:
        """The goal for the free keys: the earlier goal or the current bits, unless the fresh
        greedy beats that base by the hysteresis margin."""
        keep = {k: eff[k] for k in free}
        cand = _greedy({k: allowed[k] for k in free}, room)
        old = {k: by_bits[k].get(self._target.get(k, eff[k].bits)) for k in free}
        base = keep
        if all(old.values()) and sum(o.nbytes for o in old.values()) <= room and \
                sum(o.cost for o in old.values()) < sum(o.cost for o in keep.values()):
            base = old
        base_cost = sum(o.cost for o in base.values())
        if cand.fits and base_cost - cand.cost > self.hysteresis * base_cost + self.min_gain:
            return {k: by_bits[k][cand.bits[k]] for k in free}
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
        held = self._inflight[key].to_bits if key in self._inflight else self.bits.get(key, 0)
        if held >= bits:
            return False
        self._inflight.pop(key, None)
        self._target.pop(key, None)
        self.bits[key] = bits
        self.changed_at[key] = step
        return True

    def abort(self, moves: Iterable[Move]) -> None:
        """Moves that will not complete (a copy dropped): the key keeps its committed bits."""
        for m in moves:
            if self._inflight.get(m.key) != m:
                raise ValueError(f"move {m} is not in flight")
            del self._inflight[m.key]

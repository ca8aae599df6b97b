"""The knapsack under the bit-width arbiter (arbiter.py): which precision each routed expert holds,
given the bytes left after KV, solved once; the per-step rules live in arbiter.py.

Objective. Every key (layer, expert) takes exactly one `Choice(bits, nbytes, cost)`; cost is
importance x sensitivity(bits) (0 at 16 bits, a miss cost at bits 0 = not resident). Minimise
the summed cost with the summed bytes <= capacity: a multiple-choice knapsack (MCKP). A caller
may give the costs factored (`weights`: a key's cost is weights[key] x choice.cost), so its
per-key choices stay the same objects from step to step while only the importances move; each
product is formed as the caller would have, so the decisions are the same floats either way.

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
Pure Python and deterministic: no randomness, no clock; ties follow the options' key order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Mapping, Sequence
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


Weights = Mapping[Key, float]


def _allowed(options: Options, floors: Mapping[Key, int] | None,
             weights: Weights | None = None) -> dict[Key, list[Choice]]:
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
            w = 1.0 if weights is None else weights[key]
            ok.sort(key=lambda o: (o.nbytes, w * o.cost, -o.bits))
        if not ok:
            raise ValueError(f"floors[{key!r}]={floor} leaves no option; bits are {sorted(o.bits for o in opts)}")
        out[key] = ok
    return out


# The helpers below scan one key's allowed options, which `_allowed` sorts by bytes: the
# options that free bytes from `cur` are a prefix, so the scans stop at the first that does not.
# Each keeps the first of equal ranks, as min() over (rank, ...) tuples in list order would.
# An option's cost is its key's weight x its `cost` (see `Arbiter.plan`'s weights; 1.0 when the
# options carry whole costs): each product is formed as the caller would have formed it, so
# sums and differences are the same floats either way.


def _top(opts: list[Choice], w: float) -> Choice:
    """The option of least (cost, bytes, -bits)."""
    best, bc = opts[0], w * opts[0].cost
    for o in opts:
        c = w * o.cost
        if c < bc or c == bc and (o.nbytes < best.nbytes or o.nbytes == best.nbytes and o.bits > best.bits):
            best, bc = o, c
    return best


def _down(opts: list[Choice], cur: Choice, w: float, i: int,
          below: float = math.inf) -> tuple[float, float, int, Choice] | None:
    """Least-slope demotion from `cur` freeing under `below` bytes: the next lower-hull vertex
    (the nearest one on a tie), as the heap entry (slope, added cost, i, option). The best so
    far is kept in locals, not tuples: this runs once per greedy step, thousands per plan."""
    best = None
    br = ba = 0.0
    bb = 0
    cn, cc = cur.nbytes, w * cur.cost
    for o in opts:
        freed = cn - o.nbytes
        if freed <= 0:
            break
        if freed < below:
            added = w * o.cost - cc
            r = added / freed
            if best is None or r < br or r == br and (added < ba or added == ba and o.bits > bb):
                best, br, ba, bb = o, r, added, o.bits
    return None if best is None else (br, ba, i, best)


def _up(opts: list[Choice], cur: Choice, w: float, i: int, slack: int) -> tuple[float, float, int, Choice] | None:
    """Promotion from `cur` within `slack` bytes saving the most cost per byte added, as the
    heap entry (-saving per byte, -saving, i, option)."""
    best = None
    br = bs = 0.0
    bb = 0
    cn, cc = cur.nbytes, w * cur.cost
    for o in opts:
        added = o.nbytes - cn
        if 0 < added <= slack:
            saved = cc - w * o.cost
            if saved > 0:
                r, s = -saved / added, -saved
                if best is None or r < br or r == br and (s < bs or s == bs and o.bits > bb):
                    best, br, bs, bb = o, r, s, o.bits
    return None if best is None else (br, bs, i, best)


def _closing(opts: list[Choice], cur: Choice, w: float, deficit: int) -> tuple[float, Choice] | None:
    """The option of least (added cost, -bits) freeing at least `deficit` bytes from `cur`;
    (added cost, option)."""
    best = None
    ba = 0.0
    most, cc = cur.nbytes - deficit, w * cur.cost
    for o in opts:
        if o.nbytes > most:
            break
        added = w * o.cost - cc
        if best is None or added < ba or added == ba and o.bits > best.bits:
            best, ba = o, added
    return None if best is None else (ba, best)


def _cost(pick: Mapping[Key, Choice], weights: Weights) -> float:
    """The summed cost of `pick`, in its key order."""
    return sum([weights[k] * o.cost for k, o in pick.items()])


def _demote(allowed: dict[Key, list[Choice]], pick: dict[Key, Choice], capacity: int, weights: Weights) -> int:
    """Demote `pick` in place until its bytes fit (or every key is at its floor); the total.

    Steps go in order of added cost per byte freed. A step that would close the deficit is
    only recorded as a way to finish (with its key's cheapest closing option), since it may
    free far more than needed; the walk goes on with smaller steps while they cost less than
    the best finish so far, and ends on the cheapest finish found (a min-cost cover greedy)."""
    keys = list(allowed)
    total = sum(pick[k].nbytes for k in keys)
    if total <= capacity:
        return total
    opts = list(allowed.values())
    ws = [weights[k] for k in keys]
    now = [pick[k] for k in keys]  # pick by key index, kept beside it
    # Entries (slope, added, index, option): one per key, so the index breaks every tie (and
    # the order entries leave the heap in does not depend on how it is arranged).
    heap = []
    for i, cur in enumerate(now):
        if (d := _down(opts[i], cur, ws[i], i)) is not None:
            heap.append(d)
    heapq.heapify(heap)
    log: list[tuple[Key, Choice]] = []  # applied steps, with the option each replaced
    spent = 0.0
    best: tuple[float, int, Key, Choice] | None = None  # (total added, steps kept, key, option)
    # One entry per key, replaced only when that key is at the top: no stale entries to skip.
    while heap and (best is None or spent < best[0]):
        _, added, i, o = heap[0]
        k, deficit = keys[i], total - capacity
        cur = now[i]
        if cur.nbytes - o.nbytes < deficit:
            log.append((k, cur))
            total -= cur.nbytes - o.nbytes
            spent += added
            pick[k] = now[i] = o
            d = _down(opts[i], o, ws[i], i)
        else:
            first = best is None
            c = _closing(opts[i], cur, ws[i], deficit)  # never None: o frees enough
            if best is None or spent + c[0] < best[0]:
                best = (spent + c[0], len(log), k, c[1])
            if first:
                # The first time the deficit can be closed, also try every key's single
                # move (the knapsack's "best single item" guard); a key whose least-bytes
                # option frees too little has none.
                for j, have in enumerate(now):
                    if have.nbytes - opts[j][0].nbytes >= deficit:
                        c = _closing(opts[j], have, ws[j], deficit)
                        if spent + c[0] < best[0]:
                            best = (spent + c[0], len(log), keys[j], c[1])
            d = _down(opts[i], cur, ws[i], i, below=deficit)
        if d is None:
            heapq.heappop(heap)
        else:
            heapq.heapreplace(heap, d)  # the top entry out, the key's next one in
    if best is None:
        return total  # every key at its least bytes and still over: the floors do not fit
    for k, prev in reversed(log[best[1]:]):
        total += prev.nbytes - pick[k].nbytes
        pick[k] = prev
    _, _, k, o = best
    total -= pick[k].nbytes - o.nbytes
    pick[k] = o
    return total


def _promote(allowed: dict[Key, list[Choice]], pick: dict[Key, Choice], capacity: int, weights: Weights) -> int:
    """Fill the slack in place by the best cost saved per byte added; the total."""
    keys = list(allowed)
    opts = list(allowed.values())
    ws = [weights[k] for k in keys]
    total = sum(pick[k].nbytes for k in keys)
    slack = capacity - total
    heap = []  # entries (-saving per byte, -saving, index, option)
    for i, k in enumerate(keys):
        if (u := _up(opts[i], pick[k], ws[i], i, slack)) is not None:
            heap.append(u)
    heapq.heapify(heap)
    # Lazy: slack only shrinks, so an entry's rank bounds what its key can do now; the top
    # entry is the true best if it still fits, else its key is re-ranked under the new slack.
    while heap:
        _, _, i, o = heapq.heappop(heap)
        k = keys[i]
        if o.nbytes - pick[k].nbytes <= slack:
            slack -= o.nbytes - pick[k].nbytes
            pick[k] = o
        if (u := _up(opts[i], pick[k], ws[i], i, slack)) is not None:
            heapq.heappush(heap, u)
    return capacity - slack


def _plan(pick: Mapping[Key, Choice], capacity: int, weights: Weights) -> Allocation:
    nbytes = sum(o.nbytes for o in pick.values())
    return Allocation({k: o.bits for k, o in pick.items()}, nbytes, _cost(pick, weights), nbytes <= capacity)


def _fit(allowed: dict[Key, list[Choice]], pick: dict[Key, Choice], capacity: int, fixed: Key,
         weights: Weights) -> bool:
    """Demote then fill every key but `fixed` in place around it; False if it cannot fit."""
    rest = {k: opts for k, opts in allowed.items() if k != fixed}
    room = capacity - pick[fixed].nbytes
    if sum(opts[0].nbytes for opts in rest.values()) > room:
        return False
    sub = {k: pick[k] for k in rest}
    _demote(rest, sub, room, weights)
    _promote(rest, sub, room, weights)
    pick.update(sub)
    return True


def _polish(allowed: dict[Key, list[Choice]], pick: dict[Key, Choice], capacity: int,
            weights: Weights) -> dict[Key, Choice]:
    """Local search: set one key to another option and re-fit the others, both from the
    current picks and from the cheapest ones; take any strict improvement, until none."""
    top = {k: _top(opts, weights[k]) for k, opts in allowed.items()}
    cost = _cost(pick, weights)
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
                    if not _fit(allowed, trial, capacity, k, weights):
                        break  # the floors of the rest do not fit beside o: neither source can
                    c = _cost(trial, weights)
                    # Strictly better by more than float noise, so the search cannot cycle.
                    if c < cost - 1e-12 * max(1.0, abs(cost)):
                        pick, cost, improved = trial, c, True
    return pick


def _greedy_pick(allowed: dict[Key, list[Choice]], capacity: int, weights: Weights,
                 start: dict[Key, Choice] | None = None,
                 polish_keys: int = POLISH_KEYS) -> tuple[Allocation, dict[Key, Choice]]:
    """The greedy's allocation and the option it picked per key."""
    if sum(opts[0].nbytes for opts in allowed.values()) > capacity:
        pick = {k: opts[0] for k, opts in allowed.items()}
        return _plan(pick, capacity, weights), pick
    pick = dict(start) if start is not None else {k: _top(opts, weights[k]) for k, opts in allowed.items()}
    _demote(allowed, pick, capacity, weights)
    _promote(allowed, pick, capacity, weights)
    if len(allowed) <= polish_keys:
        pick = _polish(allowed, pick, capacity, weights)
    return _plan(pick, capacity, weights), pick


def solve_greedy(options: Options, capacity: int, floors: Mapping[Key, int] | None = None,
                 start: Mapping[Key, int] | None = None, polish_keys: int = POLISH_KEYS,
                 weights: Weights | None = None) -> Allocation:
    """Hull greedy for the MCKP, then the local search if there are <= `polish_keys` keys (0: never).

    From `start` (key -> bits) instead of each key's cheapest option if given. `weights`: each
    key's option costs are weights[key] x choice.cost (None: the choices' costs as they are)."""
    allowed = _allowed(options, floors, weights)
    first = None
    if start is not None:
        by_bits = {k: {o.bits: o for o in opts} for k, opts in allowed.items()}
        missing = [k for k in allowed if start.get(k) not in by_bits[k]]
        if missing:
            raise ValueError(f"start bits not among the allowed options for keys {missing[:5]}")
        first = {k: by_bits[k][start[k]] for k in allowed}
    ws = dict.fromkeys(allowed, 1.0) if weights is None else weights
    return _greedy_pick(allowed, capacity, ws, first, polish_keys)[0]


def solve_exact(options: Options, capacity: int, floors: Mapping[Key, int] | None = None) -> Allocation:
    """Exact MCKP by DP over keys: reachable byte totals -> least cost, dominated totals pruned.

    Exponential in the worst case (about 5^keys totals); meant for <= 12 keys, as a test oracle."""
    allowed = _allowed(options, floors)
    if sum(opts[0].nbytes for opts in allowed.values()) > capacity:
        return _plan({k: opts[0] for k, opts in allowed.items()}, capacity, dict.fromkeys(allowed, 1.0))
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
    return _plan(dict(zip(allowed, picks)), capacity, dict.fromkeys(allowed, 1.0))

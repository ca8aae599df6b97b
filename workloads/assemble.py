"""From a workload's shape to its request list: arrivals, bounds, clipping, then content.

A workload's shape step is a stream of sessions (lists of RequestSkeleton, turn by turn,
think gaps set, arrivals unset unless replayed). `assemble` applies the arrival process,
keeps the first `requests` by arrival / those before `duration_s`, clips to the model's
context and only then makes the prompts: with the default (deferrable) synthesizer a
request's tokens are synthesized when it is sent (workloads/prompts.py), so building even a
whole trace holds no tokens; another synthesizer runs at build time, its ids kept as int32.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from workloads.arrivals import apply_arrivals, open_loop_times, session_times
from workloads.base import Request, WorkloadError
from workloads.prompts import PromptIds, Recent, as_prompt_ids
from workloads.synth import HashBlockSynthesizer, Prompt, PromptSynthesizer, RequestSkeleton, to_request

DEFAULT_REQUESTS = 100  # a generated workload without --requests or --duration
DEFAULT_CONCURRENCY = 4  # closed-loop users when the spec does not say


@dataclass(frozen=True)
class Shape:
    """What a workload's shape step hands to assemble()."""

    sessions: Callable[[int], Iterator[list[RequestSkeleton]]]  # size hint (requests) -> stream
    mean_turns: float  # requests per session on average (the session start rate's first guess)
    default_arrival: str
    default_rate: float = 1.0  # requests per second
    default_burstiness: float = 1.0
    finite: bool = False  # a trace: the stream ends
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Workload:
    """The built request list plus what the build changed or left out (for the result file)."""

    name: str
    arrival: str
    requests: tuple[Request, ...]
    notes: tuple[str, ...] = ()
    concurrency: int | None = None  # closed loop: users the harness runs at once

    @property
    def closed_loop(self) -> bool:
        return self.arrival == "closed"


@dataclass(frozen=True)
class TrafficPlan:
    """The shape step's result: skeletons in send order, before any token is synthesized."""

    arrival: str
    skeletons: tuple[RequestSkeleton, ...]
    notes: tuple[str, ...]


def assemble(spec, target, shape: Shape, synthesizer: PromptSynthesizer | None = None) -> Workload:
    """spec: registry.WorkloadSpec; target: registry.ModelTarget."""
    plan = make_plan(spec, target, shape)
    synthesizer = synthesizer or HashBlockSynthesizer(spec.seed, target.vocab_size, tuple(target.special_ids))
    label = spec.name.partition(":")[0]
    if getattr(synthesizer, "deferrable", False):  # tokens made when the request is sent
        recent = Recent()
        requests = tuple(
            to_request(s, Prompt(PromptIds.deferred(synthesizer, s, recent)), f"{label}-{s.index:05d}")
            for s in plan.skeletons
        )
    else:  # tasks are known now; the ids are kept as int32
        requests = tuple(
            to_request(s, _compact(synthesizer.synthesize(s)), f"{label}-{s.index:05d}") for s in plan.skeletons
        )
    concurrency = (spec.concurrency or DEFAULT_CONCURRENCY) if plan.arrival == "closed" else None
    return Workload(spec.name, plan.arrival, requests, plan.notes, concurrency)


def _compact(prompt: Prompt) -> Prompt:
    return dataclasses.replace(prompt, ids=as_prompt_ids(prompt.ids))


def make_plan(spec, target, shape: Shape) -> TrafficPlan:
    """Arrivals, bounds and clipping: everything but the tokens.

    With `requests` N the plan holds the first N requests by arrival (open loop and trace
    replay): sessions whose later turns come after the N-th request are cut short, and the
    notes name them. Closed-loop and offline plans keep the first N in session order.

    Open loop (poisson, gamma), `rate` R is the offered load in requests per second over the
    run's window T = N / R (`requests` N, default 100), or `duration_s` when that is shorter
    or given alone: sessions start at the rate from session_start_rate(), so that about
    R * T requests (first turns and later turns together) arrive in [0, T] and the N-th one
    near T. Trace replay, closed loop and offline plans have no start process and no rate.
    """
    arrival = spec.arrival or shape.default_arrival
    rate = spec.rate if spec.rate is not None else shape.default_rate
    burstiness = 1.0 if arrival == "poisson" else spec.burstiness or shape.default_burstiness
    notes = list(shape.notes)
    limit = spec.requests
    if limit is None and not shape.finite and (spec.duration_s is None or arrival in ("closed", "offline")):
        limit = DEFAULT_REQUESTS
        if spec.duration_s is not None:
            notes.append(f"{arrival} arrivals: duration_s bounds the run, not the list; built {limit} requests")
    open_loop = arrival in ("poisson", "gamma")
    if arrival == "poisson" and spec.burstiness not in (None, 1.0):
        raise WorkloadError(f"burstiness={spec.burstiness} needs gamma arrivals; use --arrival gamma")
    session_rate = rate / shape.mean_turns  # requests (not sessions) arrive at `rate` in the long run
    stream = shape.sessions(limit or math.ceil(rate * (spec.duration_s or 0)) or DEFAULT_REQUESTS)
    window_s = min(limit / rate if limit is not None else math.inf, spec.duration_s or math.inf)
    if open_loop and math.isfinite(window_s):  # `rate` requests a second from t=0, not after a ramp-up
        prefix = _Prefix(stream)
        session_rate = session_start_rate(prefix.first, rate, window_s, spec.time_scale, shape.mean_turns)
        stream = itertools.chain(prefix.taken, stream)  # the same sessions, in the same order
    if open_loop and limit is None and spec.duration_s is not None:  # as many sessions as start in time
        starts = open_loop_times(session_rate, burstiness, spec.seed, until_s=spec.duration_s)
        sessions = _take(stream, sessions=len(starts))
    elif open_loop and limit is not None:  # enough sessions that no later one can arrive among the first N
        sessions, starts = _take_first_arrivals(stream, limit, session_rate, burstiness, spec.seed, spec.time_scale)
    elif arrival == "trace" and limit is not None:  # the whole (finite) trace; the first N by arrival below
        sessions, starts = list(stream), None
    else:
        sessions = _take(stream, requests=limit)
        starts = open_loop_times(session_rate, burstiness, spec.seed, n=len(sessions)) if open_loop else None
    skeletons = apply_arrivals(sessions, arrival, spec.time_scale, starts, spec.turns or "dependent")
    if arrival in ("trace", "poisson", "gamma") and any(s.after_previous_s is not None for s in skeletons):
        notes.append("dependent turns: a session's later turn is sent at the later of its arrival time and the "
                     "previous turn's finish plus its think time after the answer (--turns independent: at its "
                     "arrival time)")
    planned = skeletons
    if arrival in ("trace", "poisson", "gamma") and spec.duration_s is not None:
        skeletons = [s for s in skeletons if s.arrival_s < spec.duration_s]
    skeletons = skeletons[:limit] if limit is not None else skeletons
    if not skeletons:
        raise WorkloadError(f"workload {spec.name!r} has no requests within duration_s={spec.duration_s}; raise it")
    if limit is not None and arrival in ("trace", "poisson", "gamma") and len(skeletons) < len(planned):
        notes.extend(_cut_sessions_note(planned, skeletons, limit, spec.duration_s))
    skeletons, clipped = _clip_all(skeletons, target.max_model_len)
    if clipped:
        notes.append(
            f"{clipped} of {len(skeletons)} requests clipped to max_model_len {target.max_model_len} "
            f"(prompt cut to its first tokens, output to at most {target.max_model_len // 2}); --scale shrinks instead"
        )
    return TrafficPlan(arrival, tuple(skeletons), tuple(notes))


CALIBRATION_ROUNDS = 8  # fixed-point rounds of session_start_rate (it settles in 2-4)


def session_start_rate(
    first: Callable[[int], list[list[RequestSkeleton]]], rate: float, window_s: float, time_scale: float,
    mean_turns: float, rounds: int = CALIBRATION_ROUNDS,
) -> float:
    """Session starts per second such that `rate` requests per second arrive in [0, window_s].

    Sessions start by a renewal process at rate L, so the expected number of requests in
    [0, T] is L * T * E[sum over a session's turns of max(0, 1 - offset / T)], where a
    turn's offset is its time after the session's start (the think times before it, times
    `time_scale`; 0 for turn 0): a later turn counts only for the part of the window late
    enough to hold it. Setting that to rate * T gives L = rate / E[...], the mean taken over
    the sessions that start in the window: first(m), the stream's first m sessions, with
    m = ceil(L * T), by a few fixed-point rounds from L = rate / mean_turns (the limit for a
    long window, when every turn counts). The result depends only on the seeded session
    stream, so it is deterministic for a seed; single-turn sessions give exactly `rate`.
    Only the start times change: sessions and turns stay those of the stream, in order.
    The rate averages over the window: it runs below `rate` near t=0 (mostly first turns)
    and above it near T (later turns of sessions begun earlier join).
    """
    session_rate = rate / mean_turns
    seen: set[int] = set()
    for _ in range(rounds):
        m = max(1, math.ceil(session_rate * window_s))
        if m in seen:  # settled (or cycling between neighbours): keep the last rate
            break
        seen.add(m)
        sample = first(m)
        if not sample:
            break
        counted = math.fsum(
            max(0.0, 1.0 - clock / window_s) for session in sample
            for clock, _ in session_times(0.0, session, time_scale)
        )
        session_rate = rate / (counted / len(sample))
    return session_rate


class _Prefix:
    """The first sessions of a stream, drawn on demand and kept (`taken`) to be sent later."""

    def __init__(self, stream: Iterator[list[RequestSkeleton]]) -> None:
        self.stream, self.taken = stream, []

    def first(self, m: int) -> list[list[RequestSkeleton]]:
        self.taken.extend(itertools.islice(self.stream, max(0, m - len(self.taken))))
        return self.taken[:m]


def _take(stream: Iterator[list[RequestSkeleton]], requests: int | None = None, sessions: int | None = None):
    """Sessions from the stream until `requests` turns or `sessions` sessions (or its end)."""
    taken: list[list[RequestSkeleton]] = []
    turns = 0
    for session in stream:
        if (requests is not None and turns >= requests) or (sessions is not None and len(taken) >= sessions):
            break
        taken.append(session)
        turns += len(session)
    return taken


def _take_first_arrivals(
    stream: Iterator[list[RequestSkeleton]], limit: int, session_rate: float, burstiness: float, seed: int,
    time_scale: float,
):
    """Open loop: sessions (and their start times) until `limit` turns have arrived before the
    next session's start, so the first `limit` requests by arrival are all among them."""
    size = 2 * limit + 64
    starts = open_loop_times(session_rate, burstiness, seed, n=size)
    sessions: list[list[RequestSkeleton]] = []
    pending: list[float] = []  # arrivals of taken turns after the current start (a heap)
    arrived = 0  # taken turns arriving at or before the current start
    while True:
        if len(sessions) == len(starts):  # the process's times are a prefix-stable seeded stream
            size *= 2
            starts = open_loop_times(session_rate, burstiness, seed, n=size)
        start = float(starts[len(sessions)])
        while pending and pending[0] <= start:
            heapq.heappop(pending)
            arrived += 1
        if arrived >= limit:
            break
        session = next(stream, None)
        if session is None:  # a finite stream (a trace) ran out
            break
        sessions.append(session)
        for clock, _ in session_times(start, session, time_scale):
            heapq.heappush(pending, clock)
    return sessions, starts[: len(sessions)]


MAX_NAMED_SESSIONS = 10  # sessions named one by one in the cut-short note; the rest are counted


def _cut_sessions_note(planned: list[RequestSkeleton], kept: list[RequestSkeleton], limit, duration_s) -> list[str]:
    """Which sessions lost their later turns to the bound (requests and/or duration_s)."""
    total: dict[str, int] = {}
    for s in planned:
        if s.session_id is not None:
            total[s.session_id] = total.get(s.session_id, 0) + 1
    have: dict[str, int] = {}
    for s in kept:
        if s.session_id is not None:
            have[s.session_id] = have.get(s.session_id, 0) + 1
    cut = [(sid, n, total[sid]) for sid, n in have.items() if n < total[sid]]
    if not cut:
        return []
    bound = " and ".join(
        b for b in (f"requests={limit}" if limit is not None else "",
                    f"duration_s={duration_s}" if duration_s is not None else "") if b
    )
    named = ", ".join(f"{sid} ({n} of {t} turns)" for sid, n, t in cut[:MAX_NAMED_SESSIONS])
    more = f" and {len(cut) - MAX_NAMED_SESSIONS} more" if len(cut) > MAX_NAMED_SESSIONS else ""
    return [
        f"kept the first {len(kept)} requests by arrival ({bound}); {len(cut)} "
        f"session{'s' * (len(cut) != 1)} cut short, "
        f"their later turns arriving after that: {named}{more}"
    ]


def _clip_all(skeletons: list[RequestSkeleton], max_len: int) -> tuple[list[RequestSkeleton], int]:
    out, clipped = [], 0
    for s in skeletons:
        if s.input_tokens + s.output_tokens <= max_len:
            out.append(s)
            continue
        clipped += 1
        out.append(clip(s, max_len))
    return out, clipped


def clip(s: RequestSkeleton, max_len: int) -> RequestSkeleton:
    """Fit prompt + output into max_len: output to at most max_len // 2, prompt to its head."""
    output = max(1, min(s.output_tokens, max_len // 2))
    prompt = max(1, min(s.input_tokens, max_len - output))
    starts, kept = 0, 0
    lengths = []
    for span in s.spans():
        if starts >= prompt:
            break
        lengths.append(min(span, prompt - starts))
        starts += span
        kept += 1
    return dataclasses.replace(
        s,
        input_tokens=prompt,
        output_tokens=output,
        blocks=s.blocks[:kept],
        block_lengths=tuple(lengths) if s.block_lengths else (),
        block_kinds=s.block_kinds[:kept],
    )

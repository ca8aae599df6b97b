"""Seeded arrival processes (trace replay, Poisson, gamma, closed loop, offline) and applying them.

Gamma with mean rate r and burstiness b: gaps ~ Gamma(shape 1/b, scale b/r), so the mean gap
is 1/r and the gaps' CV is sqrt(b) (b = 1: Poisson). Closed-loop requests carry arrival None
(the harness sends a session's next turn think_time_s after the previous answer); offline
ones all arrive at 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from workloads.base import WorkloadError
from workloads.synth import RequestSkeleton

ARRIVALS = ("trace", "poisson", "gamma", "closed", "offline")

# Seed streams, so that arrivals, shapes and content draw independent random numbers.
STREAM_ARRIVALS = 1
STREAM_SHAPES = 2


def rng(seed: int, stream: int):
    import numpy as np

    return np.random.default_rng([seed, stream])


def gaps(n: int, rate: float, burstiness: float, seed: int):
    """n inter-arrival gaps (seconds) of a gamma renewal process; burstiness 1 = exponential."""
    if rate <= 0:
        raise WorkloadError(f"rate must be positive (requests per second), got {rate}")
    if burstiness <= 0:
        raise WorkloadError(f"burstiness must be positive (1 = Poisson), got {burstiness}")
    generator = rng(seed, STREAM_ARRIVALS)
    if burstiness == 1.0:
        return generator.exponential(1.0 / rate, size=n)
    return generator.gamma(1.0 / burstiness, burstiness / rate, size=n)


def open_loop_times(
    rate: float, burstiness: float, seed: int, n: int | None = None, until_s: float | None = None
):
    """Arrival times: the first n, or all before until_s (the first arrival is one gap in)."""
    import numpy as np

    if n is not None:
        return np.cumsum(gaps(n, rate, burstiness, seed))
    if until_s is None:
        raise WorkloadError("an open-loop process needs a number of requests or a duration")
    # Draw in growing batches; one seeded stream per batch size keeps results reproducible.
    size = int(rate * until_s * 1.2) + 64
    while True:
        times = np.cumsum(gaps(size, rate, burstiness, seed))
        if times[-1] >= until_s:
            return times[times < until_s]
        size *= 2


def replay_times(times: Sequence[float], time_scale: float) -> list[float]:
    """Trace timestamps shifted to start at 0 and multiplied by time_scale (0.1 = 10x faster)."""
    if time_scale <= 0:
        raise WorkloadError(f"time_scale must be positive (0.1 = ten times faster), got {time_scale}")
    if not times:
        return []
    first = min(times)
    return [(t - first) * time_scale for t in times]


def session_times(start: float, session: list[RequestSkeleton], time_scale: float) -> list[tuple[float, float]]:
    """(arrival, think time) of each turn of an open-loop session starting at `start`."""
    clock = float(start)
    times = []
    for s in session:
        think = s.think_time_s * time_scale
        clock += think if s.turn > 0 else 0.0
        times.append((clock, think))
    return times


TURNS = ("dependent", "independent")


def apply_arrivals(
    sessions: list[list[RequestSkeleton]], arrival: str, time_scale: float, starts=None, turns: str = "dependent"
) -> list[RequestSkeleton]:
    """Set arrival and think times and number the requests in send order.

    trace: the skeletons' own trace times, replayed; poisson/gamma: session k starts at
    starts[k] and each later turn follows its think gap; open loop comes back sorted by
    arrival, closed loop and offline in session order (a session's turns together).
    Open loop with `turns` dependent: a session's later turn also waits for the previous
    turn's answer plus its think time after the answer (`think_after_s`, 0 when unknown),
    times `time_scale` (Request.after_previous_s; the runner holds it back).
    """
    if turns not in TURNS:
        raise WorkloadError(f"turns={turns!r} is not valid; use one of {', '.join(TURNS)}")
    flat = [s for session in sessions for s in session]
    if arrival == "trace":
        untimed = sum(s.arrival_s is None for s in flat)
        if untimed:
            raise WorkloadError(
                f"{untimed} of {len(flat)} trace requests have no arrival time; "
                "choose --arrival poisson, gamma, closed or offline"
            )
        times = replay_times([s.arrival_s for s in flat], time_scale)
        flat = [dataclasses.replace(s, arrival_s=t, think_time_s=s.think_time_s * time_scale)
                for s, t in zip(flat, times)]
    elif arrival in ("poisson", "gamma"):  # sessions start at the process's times, turns follow after think gaps
        flat = [
            dataclasses.replace(s, arrival_s=clock, think_time_s=think)
            for start, session in zip(starts, sessions)
            for s, (clock, think) in zip(session, session_times(start, session, time_scale))
        ]
    elif arrival == "closed":  # every request belongs to a session the harness can run
        flat = [
            dataclasses.replace(s, arrival_s=None, think_time_s=s.think_time_s * time_scale,
                                session_id=s.session_id or f"single-{i}")
            for i, s in enumerate(flat)
        ]
    else:  # offline: everything at t=0, nothing waits
        flat = [dataclasses.replace(s, arrival_s=0.0, think_time_s=0.0) for s in flat]
    if arrival in ("trace", "poisson", "gamma"):
        if turns == "dependent":
            flat = [dataclasses.replace(s, after_previous_s=(s.think_after_s or 0.0) * time_scale)
                    if s.turn > 0 and s.session_id is not None else s for s in flat]
        flat.sort(key=lambda s: s.arrival_s)  # stable: session order breaks ties
    return [dataclasses.replace(s, index=i) for i, s in enumerate(flat)]

"""Capacity at the SLO: the highest request rate an engine sustains while a share of the
requests (default 99%) meets the latency targets, found by a search over the run loop.

Every point is one `Runner` run of the same requests on the same started engine, retimed to
the point's rate (`retime`: the workload's arrival shape scaled, so gamma bursts stay
bursts), with the prefix cache emptied before it so one point's prompts never serve the
next. The search doubles the rate until a point fails, then bisects between the last pass
and the first fail until the bracket is within a relative tolerance or the point budget is
spent. Every rate tried lies on the grid 2^(k/n) req/s (n steps per doubling, each within the
tolerance), so repeated searches try the same rates and their answers differ by what was
measured, not by the path the search took. A point judges a percentile, so it needs at least
`min_requests(attainment)` requests (100 for 99%): with fewer, one miss already fails it.
Failed or unfinished requests count as missing the SLO; rejected ones are counted apart.
docs/capacity.md says what a search costs.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engines.base import Engine
from harness.errors import HarnessError
from harness.metrics import DEFAULT_SLO, meets_slo, request_times
from harness.runner import Runner, RunRecords
from workloads.base import Request

LIMITS = ("found", "below_lowest_rate", "above_highest_rate")
_SLO_NAMES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "e2e_ms": "end-to-end latency"}


@dataclass(frozen=True)
class CapacitySettings:
    attainment: float = 0.99  # share of a point's requests that must meet the SLO
    start_rate: float | None = None  # requests/s; None: the workload's own rate, else 1
    tolerance: float = 0.10  # stop bisecting when (fail - pass) / pass is within this
    max_points: int = 8
    max_rate: float | None = None  # never measure above this; passing here is "above_highest_rate"
    halvings: int = 3  # a failing start is halved at most this many times
    min_rate: float | None = None  # never halve below this; failing here is "below_lowest_rate"
    requests: int | None = None  # points replay this many requests of the workload (pwbench run draws them)
    seed: int = 0  # the Poisson spacing given to requests that arrive together

    def check(self) -> None:
        if not 0 < self.attainment < 1:
            raise HarnessError(f"--attainment must be in (0, 1), e.g. 0.99; got {self.attainment}")
        if self.start_rate is not None and not self.start_rate > 0:
            raise HarnessError(f"--start-rate must be > 0 requests/s; got {self.start_rate}")
        if not self.tolerance > 0:
            raise HarnessError(f"--tolerance must be > 0, e.g. 0.1; got {self.tolerance}")
        if self.max_points < 1:
            raise HarnessError(f"--max-points must be >= 1; got {self.max_points}")
        if self.max_rate is not None and not self.max_rate > 0:
            raise HarnessError(f"--max-rate must be > 0 requests/s; got {self.max_rate}")
        if self.min_rate is not None and not self.min_rate > 0:
            raise HarnessError(f"--min-rate must be > 0 requests/s; got {self.min_rate}")
        if self.requests is not None and self.requests < min_requests(self.attainment):
            raise HarnessError(f"capacity points of {self.requests} requests cannot judge {self.attainment:g} "
                               f"attainment; use at least {min_requests(self.attainment)}")
        if self.halvings < 0:
            raise HarnessError(f"--halvings must be >= 0; got {self.halvings}")


@dataclass(frozen=True)
class CapacityPoint:
    rate: float
    requests: int
    completed: int
    attainment: float  # requests meeting the SLO / requests of the point
    passed: bool
    duration_s: float  # the point's own time on the run clock (its cost)
    rejected: int = 0  # requests the engine refused at admission (left out of the attainment)

    def to_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "requests": self.requests, "completed": self.completed,
                "attainment": self.attainment, "passed": self.passed, "duration_s": self.duration_s,
                "rejected": self.rejected}


@dataclass(frozen=True)
class Capacity:
    requests_per_s: float | None  # the highest passing rate measured (None: none passed)
    attainment: float
    slo: dict[str, float]
    criterion: str
    limit: str  # found | below_lowest_rate | above_highest_rate
    points: tuple[CapacityPoint, ...]
    # Not in to_dict: each point's raw records (same order as points), and whether the search
    # ran to its end ("complete") or stopped at a point that did not ("interrupted", "failed").
    records: tuple[RunRecords, ...] = field(default=(), repr=False, compare=False)
    status: str = "complete"
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"requests_per_s": self.requests_per_s, "attainment": self.attainment, "slo": dict(self.slo),
                "criterion": self.criterion, "limit": self.limit, "points": [p.to_dict() for p in self.points]}


def min_requests(attainment: float) -> int:
    """Requests a point needs to judge `attainment`: ceil(1 / (1 - attainment)), so that a
    single miss does not by itself fail it (100 for 99%, 20 for 95%, 10 for 90%)."""
    return math.ceil(round(1 / (1 - attainment), 9))


def workload_rate(requests: Sequence[Request]) -> float | None:
    """Mean arrival rate, (n - 1) / (last - first arrival); None when they arrive together."""
    times = [r.arrival_s or 0.0 for r in requests]
    if len(times) < 2 or max(times) <= min(times):
        return None
    return (len(times) - 1) / (max(times) - min(times))


def retime(requests: Sequence[Request], rate: float, seed: int = 0) -> list[Request]:
    """The requests at mean rate `rate`: arrival times scaled by old rate / rate (the shape,
    gamma burstiness included, stays); requests that arrive together (offline) get Poisson
    arrivals at `rate` (seeded exponential gaps, the first one gap in), in their order."""
    old = workload_rate(requests)
    if old is not None:
        return [replace(r, arrival_s=(r.arrival_s or 0.0) * old / rate) for r in requests]
    rng, clock, out = random.Random(seed), 0.0, []
    for r in requests:
        clock += rng.expovariate(rate)
        out.append(replace(r, arrival_s=clock))
    return out


def point_attainment(records: RunRecords, total: int, slo: Mapping[str, float]) -> tuple[int, float, int]:
    """(completed, share of the `total` requests less those rejected that finished without error
    within the SLO, rejected). A request never sent, failed or unfinished counts as missing it;
    one the engine rejected at admission (it can never serve it at any rate, e.g. a prompt
    beyond the KV its budget leaves) is not a rate effect: it is left out here and reported as
    `rejected` (the served share shows it)."""
    tally = _Tally(slo)
    for r in records.requests:
        tally.add(r)
    return tally.result(total)


class _Tally:
    """A point's counts, request by request: what point_attainment needs, so a point's records
    can be dropped as they become final (Runner keep_records=False)."""

    def __init__(self, slo: Mapping[str, float]) -> None:
        self.slo, self.done, self.good, self.rejected = slo, 0, 0, 0

    def add(self, r) -> None:
        self.rejected += r.rejected
        if r.error is None and r.finish_s is not None:
            self.done += 1
            self.good += meets_slo(request_times({**vars(r), "output_tokens": r.output_tokens}), self.slo)

    def result(self, total: int) -> tuple[int, float, int]:
        judged = total - self.rejected
        return self.done, self.good / judged if judged > 0 else 0.0, self.rejected


def criterion(attainment: float, slo: Mapping[str, float], requests: int) -> str:
    targets = " and ".join(f"{_SLO_NAMES.get(k, k)} <= {v:g} ms" for k, v in slo.items())
    return (f"at least {attainment * 100:g}% of a point's {requests} requests finish with {targets}; "
            f"a failed or unfinished request counts as missing it, one the engine rejects at admission (it "
            f"cannot serve it at any rate) is left out and counted as rejected")


def find_capacity(engine: Engine, requests: Sequence[Request], slo: Mapping[str, float] = DEFAULT_SLO,
                  settings: CapacitySettings = CapacitySettings(), closed_loop: bool = False,
                  clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
                  on_point: Callable[[CapacityPoint], None] | None = None,
                  on_runner: Callable[[Runner], None] | None = None, keep_records: bool = True) -> Capacity:
    """Search the highest rate at which `requests` (an open-loop workload) meet `slo` on the
    started, warmed-up `engine`. `on_point` sees each point when it is measured; `on_runner`
    each point's Runner before it runs (to stop it on Ctrl-C, which ends the search). With
    `keep_records=False` each request is judged as it finishes and its record dropped (a point
    of 20k requests holds none); `records` then carry only the steps."""
    settings.check()
    if closed_loop:
        raise HarnessError("capacity search needs an open-loop workload (--rate or a trace); a closed loop sets "
                           "its own rate from --concurrency: give --arrival poisson --rate R or replay a trace")
    need = min_requests(settings.attainment)
    if len(requests) < need:
        raise HarnessError(f"--requests: judging {settings.attainment * 100:g}% attainment needs at least {need} "
                           f"requests per capacity point, got {len(requests)}; use --requests {need} or more")
    slo = dict(slo)
    points: list[CapacityPoint] = []
    runs: list[RunRecords] = []

    def measure(rate: float) -> CapacityPoint | None:
        engine.reset_prefix_cache()
        tally = _Tally(slo)
        runner = Runner(engine, retime(requests, rate, settings.seed), clock=clock, sleep=sleep,
                        on_record=None if keep_records else tally.add, keep_records=keep_records)
        if on_runner is not None:
            on_runner(runner)
        start = clock()
        records = runner.run()
        duration = clock() - start
        runs.append(records)
        if records.status != "complete":
            return None
        completed, share, rejected = (point_attainment(records, len(requests), slo) if keep_records
                                      else tally.result(len(requests)))
        point = CapacityPoint(rate, len(requests), completed, share, share >= settings.attainment and rejected
                              < len(requests), duration, rejected)
        points.append(point)
        if on_point is not None:
            on_point(point)
        return point

    def result(best: float | None, limit: str) -> Capacity:
        stopped = runs[-1] if runs and runs[-1].status != "complete" else None
        return Capacity(best, settings.attainment, slo, criterion(settings.attainment, slo, len(requests)), limit,
                        tuple(points), tuple(runs), stopped.status if stopped else "complete",
                        stopped.error if stopped else None)

    cap = settings.max_rate or math.inf
    # The grid: 2^(k/n) req/s with the fewest steps per doubling n whose ratio is within the
    # tolerance (n = 8 for 10%, 4 for 25%), so doubling and halving stay on it.
    n = math.ceil(math.log(2) / math.log(1 + settings.tolerance) - 1e-9)
    step = 2 ** (1 / n)

    def snap(r: float) -> float:
        """The nearest rate on the grid, capped: every search (every repeat) tries the same
        rates, so repeats differ by what they measure, not by the path they took."""
        k = round(math.log2(r) * n)
        return min(2.0 ** (k // n) * 2 ** ((k % n) / n), cap)

    rate = snap(settings.start_rate or workload_rate(requests) or 1.0)
    first = measure(rate)
    if first is None:
        return result(None, "below_lowest_rate")
    lo: float | None = rate if first.passed else None
    hi: float | None = None if first.passed else rate
    if lo is None:  # halve until a point passes
        for _ in range(settings.halvings):
            if len(points) >= settings.max_points:
                break
            if settings.min_rate is not None and snap(rate / 2) < settings.min_rate * (1 - 1e-9):
                break
            rate = snap(rate / 2)
            point = measure(rate)
            if point is None:
                break
            if point.passed:
                lo = rate
                break
            hi = rate
        if lo is None:
            return result(None, "below_lowest_rate")
    else:  # double until a point fails or the cap passes
        while hi is None:
            if lo >= cap or len(points) >= settings.max_points:
                return result(lo, "above_highest_rate")
            rate = snap(lo * 2)
            point = measure(rate)
            if point is None:
                return result(lo, "above_highest_rate")
            if point.passed:
                lo = rate
            else:
                hi = rate
    while hi / lo > step * (1 + 1e-9) and len(points) < settings.max_points:
        rate = snap(math.sqrt(lo * hi))
        if not lo < rate < hi:
            break
        point = measure(rate)
        if point is None:
            break
        if point.passed:
            lo = rate
        else:
            hi = rate
    return result(lo, "found")

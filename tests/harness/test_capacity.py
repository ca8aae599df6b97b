"""Capacity search over the run loop. On the dummy engine with one sequence at a time and a
simulated clock, service is deterministic, so the capacity has a closed form (derived in the
test) that the search must land within its tolerance of; points are checked against a
recomputation from each point's raw records; on the real `moe` engine the prefix cache is
emptied between points."""

from __future__ import annotations

import math

import pytest
from tiny_models import CPU32

from engines.base import EngineRequest
from engines.dummy import DummyConfig, DummyEngine
from engines.registry import create_engine
from harness.capacity import CapacitySettings, find_capacity, min_requests, retime, workload_rate
from harness.errors import HarnessError
from harness.offline import run_offline
from workloads.base import Request

DEMO = "engines/demo_model"


class SimClock:
    """Simulated seconds. Every advance is at least 1 ns: the run loop sleeps until a due time
    computed relative to its point's start, and a gap below the float resolution of the
    absolute time would otherwise never move the clock."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += max(seconds, 1e-9)


def uniform(n: int, new: int, gap: float = 1.0) -> list[Request]:
    return [Request(f"r{i}", (5, 6, 7, i % 50 + 10), new, arrival_s=(i + 1) * gap) for i in range(n)]


def search(requests, slo, settings, **cfg):
    clock = SimClock()
    engine = DummyEngine(DummyConfig(**cfg), sleep=clock.advance)
    engine.start()
    seen = []
    cap = find_capacity(engine, requests, slo, settings, clock=clock.now, sleep=clock.advance, on_point=seen.append)
    assert not engine.has_unfinished()
    return cap, seen


def recomputed(records, slo, total):
    """(completed, share of `total` within slo) by hand from the raw request records."""
    good = completed = 0
    for r in records.requests:
        if r.error is not None or r.finish_s is None:
            continue
        completed += 1
        ttft = r.token_times_s[0] - r.arrival_s
        tpot = (r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1)
        good += ttft * 1e3 <= slo["ttft_ms"] and tpot * 1e3 <= slo["tpot_ms"]
    return completed, good / total


def test_found_capacity_is_within_tolerance_of_the_analytic_one():
    # One sequence at a time, every step 10 ms, 10 output tokens: a request is served in
    # S = 10 steps = 0.1 s (mu = 10 req/s) and its first token comes one step (10 ms) after it
    # starts. Arrivals are evenly spaced (gap g = 1 / rate), so below mu nobody waits (TTFT
    # 10 ms); above it request i (from 0) waits i * (S - g). TPOT is always 10 ms. With
    # TTFT <= 50 ms, request i meets the SLO while 10 ms + i * (S - g) <= 50 ms; 99% of N = 200
    # means requests 0..197 must meet it: 197 * (S - g) <= 0.04 s, so
    #   capacity = 1 / (S - 0.04 / 197) = 10.0203... req/s.
    n, slo = 200, {"ttft_ms": 50.0, "tpot_ms": 100.0}
    analytic = 1 / (0.1 - 0.04 / (math.ceil(0.99 * n) - 1))
    settings = CapacitySettings(attainment=0.99, start_rate=1.0, tolerance=0.10, max_points=12)
    cap, seen = search(uniform(n, 10), slo, settings, base_ms=10.0, max_num_seqs=1)
    assert cap.limit == "found" and cap.status == "complete"
    assert analytic / 1.10 <= cap.requests_per_s <= analytic
    assert [p["rate"] for p in cap.to_dict()["points"]][:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
    passes = [p.rate for p in cap.points if p.passed]
    fails = [p.rate for p in cap.points if not p.passed]
    assert max(passes) == cap.requests_per_s and max(passes) < analytic < min(fails)
    assert (min(fails) - max(passes)) / max(passes) <= 0.10
    assert seen == list(cap.points)
    for point, records in zip(cap.points, cap.records):
        assert len(records.requests) == point.requests == n
        completed, share = recomputed(records, slo, n)
        assert (point.completed, point.attainment) == (completed, pytest.approx(share))
        assert point.passed == (share >= 0.99)
        gaps = {round(b.arrival_s - a.arrival_s, 9) for a, b in zip(records.requests, records.requests[1:])}
        assert gaps == {round(1 / point.rate, 9)}  # the even spacing kept, at the point's rate
    d = cap.to_dict()
    assert set(d) == {"requests_per_s", "attainment", "slo", "criterion", "limit", "points"}
    assert set(d["points"][0]) == {"rate", "requests", "completed", "attainment", "passed", "duration_s", "rejected"}
    assert d["slo"] == slo and "99%" in d["criterion"] and "200" in d["criterion"]


def test_requests_the_engine_rejects_are_capacity_of_another_kind():
    """A request the engine refuses at admission (here a token outside the vocabulary; under a
    budget, a prompt beyond the KV it leaves) cannot be served at any rate: it is left out of
    the attainment and counted as rejected, so it does not sink the search to below_lowest_rate."""
    good = uniform(100, 10)
    bad = [Request(f"x{i}", (5, 99_999), 10, arrival_s=100.5 + i) for i in range(5)]
    slo = {"ttft_ms": 1000.0, "tpot_ms": 1000.0}
    cap, seen = search(good + bad, slo, CapacitySettings(attainment=0.99, start_rate=1.0, max_points=3),
                       max_num_seqs=256)
    assert all(p.rejected == 5 and p.completed == 100 and p.attainment == 1.0 and p.passed for p in seen)
    assert cap.requests_per_s == 4.0 and cap.limit == "above_highest_rate"


def test_an_slo_no_rate_meets_halves_then_reports_below_lowest_rate():
    # Every decode step takes 10 ms, so TPOT is 10 ms at any rate: a 5 ms TPOT target fails all.
    slo = {"ttft_ms": 1000.0, "tpot_ms": 5.0}
    settings = CapacitySettings(attainment=0.9, start_rate=4.0, halvings=3)
    cap, _ = search(uniform(10, 4), slo, settings, base_ms=10.0, max_num_seqs=1)
    assert cap.limit == "below_lowest_rate" and cap.requests_per_s is None
    assert [p.rate for p in cap.points] == [4.0, 2.0, 1.0, 0.5]
    for point, records in zip(cap.points, cap.records):
        assert recomputed(records, slo, 10) == (10, 0.0) and point.attainment == 0.0 and not point.passed


def test_the_rate_cap_ends_a_search_that_keeps_passing():
    # mu = 10 req/s as above; a 5 req/s cap is passed everywhere.
    slo = {"ttft_ms": 50.0, "tpot_ms": 100.0}
    settings = CapacitySettings(attainment=0.9, start_rate=1.0, max_rate=5.0)
    cap, _ = search(uniform(20, 10), slo, settings, base_ms=10.0, max_num_seqs=1)
    assert cap.limit == "above_highest_rate" and cap.requests_per_s == 5.0
    assert [p.rate for p in cap.points] == [1.0, 2.0, 4.0, 5.0] and all(p.passed for p in cap.points)
    assert [recomputed(r, slo, 20) for r in cap.records] == [(20, 1.0)] * 4


def test_min_requests_and_input_errors():
    assert [min_requests(a) for a in (0.5, 0.9, 0.95, 0.99, 0.999)] == [2, 10, 20, 100, 1000]
    engine = DummyEngine(DummyConfig())
    with pytest.raises(HarnessError, match="open-loop"):
        find_capacity(engine, uniform(100, 2), closed_loop=True)
    with pytest.raises(HarnessError, match="at least 100 requests"):
        find_capacity(engine, uniform(99, 2))
    with pytest.raises(HarnessError, match="--attainment"):
        find_capacity(engine, uniform(100, 2), settings=CapacitySettings(attainment=1.0))


def test_retime_keeps_the_arrival_shape_and_spaces_requests_that_arrive_together():
    bursty = [Request(f"r{i}", (3,), 1, arrival_s=t) for i, t in enumerate([0.0, 0.1, 0.15, 2.0, 2.05, 4.0])]
    assert workload_rate(bursty) == pytest.approx(5 / 4.0)
    fast = retime(bursty, 5.0)  # 4x the rate: every time / 4
    assert [r.arrival_s for r in fast] == pytest.approx([0.0, 0.025, 0.0375, 0.5, 0.5125, 1.0])
    offline = [Request(f"r{i}", (3,), 1, arrival_s=0.0) for i in range(2000)]
    assert workload_rate(offline) is None
    spaced = retime(offline, 8.0, seed=1)
    times = [r.arrival_s for r in spaced]
    assert times == sorted(times) and times[0] > 0 and [r.arrival_s for r in retime(offline, 8.0, seed=1)] == times
    assert workload_rate(spaced) == pytest.approx(8.0, rel=0.1)  # exponential gaps of mean 1/8 s


def test_moe_prefix_cache_is_emptied_between_points():
    """Two points over the same two requests (a prompt of three 16-token KV blocks each): the
    second point's steps get no cached prompt tokens, though re-sending a prompt without the
    reset does (the engine caches it)."""
    engine = create_engine("moe", {"model": DEMO, **CPU32})
    engine.start()
    try:
        prompts = [tuple(range(10 + k, 58 + k)) for k in (0, 100)]
        requests = [Request(f"r{k}", p, 2, arrival_s=0.05 * k) for k, p in enumerate(prompts)]
        settings = CapacitySettings(attainment=0.5, start_rate=1.0, max_points=2)
        cap = find_capacity(engine, requests, {"ttft_ms": 1e9, "tpot_ms": 1e9}, settings)
        assert [p.rate for p in cap.points] == [1.0, 2.0] and all(p.passed for p in cap.points)
        first, second = cap.records
        assert [r.output_ids for r in first.requests] == [r.output_ids for r in second.requests]
        assert sum(s["cached_prompt_tokens"] for s in second.steps) == 0
        assert sum(s["prefill_tokens"] for s in second.steps) == sum(len(p) for p in prompts)
        steps = []
        run_offline(engine, [EngineRequest("again", prompts[0], 1)], on_step=steps.append)
        assert sum(s.cached_prompt_tokens for s in steps) > 0
    finally:
        engine.stop()

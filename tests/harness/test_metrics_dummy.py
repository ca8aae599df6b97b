"""Run loop + metrics on the dummy engine with known latencies, on a simulated clock, so every
latency is exact and checked against numbers computed by hand below."""

from __future__ import annotations

import dataclasses
import time

import pytest

from engines.dummy import DummyConfig, DummyEngine
from engines.sim.clock import VirtualClock
from harness.metrics import percentile, summarize_requests, summarize_steps
from harness.runner import RunLimits, Runner, ThreadCpuClock
from workloads.base import Request


def run_sim(requests, closed=False, concurrency=None, **cfg):
    clock = VirtualClock()
    engine = DummyEngine(DummyConfig(**cfg), sleep=clock.advance)
    runner = Runner(engine, requests, closed, concurrency, RunLimits(), clock=clock.now, sleep=clock.advance)
    records = runner.run()
    rows = [dict(vars(r), output_tokens=r.output_tokens) for r in records.requests]
    return records, {r["request_id"]: r for r in rows}


def test_latencies_percentiles_goodput_by_hand():
    # Step cost: 10 ms + 1 ms per prefill token + 2 ms per decode token.
    reqs = [
        Request("a", tuple(range(5)), 3, arrival_s=0.0),
        Request("b", tuple(range(10)), 2, arrival_s=0.1),
    ]
    records, rows = run_sim(reqs, base_ms=10, prefill_ms_per_token=1, decode_ms_per_token=2)
    # a: prefill 5 -> 15 ms (token 1); two decodes of 12 ms -> 27, 39 ms.
    # idle until 100 ms; b: prefill 10 -> 120 ms (token 1); decode -> 132 ms.
    assert rows["a"]["token_times_s"] == pytest.approx([0.015, 0.027, 0.039])
    assert rows["b"]["token_times_s"] == pytest.approx([0.120, 0.132])
    assert rows["b"]["sent_s"] == pytest.approx(0.1) and rows["b"]["started_s"] == pytest.approx(0.120)
    s = summarize_requests(rows.values(), {"ttft_ms": 18})
    assert s["ttft_ms"]["mean"] == pytest.approx(17.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(17.5)
    assert s["ttft_ms"]["p90"] == pytest.approx(15 + 0.9 * 5)
    assert s["ttft_ms"]["p99"] == pytest.approx(15 + 0.99 * 5)
    assert s["tpot_ms"]["mean"] == pytest.approx(12.0)
    assert s["itl_ms"]["p50"] == pytest.approx(12.0)
    assert s["e2e_ms"]["mean"] == pytest.approx((39 + 32) / 2)
    assert s["duration_s"] == pytest.approx(0.132)
    assert s["requests_per_s"] == pytest.approx(2 / 0.132)
    assert s["output_tokens_per_s"] == pytest.approx(5 / 0.132)
    assert s["goodput_requests_per_s"] == pytest.approx(1 / 0.132)  # only a meets TTFT <= 18 ms
    assert s["slo_attainment"] == pytest.approx(0.5)
    assert s["peak_concurrency"] == 1
    e = summarize_steps(records.steps, s["output_tokens"])
    # prefill steps: 5 tok in 15 ms and 10 tok in 20 ms; decode-only steps: 3 tokens in 36 ms.
    assert e["prefill_tokens_per_s"] == pytest.approx(15 / 0.035)
    assert e["decode_tokens_per_s"] == pytest.approx(3 / 0.036)


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    xs = [3.0, 1.0, 7.5, 2.2, 9.9, 4.4, 4.4]
    for q in (0, 50, 90, 95, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_closed_loop_think_times_and_concurrency():
    # Two users, three sessions; each turn takes 1 step of 10 ms (prompt) + 10 ms per decode.
    reqs = [
        Request("s1t0", (1, 2), 1, session_id="s1", turn=0),
        Request("s1t1", (1, 2), 1, session_id="s1", turn=1, think_time_s=0.5),
        Request("s2t0", (3,), 2, session_id="s2", turn=0),
        Request("s3t0", (4,), 1, session_id="s3", turn=0),
    ]
    records, rows = run_sim(reqs, closed=True, concurrency=2, base_ms=10)
    # t=0: users take s1 and s2. Step 1 (10 ms): s1t0 done, s2t0 first token. s1t1 due at 0.51.
    assert rows["s1t0"]["finish_s"] == pytest.approx(0.010)
    assert rows["s1t1"]["arrival_s"] == pytest.approx(0.510)
    # Step 2 (20 ms): s2t0 done -> its user takes s3 at once.
    assert rows["s3t0"]["arrival_s"] == pytest.approx(0.020) and rows["s3t0"]["finish_s"] == pytest.approx(0.030)
    assert rows["s1t1"]["finish_s"] == pytest.approx(0.520)
    assert summarize_requests(rows.values())["peak_concurrency"] == 2


def test_arrivals_on_the_simulated_clock_exactly():
    """The schedule rule: a request is sent at its arrival time when the engine is idle, and
    when the step in progress ends otherwise (so less than one step late)."""
    # Steps of 30 ms; one output token each, so every request finishes in the step it starts.
    reqs = [Request(f"r{i}", (1, 2, 3), 1, arrival_s=t) for i, t in enumerate([0.0, 0.010, 0.020, 0.070])]
    records, rows = run_sim(reqs, base_ms=30)
    # r0 at 0 (idle) -> step [0, 30 ms]; r1, r2 come due during it -> sent at 30 ms, step
    # [30, 60 ms]; idle at 60 ms, the loop sleeps to r3's 70 ms -> sent on time, step [70, 100 ms].
    assert [rows[f"r{i}"]["sent_s"] for i in range(4)] == pytest.approx([0.0, 0.030, 0.030, 0.070])
    assert [s["t_s"] for s in records.steps] == pytest.approx([0.0, 0.030, 0.070])
    assert rows["r3"]["finish_s"] == pytest.approx(0.100)
    # Every 50 ms with 2 ms steps: always idle when due, so every send is exactly on time.
    reqs = [Request(f"r{i}", (1, 2, 3), 2, arrival_s=0.05 * i) for i in range(8)]
    _, rows = run_sim(reqs, base_ms=2)
    assert [r["sent_s"] - r["arrival_s"] for r in rows.values()] == pytest.approx([0.0] * 8, abs=1e-12)


def test_real_clock_arrivals_follow_the_schedule():
    """Real sleeps: no wall-clock bound holds on shared cores (a sleep may overshoot by any
    amount; the exact timing is tested on the simulated clock above). What holds under any
    load: no request is sent early, sends keep arrival order, and a request is sent before a
    second step starts after its arrival (at most the step in progress and the one its loop
    iteration had already chosen)."""
    reqs = [Request(f"r{i}", (1, 2, 3), 2, arrival_s=0.05 * i) for i in range(8)]
    engine = DummyEngine(DummyConfig(base_ms=2))
    runner = Runner(engine, reqs, limits=RunLimits())
    records = runner.run()
    assert records.status == "complete" and all(r.finish_s is not None for r in records.requests)
    recs = sorted(records.requests, key=lambda r: r.arrival_s)
    starts = [s["t_s"] for s in records.steps]
    for rec in recs:
        assert rec.sent_s >= rec.arrival_s
        assert sum(rec.arrival_s < t < rec.sent_s for t in starts) <= 1, rec.request_id
    assert [r.sent_s for r in recs] == sorted(r.sent_s for r in recs)


def _burn(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU time (a step that computes)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_thread_cpu_clock_counts_the_steps_cpu_and_skips_the_waits():
    """The same schedule as test_latencies_percentiles_goodput_by_hand, its step costs spent as CPU
    time: on ThreadCpuClock the latencies are the hand-computed ones (plus the loop's own CPU,
    well under a millisecond a step), the 100 ms idle gap is skipped, not slept; an engine that
    sleeps instead (a neighbour holding the core looks the same to this thread) takes no time."""
    reqs = [Request("a", tuple(range(5)), 3, arrival_s=0.0), Request("b", tuple(range(10)), 2, arrival_s=0.1)]
    clock = ThreadCpuClock()
    engine = DummyEngine(DummyConfig(base_ms=10, prefill_ms_per_token=1, decode_ms_per_token=2), sleep=_burn)
    wall = time.perf_counter()
    records = Runner(engine, reqs, limits=RunLimits(), clock=clock.now, sleep=clock.sleep).run()
    wall = time.perf_counter() - wall
    rows = {r.request_id: r for r in records.requests}
    assert rows["a"].token_times_s == pytest.approx([0.015, 0.027, 0.039], abs=3e-3)
    assert rows["b"].sent_s >= 0.1 and rows["b"].token_times_s == pytest.approx([0.120, 0.132], abs=3e-3)
    assert clock.waited == pytest.approx(0.1 - 0.039, abs=3e-3)  # the idle gap, added to the clock
    assert wall >= 0.07  # the steps' CPU was spent: 15 + 12 + 12 + 20 + 12 ms

    clock = ThreadCpuClock()
    sleeping = DummyEngine(DummyConfig(base_ms=10, prefill_ms_per_token=1, decode_ms_per_token=2))  # time.sleep
    records = Runner(sleeping, reqs, limits=RunLimits(), clock=clock.now, sleep=clock.sleep).run()
    assert all(s["duration_s"] < 5e-3 for s in records.steps), [s["duration_s"] for s in records.steps]


def test_duration_bound_stops_admitting():
    clock = VirtualClock()
    reqs = [Request(f"r{i}", (1,), 1, arrival_s=0.1 * i) for i in range(10)]
    engine = DummyEngine(DummyConfig(base_ms=1), sleep=clock.advance)
    records = Runner(engine, reqs, limits=RunLimits(duration_s=0.35), clock=clock.now, sleep=clock.advance).run()
    assert sorted(r.request_id for r in records.requests) == ["r0", "r1", "r2", "r3"]


def test_overhead_is_small():
    """Not a speed assertion: just that 2,000 zero-latency requests all complete."""
    reqs = [Request(f"r{i}", (1, 2), 4, arrival_s=0.0) for i in range(2000)]
    t = time.perf_counter()
    records = Runner(DummyEngine(DummyConfig(max_num_seqs=256)), reqs).run()
    assert sum(r.finish_s is not None for r in records.requests) == 2000
    assert time.perf_counter() - t < 120  # a generous bound against hangs, not a benchmark


def test_self_timed_tokens_never_precede_their_send():
    """An engine that stamps its own tokens (a remote stream: RequestOutput.token_times on
    perf_counter) lands on the run's clock exactly: a slow on_start (the telemetry sampler
    starting) must not shift those stamps before the request was sent (it did by ~2 ms in CI)."""
    class StampingEngine(DummyEngine):
        def step(self):
            out = super().step()
            now = time.perf_counter()
            outs = tuple(dataclasses.replace(o, token_times=tuple(now for _ in o.new_token_ids)) for o in out.outputs)
            return dataclasses.replace(out, outputs=outs)

    reqs = [Request(f"r{i}", (1, 2, 3), 2, arrival_s=0.0) for i in range(4)]
    records = Runner(StampingEngine(DummyConfig(base_ms=1)), reqs).run(on_start=lambda: time.sleep(0.05))
    assert all(r.finish_s is not None for r in records.requests)
    for rec in records.requests:
        assert rec.sent_s <= rec.token_times_s[0] and rec.finish_s == rec.token_times_s[-1], rec.request_id

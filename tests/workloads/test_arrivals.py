"""Arrival processes against theory and the raw trace: gamma rate and CV, replay time scale,
duration bounds, and how closed-loop and offline requests are represented.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from workloads.arrivals import open_loop_times
from workloads.registry import ModelTarget, WorkloadSpec, build_workload

TARGET = ModelTarget(vocab_size=1000, max_model_len=10**6)
N = 10_000


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_gamma_mean_rate_within_5_percent(burstiness, seed):
    times = open_loop_times(rate=8.0, burstiness=burstiness, seed=seed, n=N)
    assert len(times) == N and np.all(np.diff(times) >= 0)
    assert N / times[-1] == pytest.approx(8.0, rel=0.05)


def test_gamma_cv_grows_with_burstiness_as_theory_says():
    """Gaps ~ Gamma(shape 1/b, scale b/rate): CV = sqrt(b)."""
    cvs = []
    for burstiness in (0.25, 0.5, 1.0, 2.0, 4.0, 8.0):
        gaps = np.diff(open_loop_times(rate=3.0, burstiness=burstiness, seed=5, n=N), prepend=0.0)
        cv = gaps.std() / gaps.mean()
        assert cv == pytest.approx(np.sqrt(burstiness), rel=0.1), burstiness
        cvs.append(cv)
    assert cvs == sorted(cvs)


def test_duration_bounds_open_loop_arrivals():
    times = open_loop_times(rate=20.0, burstiness=2.0, seed=3, until_s=500.0)
    assert times.max() < 500.0
    assert len(times) / 500.0 == pytest.approx(20.0, rel=0.1)


def raw_mooncake(path, limit=None):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return rows[:limit] if limit else rows


def test_replay_time_scale(real_trace):
    path = real_trace("mooncake/conversation_trace.jsonl")
    raw = raw_mooncake(path, 300)
    requests = build_workload(WorkloadSpec(f"trace:{path}", requests=300, time_scale=0.1), TARGET).requests
    want = [(r["timestamp"] - raw[0]["timestamp"]) / 1000 * 0.1 for r in raw]
    assert [r.arrival_s for r in requests] == pytest.approx(want, abs=1e-9)
    assert [r.num_prompt_tokens for r in requests] == [r["input_length"] for r in raw]


def test_replay_duration_keeps_requests_before_it(real_trace):
    path = real_trace("mooncake/conversation_trace.jsonl")
    raw = raw_mooncake(path)
    requests = build_workload(WorkloadSpec(f"trace:{path}", duration_s=30.0), TARGET).requests
    assert len(requests) == sum(r["timestamp"] < 30_000 for r in raw)
    scaled = build_workload(WorkloadSpec(f"trace:{path}", duration_s=30.0, time_scale=0.5), TARGET).requests
    assert len(scaled) == sum(r["timestamp"] < 60_000 for r in raw)


def test_ragpulse_replay_is_sorted_and_keeps_session_turn_gaps(real_trace):
    """The file is unsorted; replay sorts it, and think time = gap to the session's previous request."""
    folder = real_trace("ragpulse")
    rows = [json.loads(line) for line in (folder / "0_trace.jsonl").read_text().splitlines() if line.strip()]
    times = sorted(float(r["timestamp"]) for r in rows)
    requests = build_workload(WorkloadSpec(f"trace:{folder}", time_scale=0.01, scale=0.05), TARGET).requests
    assert [r.arrival_s for r in requests] == pytest.approx([(t - times[0]) * 0.01 for t in times], abs=1e-9)
    last_seen: dict[str, float] = {}
    for r in requests:
        if r.session_id in last_seen:
            assert r.turn > 0 and r.think_time_s == pytest.approx(r.arrival_s - last_seen[r.session_id], abs=1e-9)
        else:
            assert r.turn == 0 and r.think_time_s == 0.0
        last_seen[r.session_id] = r.arrival_s


def test_closed_loop_representation():
    """arrival_s None; sessions contiguous with turns 0..n-1; turn 0 waits for nothing."""
    a = build_workload(WorkloadSpec("long_chat", requests=60, scale=0.1, concurrency=3), TARGET)
    b = build_workload(WorkloadSpec("long_chat", requests=60, scale=0.1, time_scale=0.5), TARGET)
    assert a.closed_loop and a.concurrency == 3
    assert all(r.arrival_s is None for r in a.requests)
    order = [r.session_id for r in a.requests]
    sessions = list(dict.fromkeys(order))
    assert order == sorted(order, key=sessions.index)  # each session's turns are contiguous
    for session in sessions:
        turns = [r for r in a.requests if r.session_id == session]
        assert [r.turn for r in turns] == list(range(len(turns)))
        assert turns[0].think_time_s == 0.0
    assert any(r.think_time_s > 0 for r in a.requests)
    assert [r.think_time_s * 0.5 for r in a.requests] == pytest.approx([r.think_time_s for r in b.requests])


def test_offline_and_poisson_arrivals():
    offline = build_workload(WorkloadSpec("rag_long", requests=20, scale=0.1, arrival="offline"), TARGET)
    assert {r.arrival_s for r in offline.requests} == {0.0}
    poisson = build_workload(WorkloadSpec("burst", arrival="poisson", rate=50.0, duration_s=20.0), TARGET)
    arrivals = [r.arrival_s for r in poisson.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] < 20.0
    assert len(arrivals) / 20.0 == pytest.approx(50.0, rel=0.15)

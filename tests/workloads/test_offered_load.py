"""Open loop, `rate` R with `requests` N: N requests arrive over about N / R seconds, for session
workloads too (workloads/assemble.py session_start_rate), not after a ramp-up of first turns.

Tolerance: were the requests a Poisson process at rate R, the N-th arrival would be
Gamma(N, R)-distributed, mean N / R and standard deviation sqrt(N) / R; the tests allow
4 of those, N / R +- 4 * sqrt(N) / R. Later turns cluster with their session's first, which
widens the spread a little (over 20 seeds per case the deviation's spread was 0.8-1.3 of that
standard deviation, at most 3.1 of it); the seeds are fixed, so each case is deterministic.
Here the cases land within 1.4 standard deviations. Before the calibration (sessions at
R / mean turns) all but one case failed: rag_long's 200th request at 10/s came at 34.2 s
(10 standard deviations late), long_chat's at 58.0 s (27), and 60 s at 10/s held 368 and
175 requests instead of about 600.
"""

from __future__ import annotations

import math

import pytest

from workloads.assemble import session_start_rate
from workloads.registry import ModelTarget, WorkloadSpec, build_workload, workload_shape
from workloads.synth import RequestSkeleton

TARGET = ModelTarget(vocab_size=1000, max_model_len=10**6)


def tolerance(n: int, rate: float) -> float:
    return 4 * math.sqrt(n) / rate


@pytest.mark.parametrize("name", ["rag_long", "long_chat"])
@pytest.mark.parametrize(
    "n, rate, time_scale, seed",
    [(200, 10.0, 1.0, 0), (2000, 10.0, 1.0, 1), (100, 1.0, 1.0, 2), (500, 50.0, 1.0, 3), (300, 4.0, 0.1, 4)],
)
def test_the_first_n_requests_arrive_over_about_n_over_rate(name, n, rate, time_scale, seed):
    spec = WorkloadSpec(name, requests=n, rate=rate, arrival="poisson", time_scale=time_scale, scale=0.05, seed=seed)
    arrivals = [r.arrival_s for r in build_workload(spec, TARGET).requests]
    assert len(arrivals) == n
    assert max(arrivals) == pytest.approx(n / rate, abs=tolerance(n, rate))


@pytest.mark.parametrize("name", ["rag_long", "long_chat"])
def test_a_duration_holds_about_rate_times_duration_requests(name):
    spec = WorkloadSpec(name, duration_s=60.0, rate=10.0, arrival="poisson", scale=0.05, seed=5)
    count = len(build_workload(spec, TARGET).requests)
    assert count == pytest.approx(600, abs=4 * math.sqrt(600))


def test_the_start_rate_counts_each_turn_for_the_part_of_the_window_that_holds_it():
    """Two-turn sessions, the second 10 s after the first, window 20 s: a session started at t
    brings its first turn into [0, 20] for t < 20 and its second for t < 10, so 1.5 requests per
    session-start-per-window: sessions must start at rate / 1.5. A window far longer than the
    think times counts every turn (rate / mean turns); single-turn sessions start at the rate."""

    def session(think: float) -> list[RequestSkeleton]:
        return [RequestSkeleton(index=-1, input_tokens=1, output_tokens=1, session_id="s", turn=k,
                                think_time_s=think * k) for k in range(2)]

    two = [session(10.0)] * 400
    assert session_start_rate(lambda m: two[:m], 6.0, 20.0, 1.0, 2.0) == pytest.approx(6.0 / 1.5)
    assert session_start_rate(lambda m: two[:m], 6.0, 20.0, 0.5, 2.0) == pytest.approx(6.0 / 1.75)  # think x0.5
    assert session_start_rate(lambda m: two[:m], 6.0, 1e6, 1.0, 2.0) == pytest.approx(3.0, rel=1e-4)
    one = [[RequestSkeleton(index=-1, input_tokens=1, output_tokens=1)]] * 400
    assert session_start_rate(lambda m: one[:m], 2.566, 20.0, 1.0, 1.0) == 2.566  # exactly


@pytest.mark.parametrize("name", ["rag_long", "long_chat"])
def test_only_the_times_change_sessions_come_from_the_stream_in_order(name):
    spec = WorkloadSpec(name, requests=300, rate=10.0, arrival="poisson", scale=0.05, seed=7)
    workload = build_workload(spec, TARGET)
    again = build_workload(spec, TARGET)
    assert [(r.arrival_s, r.session_id, r.turn, r.prefix_blocks) for r in workload.requests] == [
        (r.arrival_s, r.session_id, r.turn, r.prefix_blocks) for r in again.requests
    ]  # deterministic for a seed
    stream = workload_shape(spec).sessions(300)
    by_id = {}
    while len(by_id) < 300:
        s = next(stream)
        by_id[s[0].session_id] = s
    for r in workload.requests:  # every request is its stream turn: lengths and blocks as generated
        s = by_id[r.session_id][r.turn]
        assert (r.num_prompt_tokens, r.max_new_tokens, r.prefix_blocks) == (s.input_tokens, s.output_tokens, s.blocks)
    firsts = sorted(int(r.session_id.rpartition("s")[2]) for r in workload.requests if r.turn == 0)
    assert firsts == list(range(len(firsts)))  # sessions start in stream order, none skipped
    for r in workload.requests:  # no turn without the turns before it
        assert r.turn == 0 or any(q.session_id == r.session_id and q.turn == r.turn - 1 for q in workload.requests)


def test_closed_loop_and_offline_do_not_depend_on_the_rate():
    for arrival in ("closed", "offline"):
        plain = build_workload(WorkloadSpec("long_chat", requests=50, arrival=arrival, scale=0.05), TARGET)
        rated = build_workload(WorkloadSpec("long_chat", requests=50, arrival=arrival, rate=10.0, scale=0.05), TARGET)
        assert [(r.arrival_s, r.think_time_s, r.session_id, r.turn) for r in plain.requests] == [
            (r.arrival_s, r.think_time_s, r.session_id, r.turn) for r in rated.requests
        ]

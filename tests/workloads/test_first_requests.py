"""`requests` N keeps the first N requests by arrival (workloads/assemble.py), not whole
sessions whose later turns come minutes later; the notes name the sessions cut short.

Oracles: the session stream and the session-start process re-derived here (sessions start
at workloads.assemble.session_start_rate, calibrated so that `rate` requests a second arrive
in the first N / rate seconds: tests/workloads/test_offered_load.py checks that; each later
turn think_time_s after the previous), a trace file the test writes, and an end-to-end run
with the dummy engine.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from workloads.assemble import session_start_rate
from workloads.fitted import RAG_TURNS_PMF, pmf_mean
from workloads.registry import ModelTarget, WorkloadSpec, build_workload, workload_shape

TARGET = ModelTarget(vocab_size=1000, max_model_len=10**6)


def planned_arrivals(spec: WorkloadSpec, hint: int, sessions: int):
    """(arrival, session id, turn) of every turn of the first `sessions` sessions, by arrival."""
    stream = workload_shape(spec).sessions(hint)
    head = [next(stream) for _ in range(sessions)]
    rate = session_start_rate(lambda m: head[:m], spec.rate, spec.requests / spec.rate, spec.time_scale,
                              pmf_mean(RAG_TURNS_PMF))
    stream = iter(head)
    starts = np.cumsum(np.random.default_rng([spec.seed, 1]).exponential(1.0 / rate, size=sessions))
    rows = []
    for k, start in zip(range(sessions), starts):
        clock = float(start)
        for s in next(stream):
            clock += s.think_time_s * spec.time_scale if s.turn else 0.0
            rows.append((clock, k, s.session_id, s.turn))
    rows.sort(key=lambda r: (r[0], r[1]))
    return rows


@pytest.mark.parametrize("rate, n, time_scale", [(10.0, 200, 1.0), (1.0, 150, 1.0), (4.0, 300, 0.1)])
def test_rag_long_keeps_the_first_n_requests_by_arrival(rate, n, time_scale):
    spec = WorkloadSpec("rag_long", requests=n, rate=rate, time_scale=time_scale, scale=0.1, seed=3)
    workload = build_workload(spec, TARGET)
    want = planned_arrivals(spec, n, sessions=3 * n)[:n]  # 3n sessions reach far past the n-th arrival
    got = [(r.arrival_s, r.session_id, r.turn) for r in workload.requests]
    assert [g[1:] for g in got] == [w[2:] for w in want]
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-9)
    # about n / rate seconds (the start rate is calibrated for it; test_offered_load.py is tighter)
    assert got[-1][0] < 3 * n / rate


def test_the_notes_name_the_sessions_cut_short():
    spec = WorkloadSpec("rag_long", requests=200, rate=10.0, scale=0.1)
    workload = build_workload(spec, TARGET)
    everything = planned_arrivals(spec, 200, sessions=600)
    kept = {(sid, turn) for _, _, sid, turn in everything[:200]}
    kept_sessions = {sid for sid, _ in kept}
    turns: dict[str, int] = {}
    for _, _, sid, _ in everything:
        turns[sid] = turns.get(sid, 0) + 1
    cut = sorted((sid for sid in kept_sessions if sum(s == sid for s, _ in kept) < turns[sid]),
                 key=lambda sid: int(sid.rpartition("s")[2]))
    assert cut  # later turns of some sessions come after the 200th request
    (note,) = [n for n in workload.notes if "cut short" in n]
    assert f"kept the first 200 requests by arrival (requests=200); {len(cut)} sessions cut short" in note
    named = re.findall(r"(rag_long-s\d+) \((\d+) of (\d+) turns\)", note)
    assert [sid for sid, _, _ in named] == cut[:10]
    for sid, have, total in named:
        assert int(have) == sum(s == sid for s, _ in kept) and int(total) == turns[sid]
    assert f"and {len(cut) - 10} more" in note


def test_single_request_sessions_are_the_first_n_of_the_process():
    """burst: gamma arrivals, one request a session: exactly the process's first n times."""
    from workloads.arrivals import open_loop_times
    from workloads.fitted import BURST_BURSTINESS, BURST_RATE

    workload = build_workload(WorkloadSpec("burst", requests=500, seed=2), TARGET)
    want = open_loop_times(BURST_RATE, BURST_BURSTINESS, 2, n=500)
    assert [r.arrival_s for r in workload.requests] == pytest.approx(want.tolist(), abs=1e-9)
    assert not [n for n in workload.notes if "cut short" in n]


def test_a_session_trace_replays_its_first_n_rows_by_time(tmp_path):
    """Session "a" starts first but its later turns come last: they are not in the first 4."""
    rows = [
        {"arrival_s": 0.0, "input_tokens": 10, "output_tokens": 2, "session_id": "a"},
        {"arrival_s": 1.0, "input_tokens": 11, "output_tokens": 2, "session_id": "b"},
        {"arrival_s": 2.0, "input_tokens": 12, "output_tokens": 2, "session_id": "c"},
        {"arrival_s": 3.0, "input_tokens": 13, "output_tokens": 2, "session_id": "b"},
        {"arrival_s": 50.0, "input_tokens": 14, "output_tokens": 2, "session_id": "a"},
        {"arrival_s": 90.0, "input_tokens": 15, "output_tokens": 2, "session_id": "a"},
    ]
    path = tmp_path / "t.jsonl"
    header = {"pwbench_trace": 1, "block_tokens": 512, "has_sessions": True}
    path.write_text("".join(json.dumps(r) + "\n" for r in [header, *rows]))
    workload = build_workload(WorkloadSpec(f"trace:{path}", requests=4), TARGET)
    assert [(r.arrival_s, r.num_prompt_tokens, r.session_id) for r in workload.requests] == [
        (r["arrival_s"], r["input_tokens"], r["session_id"]) for r in rows[:4]
    ]
    (note,) = [n for n in workload.notes if "cut short" in n]
    assert "1 session cut short" in note and "a (1 of 3 turns)" in note


def test_end_to_end_the_run_sends_its_requests_in_about_n_over_rate(tmp_path):
    """pwbench run's library path with the dummy engine: 120 requests at 40 req/s, think times x0.1."""
    from harness.run import RunArgs, execute

    spec = WorkloadSpec("rag_long", requests=120, rate=40.0, time_scale=0.1, scale=0.05)
    planned = build_workload(spec, ModelTarget(32000, 1 << 20, (2,)))
    last = max(r.arrival_s for r in planned.requests)
    assert last < 3 * 120 / 40.0
    folder, run = execute(RunArgs(workload=spec, engine="dummy", output=str(tmp_path / "run"), warmup=0,
                                  quality=False, telemetry_hz=1.0))
    assert run["status"] == "complete" and run["workload"]["requests"] == 120
    import pandas as pd

    requests = pd.read_parquet(folder / "requests.parquet")
    assert len(requests) == 120 and requests["finish_s"].notna().all()
    # First turns are due at their planned time; a later (dependent) turn not before it, and not
    # before its session's previous answer
    planned_at = {r.request_id: r.arrival_s for r in planned.requests}
    due = dict(zip(requests["request_id"], requests["arrival_s"]))
    firsts = [r.request_id for r in planned.requests if r.after_previous_s is None]
    assert [due[i] for i in firsts] == pytest.approx([planned_at[i] for i in firsts], abs=1e-9)
    assert all(due[i] >= planned_at[i] - 1e-9 for i in due)
    assert requests["sent_s"].max() < last + 1.0  # sent when due, not stretched out
    assert any("cut short" in n for n in run["workload"]["notes"])

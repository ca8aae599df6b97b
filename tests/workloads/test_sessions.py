"""Session traces without block ids, as they happened: inferred prefix reuse (turn k+1 begins with
turn k's prompt and answer), dependent turns in open-loop replay, session-relative arrival columns.

The traces are written here (no block ids; each later turn's input = the previous input + output +
new tokens); the expected numbers are computed by hand from those lengths.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from workloads.registry import ModelTarget, WorkloadSpec, build_workload
from workloads.reuse import repeated_prefix_tokens

TARGET = ModelTarget(vocab_size=1000, max_model_len=1 << 16, special_ids=(0, 1, 2))
MAP = "arrival_s=t,input_tokens=in,output_tokens=out,session_id=sid"


def session_rows(sessions: int, first: int, output: int, new: int, turns: int, gap_s: float, start_gap_s: float,
                 relative: bool = False) -> list[dict]:
    """Sessions whose turn k+1 holds turn k's input + output + `new` tokens."""
    rows = []
    for s in range(sessions):
        inp = first
        for t in range(turns):
            at = t * gap_s + (0.0 if relative else s * start_gap_s)
            rows.append({"t": at, "sid": f"s{s}", "in": inp, "out": output, "start": s * start_gap_s})
            inp += output + new
    return rows


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build(path, **options):
    return build_workload(WorkloadSpec(f"trace:{path}", trace_map=options.pop("trace_map", MAP), **options), TARGET)


def by_session(requests):
    out: dict[str, list] = {}
    for r in requests:
        out.setdefault(r.session_id, []).append(r)
    return out


def test_later_turns_begin_with_the_previous_prompt_and_answer(tmp_path):
    path = write(tmp_path / "s.jsonl", session_rows(3, first=40, output=10, new=7, turns=3, gap_s=5, start_gap_s=1))
    workload = build(path)
    sessions = by_session(workload.requests)
    assert len(sessions) == 3
    for turns in sessions.values():
        prompts = [tuple(r.prompt_ids) for r in turns]
        assert [len(p) for p in prompts] == [40, 57, 74]
        assert prompts[1][:40] == prompts[0] and prompts[2][:57] == prompts[1]
        # the answer of turn 0 (tokens 40-49 of turn 1) is the same in turn 2, and not the new tokens
        assert prompts[2][40:50] == prompts[1][40:50] and prompts[1][40:50] != prompts[1][50:57]
    # the three sessions share nothing: each session's first prompt is its own
    assert len({tuple(t[0].prompt_ids) for t in sessions.values()}) == 3
    # by hand: per session, turn 1 repeats turn 0's 40 prompt tokens, turn 2 turn 1's 57, of 40 + 57 + 74
    # (the answer blocks first appear in the turn after: no earlier prompt held them)
    assert repeated_prefix_tokens(workload.requests) == (3 * (40 + 57), 3 * 171)
    (note,) = [n for n in workload.notes if n.startswith("session reuse inferred")]
    assert "6 of 6 later turns" in note
    assert f"{(40 + 57) / 171:.1%} of prompt tokens repeat the previous prompt" in note
    assert f"{20 / 171:.1%} are the previous answer" in note


def test_a_turn_that_does_not_hold_the_previous_one_starts_fresh(tmp_path):
    rows = [{"t": 0, "sid": "a", "in": 50, "out": 10}, {"t": 1, "sid": "a", "in": 59, "out": 10},  # 59 < 60
            {"t": 2, "sid": "a", "in": 80, "out": 5}]  # 80 >= 59 + 10
    workload = build(write(tmp_path / "t.jsonl", rows))
    prompts = [tuple(r.prompt_ids) for r in workload.requests]
    assert prompts[1][:10] != prompts[0][:10]
    assert prompts[2][:59] == prompts[1]
    (note,) = [n for n in workload.notes if n.startswith("session reuse inferred")]
    assert "1 of 2 later turns" in note


def test_session_reuse_none_gives_fresh_tokens_and_says_so(tmp_path):
    path = write(tmp_path / "s.jsonl", session_rows(2, first=40, output=10, new=7, turns=3, gap_s=5, start_gap_s=1))
    workload = build(path, session_reuse="none")
    assert repeated_prefix_tokens(workload.requests)[0] == 0
    assert any("--session-reuse none" in n and "0% prefix reuse" in n for n in workload.notes)


def test_trace_info_reports_the_inferred_reuse(tmp_path, trace_cli):
    path = write(tmp_path / "s.jsonl", session_rows(2, first=40, output=10, new=7, turns=3, gap_s=5, start_gap_s=1))
    proc = trace_cli("info", path, "--map", MAP, "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.splitlines()[-1])
    assert (info["later_turns"], info["extending_turns"]) == (4, 4)
    assert info["inferred_reuse_share"] == pytest.approx(2 * (40 + 57) / (2 * 171))
    assert info["inferred_answer_share"] == pytest.approx(2 * 20 / (2 * 171))
    assert info["session_relative"] is False
    text = trace_cli("info", path, "--map", MAP).stdout
    assert "session reuse" in text and "4 of 4 later turns" in text


def test_session_relative_arrivals_are_detected_and_spread(tmp_path):
    rows = session_rows(5, first=20, output=5, new=3, turns=3, gap_s=2, start_gap_s=7, relative=True)
    workload = build(write(tmp_path / "r.jsonl", rows))
    (note,) = [n for n in workload.notes if n.startswith("session-relative arrival times")]
    assert "all 5 sessions" in note and "Poisson process" in note
    starts = sorted(t[0].arrival_s for t in by_session(workload.requests).values())
    assert starts[0] == 0.0 and len(set(starts)) == 5  # no longer all at once
    for turns in by_session(workload.requests).values():  # within a session, the trace's own gaps
        assert [r.arrival_s - turns[0].arrival_s for r in turns] == pytest.approx([0, 2, 4])


def test_a_session_start_column_places_the_sessions(tmp_path):
    rows = session_rows(3, first=20, output=5, new=3, turns=2, gap_s=2, start_gap_s=7, relative=True)
    workload = build(write(tmp_path / "r.jsonl", rows), trace_map=MAP + ",session_start_s=start")
    assert any("session_start_s column" in n for n in workload.notes)
    # by hand: session s starts at 7 s, its turns 2 s apart
    assert sorted(r.arrival_s for r in workload.requests) == pytest.approx([0, 2, 7, 9, 14, 16])


def test_absolute_arrivals_are_not_taken_for_session_relative(tmp_path):
    rows = session_rows(3, first=20, output=5, new=3, turns=2, gap_s=2, start_gap_s=7)
    workload = build(write(tmp_path / "a.jsonl", rows))
    assert not any("session-relative" in n for n in workload.notes)
    assert sorted(r.arrival_s for r in workload.requests) == pytest.approx([0, 2, 7, 9, 14, 16])


def _run(tmp_path, spec: WorkloadSpec, engine: str, **engine_options):
    from harness.run import RunArgs, execute

    folder, run = execute(RunArgs(workload=spec, engine=engine, output=str(tmp_path / "run"), warmup=0,
                                  quality=False, telemetry_hz=1.0, engine_options=engine_options))
    return run, pd.read_parquet(folder / "requests.parquet")


def _sent_before_previous_finished(requests: pd.DataFrame) -> int:
    early = 0
    for _, turns in requests.sort_values("turn").groupby("session_id"):
        finish, sent = turns["finish_s"].tolist(), turns["sent_s"].tolist()
        early += sum(sent[k + 1] < finish[k] for k in range(len(turns) - 1))
    return early


def test_dependent_turns_wait_for_the_previous_answer(tmp_path):
    """Turns 1 ms apart in the trace, each request ~50 ms on the dummy engine: replayed as
    independent turns, later turns go out before their predecessor ends; dependent, never."""
    path = write(tmp_path / "s.jsonl", session_rows(3, first=20, output=10, new=3, turns=4, gap_s=0.001,
                                                    start_gap_s=0.002))
    timing = {"base_ms": 1.0, "decode_ms_per_token": 5.0}
    run, requests = _run(tmp_path / "dep", WorkloadSpec(f"trace:{path}", trace_map=MAP), "dummy", **timing)
    assert run["status"] == "complete" and requests["finish_s"].notna().all()
    assert _sent_before_previous_finished(requests) == 0
    assert any(n.startswith("dependent turns") for n in run["workload"]["notes"])
    assert run["config"]["workload"]["turns"] is None  # the default, dependent
    _, independent = _run(tmp_path / "ind", WorkloadSpec(f"trace:{path}", trace_map=MAP, turns="independent"),
                          "dummy", **timing)
    assert _sent_before_previous_finished(independent) > 0


def test_replay_on_moe_hits_the_inferred_reuse(tmp_path):
    """The bundled demo model on engine moe (KV blocks of 16 tokens): the prefix-cache hit rate is
    at least the inferred reuse of previous prompts minus one block per extending turn."""
    block = 16
    rows = session_rows(2, first=120, output=8, new=24, turns=3, gap_s=0.01, start_gap_s=0.005)
    path = write(tmp_path / "s.jsonl", rows)
    run, requests = _run(tmp_path, WorkloadSpec(f"trace:{path}", trace_map=MAP), "moe", block_size=block)
    assert run["status"] == "complete" and requests["finish_s"].notna().all()
    assert _sent_before_previous_finished(requests) == 0
    prompts = [r["in"] for r in rows]  # 120, 152, 184 per session
    reused = 2 * (120 + 152)  # each later turn repeats the previous prompt
    extending = 4
    bound = (reused - block * extending) / sum(prompts)
    assert run["summary"]["engine"]["prefix_cache_hit_rate"] >= bound


def test_session_relative_under_an_arrival_process_says_the_process_places_them(tmp_path):
    rows = session_rows(4, first=20, output=5, new=3, turns=2, gap_s=2, start_gap_s=7, relative=True)
    workload = build(write(tmp_path / "r.jsonl", rows), arrival="poisson", rate=2.0)
    (note,) = [n for n in workload.notes if n.startswith("session-relative arrival times")]
    assert "--arrival poisson starts the sessions" in note
    for turns in by_session(workload.requests).values():
        assert turns[1].arrival_s - turns[0].arrival_s == pytest.approx(2.0)

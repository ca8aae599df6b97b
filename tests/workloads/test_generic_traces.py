"""Traces in the user's own layout (workloads/traces/generic.py, `--format jsonl|csv --map`) and
format detection that no longer takes every JSONL line with a `session_id` for RAGPulse.

Files are written by the tests; the oracles are the values the tests wrote (times converted
and shifted here by hand, lengths, sessions), read back through `pwbench trace info|convert`
in a fresh interpreter, the workload a replay builds, and a dummy-engine run.
"""

from __future__ import annotations

import datetime
import json
import random

import pytest

from workloads.base import WorkloadError
from workloads.registry import ModelTarget, WorkloadSpec, build_workload
from workloads.traces.formats import list_formats, read_trace

TARGET = ModelTarget(vocab_size=1000, max_model_len=10**6)
KNOWN = [name for name, _ in list_formats()]
MAP = "arrival_s=start_time_s,input_tokens=input_tokens,output_tokens=output_tokens,session_id=session_id"


def one_error(proc) -> str:
    """Exit 2 and exactly one `error:` line on stderr, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.removesuffix("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def agentic_rows(n: int = 40, seed: int = 0) -> list[dict]:
    """An agentic-coding-like log: Unix-time starts, 30k-160k-token prompts, sessions, extra keys."""
    rng = random.Random(seed)
    t = 1_726_000_000.0
    rows = []
    for i in range(n):
        t += rng.choice([0.125, 0.5, 3.25, 10.0])  # distinct times: no tie for the order to break
        rows.append({
            "request_uuid": f"req-{i}", "start_time_s": t, "input_tokens": rng.randint(30_000, 160_000),
            "output_tokens": rng.randint(1, 900), "session_id": f"agent-{rng.randint(0, 5)}", "model": "x",
        })
    rng.shuffle(rows)  # logs are not always in time order
    return rows


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# -- detection ---------------------------------------------------------------------------------
@pytest.mark.parametrize("first", [
    {"start_time_s": 1.5, "input_tokens": 10, "output_tokens": 2, "session_id": "s"},  # once taken for RAGPulse
    {"ts": 1, "prompt": 5},
])
def test_unknown_jsonl_is_one_error_naming_formats_and_keys(trace_cli, tmp_path, first):
    path = tmp_path / "mine.jsonl"
    write_jsonl(path, [first, first])
    line = one_error(trace_cli("info", path))
    assert str(path) in line and "unknown trace format" in line and "side table" not in line
    assert all(name in line for name in KNOWN)
    assert all(key in line for key in first)  # the keys it saw
    assert "--format jsonl --map" in line and "pwbench JSONL" in line
    with pytest.raises(WorkloadError, match="unknown trace format"):
        build_workload(WorkloadSpec(f"trace:{path}"), TARGET)


def test_unknown_csv_names_its_columns(trace_cli, tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("when,prompt_len,completion_len\n0,10,2\n")
    line = one_error(trace_cli("info", path))
    assert all(name in line for name in KNOWN) and "when, prompt_len, completion_len" in line
    assert "--format csv --map" in line


def test_ragpulse_and_mooncake_are_still_detected(tmp_path):
    path = tmp_path / "m.jsonl"
    write_jsonl(path,
                [{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2], "session_id": "x"}])
    assert read_trace(path).format == "mooncake"  # a session_id key no longer means RAGPulse


# -- the generic reader ----------------------------------------------------------------------------
def test_named_jsonl_columns_replay_with_the_written_times_and_lengths(trace_cli, tmp_path):
    rows = agentic_rows()
    path = tmp_path / "agentic.jsonl"
    write_jsonl(path, rows)
    by_time = sorted(rows, key=lambda r: r["start_time_s"])
    t0 = by_time[0]["start_time_s"]

    workload = build_workload(WorkloadSpec(f"trace:{path}", trace_format="jsonl", trace_map=MAP, time_scale=0.5),
                              TARGET)
    got = [(r.arrival_s, r.num_prompt_tokens, r.max_new_tokens, r.session_id) for r in workload.requests]
    want = [((r["start_time_s"] - t0) * 0.5, r["input_tokens"], r["output_tokens"], r["session_id"]) for r in by_time]
    assert [g[1:] for g in got] == [w[1:] for w in want]
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-6)
    last: dict[str, float] = {}
    for r in workload.requests:  # think time = gap to the session's previous request, turns in order
        assert r.think_time_s == pytest.approx(r.arrival_s - last.get(r.session_id, r.arrival_s), abs=1e-6)
        last[r.session_id] = r.arrival_s

    info = trace_cli("info", path, "--format", "jsonl", "--map", MAP, "--json")
    assert info.returncode == 0, info.stderr
    summary = json.loads(info.stdout.splitlines()[-1])
    assert summary["format"] == "jsonl" and summary["requests"] == len(rows)
    assert summary["duration_s"] == pytest.approx(by_time[-1]["start_time_s"] - t0, abs=1e-6)
    assert summary["sessions"] == len({r["session_id"] for r in rows})
    assert summary["input_tokens_max"] == max(r["input_tokens"] for r in rows)

    out = tmp_path / "agentic.pwbench.jsonl"
    converted = trace_cli("convert", path, "--map", MAP, "-o", out)  # --map alone: jsonl from the content
    assert converted.returncode == 0, converted.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["source_format"] == "jsonl" and lines[0]["has_sessions"] is True
    assert [(x["input_tokens"], x["output_tokens"], x["session_id"]) for x in lines[1:]] == [w[1:] for w in want]
    assert [x["arrival_s"] for x in lines[1:]] == pytest.approx([w[0] / 0.5 for w in want], abs=1e-6)


def test_milliseconds_relative_and_absolute_give_the_same_replay(tmp_path):
    rows = [(0, 100, 5), (250, 120, 6), (1250, 90, 7), (1250, 80, 1)]
    absolute, relative = tmp_path / "abs.jsonl", tmp_path / "rel.jsonl"
    write_jsonl(absolute, [{"t": 1_726_000_000_000 + t, "in": i, "out": o} for t, i, o in rows])
    write_jsonl(relative, [{"t": t + 40, "in": i, "out": o} for t, i, o in rows])
    columns = "arrival_s=t,input_tokens=in,output_tokens=out,time_unit=ms"
    for path in (absolute, relative):
        trace = read_trace(path, "jsonl", columns=columns)
        got = [(r.arrival_s, r.input_tokens, r.output_tokens) for r in trace.rows]
        assert got == [(t / 1000, i, o) for t, i, o in rows]
        assert not trace.has_sessions


def test_csv_with_iso_date_times_and_nested_names(tmp_path):
    stamps = ["2024-05-01T23:59:59.5Z", "2024-05-02T00:00:01.25Z", "2024-05-02 01:00:03+02:00"]
    path = tmp_path / "log.csv"
    path.write_text("Started At,Prompt Tokens,Completion,user\n" + "".join(
        f"{s},{100 + i},{i + 1},u{i % 2}\n" for i, s in enumerate(stamps)))
    columns = "arrival_s=started at,input_tokens=Prompt Tokens,output_tokens=Completion,session_id=user"
    trace = read_trace(path, "csv", columns=columns)  # 'started at': matched case-insensitively
    utc = [datetime.datetime.fromisoformat(s.replace("Z", "+00:00")).astimezone(datetime.timezone.utc) for s in stamps]
    want = sorted((u - min(utc)).total_seconds() for u in utc)
    assert [r.arrival_s for r in trace.rows] == pytest.approx(want, abs=1e-9)
    assert [r.input_tokens for r in trace.rows] == [102, 100, 101]  # 01:00:03+02:00 is 23:00:03 UTC: first
    assert [r.session_id for r in trace.rows] == ["u0", "u0", "u1"]

    nested = tmp_path / "nested.jsonl"
    write_jsonl(nested, [{"t": 3, "usage": {"prompt_tokens": 40, "completion_tokens": 4}, "blocks": [7]},
                         {"t": 1, "usage": {"prompt_tokens": 600, "completion_tokens": 2}, "blocks": [7, 8]}])
    trace = read_trace(nested, "jsonl", columns="arrival_s=t,input_tokens=usage.prompt_tokens,"
                                                 "output_tokens=usage.completion_tokens,blocks=blocks")
    assert [(r.arrival_s, r.input_tokens, r.output_tokens, r.blocks) for r in trace.rows] == [
        (0.0, 600, 2, (7, 8)), (2.0, 40, 4, (7,))]


def test_without_times_a_replay_needs_an_arrival_process(tmp_path):
    path = tmp_path / "lengths.jsonl"
    write_jsonl(path, [{"p": 10 + i, "o": 3} for i in range(5)])
    spec = dict(trace_format="jsonl", trace_map="input_tokens=p,output_tokens=o")
    with pytest.raises(WorkloadError, match="no arrival times"):
        build_workload(WorkloadSpec(f"trace:{path}", **spec), TARGET)
    offline = build_workload(WorkloadSpec(f"trace:{path}", arrival="offline", **spec), TARGET)
    assert [r.num_prompt_tokens for r in offline.requests] == [10, 11, 12, 13, 14]


# -- bad maps and bad lines ------------------------------------------------------------------------
def test_a_mapped_column_that_is_missing_names_it_and_the_columns_present(trace_cli, tmp_path):
    path = tmp_path / "a.jsonl"
    write_jsonl(path, agentic_rows(3))
    line = one_error(trace_cli("info", path, "--format", "jsonl", "--map", MAP.replace("=input_tokens", "=prompt_len")))
    assert f"{path}:1:" in line and "input_tokens=prompt_len" in line and "'prompt_len'" in line
    assert all(key in line for key in agentic_rows(1)[0])  # the keys that are there
    csv_path = tmp_path / "a.csv"
    csv_path.write_text("ts,in,out\n1,2,3\n")
    line = one_error(trace_cli("info", csv_path, "--format", "csv", "--map",
                               "arrival_s=time,input_tokens=in,output_tokens=out"))
    assert f"{csv_path}:1:" in line and "arrival_s=time" in line and "ts, in, out" in line


@pytest.mark.parametrize("columns, needle", [
    ("arrival_s=t,input_tokens=p", "needs output_tokens=COLUMN"),
    ("arrival_s=t,input_tokens=p,output_tokens=o,colour=c", "unknown field 'colour'"),
    ("arrival_s=t,input_tokens,output_tokens=o", "'input_tokens' is not FIELD=COLUMN"),
    ("input_tokens=p,output_tokens=o,time_unit=fortnights", "time_unit 'fortnights'"),
])
def test_a_bad_map_is_one_error_with_the_fix(trace_cli, tmp_path, columns, needle):
    path = tmp_path / "a.jsonl"
    write_jsonl(path, [{"t": 1, "p": 2, "o": 3}])
    line = one_error(trace_cli("info", path, "--format", "jsonl", "--map", columns))
    assert needle in line and "--map arrival_s=COLUMN,input_tokens=COLUMN,output_tokens=COLUMN" in line
    with pytest.raises(WorkloadError, match=needle):  # `pwbench run` checks it before loading an engine
        WorkloadSpec(f"trace:{path}", trace_format="jsonl", trace_map=columns)


def test_format_and_map_must_agree(trace_cli, tmp_path):
    path = tmp_path / "a.jsonl"
    write_jsonl(path, [{"t": 1, "p": 2, "o": 3}])
    assert "needs --map" in one_error(trace_cli("info", path, "--format", "jsonl"))
    assert "fixed columns" in one_error(trace_cli("info", path, "--format", "mooncake", "--map",
                                                  "input_tokens=p,output_tokens=o"))
    with pytest.raises(WorkloadError, match="trace:PATH"):
        WorkloadSpec("rag_long", trace_map="input_tokens=p,output_tokens=o")


def test_a_bad_line_names_path_line_and_field_and_can_be_skipped(trace_cli, tmp_path):
    path = tmp_path / "a.jsonl"
    write_jsonl(path,
                [{"t": 1, "p": 20, "o": 3}, {"t": 2, "o": 3}, {"t": "soon", "p": 5, "o": 1}, {"t": 4, "p": 9, "o": 1}])
    columns = "arrival_s=t,input_tokens=p,output_tokens=o"
    line = one_error(trace_cli("info", path, "--map", columns))
    assert line.startswith(f"error: {path}:2: missing field 'p'")
    proc = trace_cli("info", path, "--map", columns, "--skip-bad-lines", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["bad_lines_skipped"] == 2
    assert [m.split(": ")[0] for m in proc.stderr.splitlines()] == [f"skipped {path}:2", f"skipped {path}:3"]
    mixed = tmp_path / "mixed.jsonl"
    write_jsonl(mixed, [{"t": 1, "p": 2, "o": 3}, {"t": "2024-05-01T00:00:00Z", "p": 2, "o": 3}])
    assert "use one kind of time" in one_error(trace_cli("info", mixed, "--map", columns))


def test_a_named_jsonl_trace_runs_end_to_end_with_the_dummy_engine(tmp_path):
    """The library side of `pwbench run --workload trace:FILE --format jsonl --map ...`."""
    import pandas as pd

    from harness.run import RunArgs, execute

    rows = [{"start_time_s": 1_726_000_000 + 0.05 * i, "input_tokens": 50 + i, "output_tokens": 1 + i % 3,
             "session_id": f"s{i % 4}"} for i in range(12)]
    path = tmp_path / "mine.jsonl"
    write_jsonl(path, rows)
    spec = WorkloadSpec(f"trace:{path}", trace_format="jsonl", trace_map=MAP)
    folder, run = execute(RunArgs(workload=spec, engine="dummy", output=str(tmp_path / "run"), warmup=0,
                                  quality=False, telemetry_hz=1.0))
    assert run["status"] == "complete" and run["config"]["workload"]["trace_map"] == MAP
    done = pd.read_parquet(folder / "requests.parquet").sort_values("arrival_s")
    assert done["arrival_s"].tolist() == pytest.approx([0.05 * i for i in range(12)], abs=1e-6)
    assert done["prompt_tokens"].tolist() == [r["input_tokens"] for r in rows]
    assert done["output_tokens"].tolist() == [r["output_tokens"] for r in rows]

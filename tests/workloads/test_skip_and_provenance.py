"""What a run and a converted file keep of a trace's bad lines and column map: `pwbench run
--skip-bad-lines` records the count, the first reasons and the --map in run.json; `trace convert`
writes them into the converted file's header, and reading that file says where it came from.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from workloads.registry import WorkloadSpec

REPO = Path(__file__).resolve().parents[2]
MAP = "arrival_s=t,input_tokens=in,output_tokens=out,session_id=sid"
ROWS = [
    '{"t": 0.0, "sid": "a", "in": 30, "out": 4}',
    "not json at all",
    '{"t": 0.01, "sid": "b", "in": 20, "out": 4}',
    '{"t": 0.02, "sid": "a", "in": -5, "out": 4}',
    '{"t": 0.03, "sid": "a", "in": 40, "out": 4}',
]


def write_trace(tmp_path: Path) -> Path:
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(ROWS) + "\n")
    return path


def test_a_run_records_skipped_lines_and_the_map(tmp_path):
    from harness.run import RunArgs, execute

    path = write_trace(tmp_path)
    spec = WorkloadSpec(f"trace:{path}", trace_map=MAP, skip_bad_lines=True)
    _, run = execute(RunArgs(workload=spec, engine="dummy", output=str(tmp_path / "run"), warmup=0, quality=False,
                             telemetry_hz=1.0))
    assert run["status"] == "complete" and run["workload"]["requests"] == 3
    assert run["config"]["workload"]["trace_map"] == MAP and run["config"]["workload"]["skip_bad_lines"] is True
    (note,) = [n for n in run["workload"]["notes"] if "malformed lines skipped" in n]
    assert note.startswith("2 malformed lines skipped (--skip-bad-lines; first 2: ")
    assert f"{path}:2: not valid JSON" in note and f"{path}:4: in (input_tokens) is negative" in note


def test_pwbench_run_takes_skip_bad_lines(tmp_path):
    path = write_trace(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", "--workload", f"trace:{path}", "--map", MAP, "--skip-bad-lines",
         "--engine", "dummy", "--warmup", "0", "--no-quality", "--output", str(tmp_path / "run"), "--quiet"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert any(n.startswith("2 malformed lines skipped") for n in run["workload"]["notes"])


def test_converted_header_keeps_source_map_and_skip_count(tmp_path, trace_cli):
    path = write_trace(tmp_path)
    out = tmp_path / "converted.jsonl"
    proc = trace_cli("convert", path, "--map", MAP, "--skip-bad-lines", "--output", out)
    assert proc.returncode == 0, proc.stderr
    header = json.loads(out.read_text().splitlines()[0])
    assert header["source"] == "mine.jsonl" and header["source_format"] == "jsonl"
    assert header["map"] == MAP and header["skipped_lines"] == 2
    assert header["first_skipped"].startswith(f"{path}:2: not valid JSON")
    # reading the converted file says where it came from, in trace info and in a run's notes
    info = trace_cli("info", out)
    assert info.returncode == 0, info.stderr
    assert f"converted from mine.jsonl (jsonl) with --map {MAP}; 2 malformed lines skipped at conversion" in info.stdout
    from workloads.registry import ModelTarget, build_workload

    workload = build_workload(WorkloadSpec(f"trace:{out}"), ModelTarget(1000, 4096))
    assert any(n.startswith("converted from mine.jsonl (jsonl) with --map") for n in workload.notes)


def test_a_map_is_written_back_as_it_parses(tmp_path, trace_cli):
    path = write_trace(tmp_path)
    out = tmp_path / "converted.jsonl"
    given = "input_tokens=in,output_tokens=out,arrival_s=t,time_unit=ms"
    assert trace_cli("convert", path, "--map", given, "--skip-bad-lines", "--output", out).returncode == 0
    header = json.loads(out.read_text().splitlines()[0])
    from workloads.traces.generic import parse_map

    assert parse_map(header["map"]) == parse_map(given)

"""`pwbench sweep`: a grid from TOML, one folder per point, the report over the sweep folder;
interrupted with Ctrl-C, the rerun runs only the points that did not finish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from result_folders import pwbench
from typer.testing import CliRunner

from harness.cli import app

GRID = """workload = "offline_batch"
engines = ["dummy"]
rates = [50, 100, 200]
requests = 6
[set]
decode_ms_per_token = 15.0
"""


@pytest.mark.slow  # over a minute on 2 cores
def test_interrupted_sweep_resumes_only_missing_points(tmp_path):
    (tmp_path / "grid.toml").write_text(GRID)
    out = tmp_path / "sweep"
    args = [sys.executable, "-m", "harness.cli", "sweep", "--config", str(tmp_path / "grid.toml"), "--output", str(out),
            "--no-quality"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 240
    while not (out / "dummy-r50" / "run.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    done = sorted(p.parent.name for p in out.glob("*/run.json"))
    assert "dummy-r50" in done and len(done) < 3
    first = json.loads((out / "dummy-r50" / "run.json").read_text())["started_at_unix"]
    again = pwbench("sweep", "--config", str(tmp_path / "grid.toml"), "--output", str(out), "--no-quality")
    assert again.returncode == 0, again.stderr
    assert f"{3 - len(done)} points run, {len(done)} already complete" in again.stdout
    assert json.loads((out / "dummy-r50" / "run.json").read_text())["started_at_unix"] == first
    assert sorted(p.parent.name for p in out.glob("*/run.json")) == ["dummy-r100", "dummy-r200", "dummy-r50"]
    html = (out / "report.html").read_text()
    assert "goodput vs request rate (sweep)" in html and all(f"dummy-r{r}" in html for r in (50, 100, 200))


def test_bad_sweep_file_is_one_line(tmp_path):
    (tmp_path / "g.toml").write_text('engine = ["moe"]\n')
    proc = pwbench("sweep", "--config", str(tmp_path / "g.toml"), "--output", str(tmp_path / "s"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "g.toml: unknown key 'engine'" in proc.stderr


FAST_GRID = """workload = "offline_batch"
engines = ["dummy"]
requests = 4
[set]
decode_ms_per_token = 0.1
"""


def sweep(tmp_path, *args):
    """The CLI in-process (typer's CliRunner): one dummy point of 4 offline requests."""
    (tmp_path / "grid.toml").write_text(FAST_GRID)
    return CliRunner().invoke(app, ["sweep", "--config", str(tmp_path / "grid.toml"), "--output",
                                    str(tmp_path / "sweep"), "--no-quality", *map(str, args)])


def one_line(result) -> str:
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.exit_code, result.output)
    lines = result.stderr.removesuffix("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.stderr
    return lines[0]


def test_rerun_with_other_settings_is_refused_or_forced_elsewhere(tmp_path):
    out = tmp_path / "sweep"
    first = sweep(tmp_path)
    assert first.exit_code == 0, first.output
    assert "1 points run, 0 already complete" in first.stdout
    recorded = json.loads((out / "sweep.json").read_text())
    assert recorded["settings"]["workload"] == "offline_batch" and recorded["settings"]["requests"] == 4
    started = json.loads((out / "dummy" / "run.json").read_text())["started_at_unix"]
    for flags, says in ((["--workload", "rag_long"], "workload 'rag_long' (was 'offline_batch')"),
                        (["--requests", "5"], "requests 5 (was 4)"), (["--seed", "1"], "seed 1 (was 0)")):
        line = one_line(sweep(tmp_path, *flags))
        assert f"{out} holds a sweep of other settings: {says}" in line and "--force" in line, line
    again = sweep(tmp_path)
    assert again.exit_code == 0 and "0 points run, 1 already complete (dummy)" in again.stdout
    forced = sweep(tmp_path, "--seed", "1", "--force")
    assert forced.exit_code == 0, forced.output
    assert f"starting a new sweep in {tmp_path / 'sweep-2'}" in forced.stderr
    assert json.loads((tmp_path / "sweep-2" / "dummy" / "run.json").read_text())["config"]["workload"]["seed"] == 1
    assert json.loads((out / "dummy" / "run.json").read_text())["started_at_unix"] == started  # untouched
    assert f"report: {tmp_path / 'sweep-2' / 'report.html'}" in forced.stdout


def test_a_point_with_unreadable_files_is_run_again(tmp_path):
    out = tmp_path / "sweep"
    assert sweep(tmp_path).exit_code == 0
    (out / "dummy" / "steps.parquet").write_bytes(b"")
    again = sweep(tmp_path)
    assert again.exit_code == 0, again.output
    assert "1 points run, 0 already complete" in again.stdout
    assert f"sweep: dummy: {out / 'dummy' / 'steps.parquet'}: not a readable parquet file" in again.stderr
    assert pq.ParquetFile(out / "dummy" / "steps.parquet").metadata.num_rows > 0
    (out / "dummy" / "run.json").write_text('{"schema_version": 1, "status": 5}')
    assert "1 points run" in sweep(tmp_path).stdout


def test_a_sweep_folder_without_sweep_json_is_checked_point_by_point(tmp_path):
    """A sweep written before sweep.json existed: its points' own run.json say what they ran."""
    out = tmp_path / "sweep"
    assert sweep(tmp_path).exit_code == 0
    (out / "sweep.json").unlink()
    line = one_line(sweep(tmp_path, "--seed", "3"))
    assert "point dummy: seed 3 (was 0)" in line
    again = sweep(tmp_path)
    assert again.exit_code == 0 and "0 points run, 1 already complete" in again.stdout
    assert (out / "sweep.json").exists()


def test_an_output_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "sweep").write_text("not a folder")
    assert "cannot write the sweep folder" in one_line(sweep(tmp_path))


@pytest.mark.slow  # ~20 s on 2 busy cores: two sweeps and reports; `run --simulate` is in the default run
def test_simulated_sweep_on_a_preset(tmp_path):
    """--simulate and the grid's model reach every point: Mixtral-8x7B (a config-only preset) on a
    simulated H100; the point's run.json is marked simulated, sweep.json records both, and the
    same command again resumes (no point rerun)."""
    (tmp_path / "grid.toml").write_text('workload = "offline_batch"\nengines = ["offload"]\nbudgets = ["60GB"]\n'
                                        'requests = 2\nmodel = "mixtral-8x7b"\n')
    args = ["sweep", "--config", str(tmp_path / "grid.toml"), "--simulate", "h100-sxm", "--routing", "uniform",
            "--output", str(tmp_path / "sw")]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    settings = json.loads((tmp_path / "sw" / "sweep.json").read_text())["settings"]
    assert settings["model"] == "mixtral-8x7b" and settings["set"] == {"simulate": "h100-sxm", "routing": "uniform"}
    run = json.loads((tmp_path / "sw" / "offload-b60GB" / "run.json").read_text())
    assert run["simulated"]["hardware"] == "h100-sxm" and run["quality"] is None
    assert run["engine"]["device"] == "simulated h100-sxm" and run["summary"]["completed"] == 2
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "0 points run, 1 already complete" in again.stdout, again.output

"""`pwbench sweep`: a grid from TOML, one folder per point, the report over the sweep folder;
interrupted with Ctrl-C, the rerun runs only the points that did not finish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from result_folders import pwbench

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

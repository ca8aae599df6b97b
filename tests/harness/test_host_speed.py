"""harness.hw `host_speed`: the reference loop against the fastest this CPU ran it, kept in the cache
folder; and `python -m harness.bench.host_speed`, which prints it over time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from engines.common.peaks import cpu_model
from harness.hw import SPEED_FILE, host_speed


def test_first_probe_is_the_reference_and_only_a_faster_one_replaces_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    assert host_speed() == 1.0  # nothing stored: this probe is the fastest seen
    path = tmp_path / SPEED_FILE
    first = json.loads(path.read_text())[cpu_model()]
    assert 0 < first < 1.0
    # a stored time slower than any probe (10 s for a ~3 ms loop) is replaced by the probe's
    path.write_text(json.dumps({cpu_model(): 10.0, "other cpu": 5.0}))
    assert host_speed() == 1.0
    stored = json.loads(path.read_text())
    assert stored[cpu_model()] < 1.0 and stored["other cpu"] == 5.0
    # a stored time faster than any probe stays, and the speed is that time over the probe's
    path.write_text(json.dumps({cpu_model(): 1e-9}))
    speed = host_speed()
    assert 0 < speed < 1e-3
    assert json.loads(path.read_text()) == {cpu_model(): 1e-9}
    # without `record` nothing is written, even a faster time
    path.write_text(json.dumps({cpu_model(): 10.0}))
    assert host_speed(record=False) == 1.0
    assert json.loads(path.read_text()) == {cpu_model(): 10.0}


def test_a_corrupt_file_is_started_over(tmp_path, monkeypatch):
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    (tmp_path / SPEED_FILE).write_text("{not json")
    assert host_speed() == 1.0
    assert cpu_model() in json.loads((tmp_path / SPEED_FILE).read_text())


def test_the_benchmark_prints_every_probe_and_their_summary(tmp_path):
    out = subprocess.run([sys.executable, "-m", "harness.bench.host_speed", "--seconds", "0.5", "--every", "0.05"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PWBENCH_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    speeds = [float(v) for v in lines[0].removeprefix("speeds:").split()]
    assert speeds and all(0 < s <= 1.0 for s in speeds)
    assert lines[1].startswith(f"{len(speeds)} probes 0.05 s apart: min {min(speeds):.2f}")
    runs = lines[2].split(":", 1)[1].split()
    assert sum(int(r[1:]) for r in runs) == len(speeds)


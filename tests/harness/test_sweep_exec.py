"""`pwbench sweep --executor`: the local executor against the serial one on the dummy engine (the
same tokens cell by cell), measurement hygiene (measured CPU cells one at a time; measured GPU
cells one per GPU), a worker killed mid-cell, failed cells, --dry-run's commands, and the ray
executor without Ray installed. The Ray cluster tests: test_sweep_exec_ray.py (slow)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from harness.cli import app
from harness.sweep import load_grid, open_sweep, run_sweep
from harness.sweep_exec import CellOutcome, LocalExecutor, _Worker

# Deterministic tokens (a function of the prompt), measured (sleeping) latencies: a measured CPU cell.
GRID = """workload = "offline_batch"
engines = ["dummy"]
rates = [50, 100, 200]
requests = 3
[set]
decode_ms_per_token = "{ms}"
"""


def grid_file(tmp_path: Path, ms: float = 0.1, extra: str = "") -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(GRID.format(ms=ms) + extra)
    return path


def sweep(tmp_path: Path, out: str, *args: str):
    return CliRunner().invoke(app, ["sweep", "--config", str(tmp_path / "grid.toml"), "--output",
                                    str(tmp_path / out), "--no-quality", *args])


def cells(folder: Path) -> dict:
    return json.loads((folder / "sweep.json").read_text())["cells"]


def tokens(folder: Path) -> list:
    """The deterministic part of a cell's requests: ids, lengths and output token ids."""
    rows = pq.read_table(folder / "requests.parquet", columns=["request_id", "prompt_tokens", "output_ids"])
    return sorted(rows.to_pylist(), key=lambda r: r["request_id"])


def intervals_overlap(records: list[dict]) -> bool:
    spans = sorted((r["started_at_unix"], r["started_at_unix"] + r["wall_s"]) for r in records)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def test_local_executor_equals_serial_and_runs_measured_cpu_cells_one_at_a_time(tmp_path):
    grid = load_grid(grid_file(tmp_path), options={})
    serial = run_sweep(grid, open_sweep(grid, tmp_path / "serial", quality=False), quality=False, say=print)
    assert len(serial.ran) == 3 and not serial.failed
    local = sweep(tmp_path, "local", "--executor", "local", "--workers", "2")
    assert local.exit_code == 0, local.output
    assert "3 points run, 0 already complete" in local.stdout and (tmp_path / "local" / "report.html").is_file()
    names = ["dummy-r50", "dummy-r100", "dummy-r200"]
    for name in names:
        assert tokens(tmp_path / "local" / name) == tokens(tmp_path / "serial" / name)
        assert len(tokens(tmp_path / "local" / name)) == 3
    recorded = cells(tmp_path / "local")
    assert sorted(recorded) == sorted(names)
    assert {r["executor"] for r in recorded.values()} == {"local"} and cells(tmp_path / "serial")[names[0]][
        "executor"] == "serial"
    assert all(r["status"] == "complete" and r["where"]["host"] and r["where"]["pid"] != os.getpid()
               for r in recorded.values())
    assert not intervals_overlap(list(recorded.values()))  # measured on the CPU: each cell alone


def test_measured_gpu_cells_never_share_a_gpu(tmp_path):
    """A machine with two GPUs (given, as CUDA_VISIBLE_DEVICES would): each worker is pinned to
    one, so the two cells, which run at the same time, ran on different GPUs."""
    grid = load_grid(grid_file(tmp_path, ms=0.3), options={}, rates=["50", "100"])
    folder = open_sweep(grid, tmp_path / "gpu", quality=False, say=lambda line: None)
    result = run_sweep(grid, folder, quality=False, say=lambda line: None,
                       executor=LocalExecutor(workers=None, gpus=["0", "1"]))
    assert not result.failed and len(result.ran) == 2
    a, b = cells(folder).values()
    assert intervals_overlap([a, b])  # two workers, two measured GPU cells: both at once
    assert {a["where"]["gpu"], b["where"]["gpu"]} == {"0", "1"} and a["where"]["pid"] != b["where"]["pid"]


def test_a_killed_worker_fails_its_cell_only_and_the_rerun_runs_it(tmp_path):
    grid_file(tmp_path, ms=0.3)  # ~0.5 s a cell: 5 requests (2 warm-up) x 256 tokens
    out = tmp_path / "sw"
    args = [sys.executable, "-m", "harness.cli", "sweep", "--config", str(tmp_path / "grid.toml"), "--output",
            str(out), "--no-quality", "--executor", "local", "--workers", "2", "--measured-parallel", "2"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline, victim = time.time() + 60, None
    while victim is None and time.time() < deadline and proc.poll() is None:
        partial = sorted(out.glob(".dummy-*.partial-*")) if out.is_dir() else []
        victim = partial[0] if partial else None
        time.sleep(0.02)
    assert victim is not None, proc.communicate()
    name, pid = victim.name[1:].split(".partial-")
    os.kill(int(pid), signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    assert f"1 failed ({name})" in stdout
    record = cells(out)
    assert record[name]["status"] == "failed" and "killed by SIGKILL" in record[name]["error"], record[name]
    assert not (out / name / "run.json").exists()  # never looks complete
    others = [n for n in record if n != name]
    assert len(others) == 2 and all((out / n / "run.json").is_file() and record[n]["status"] == "complete"
                                    for n in others)
    again = CliRunner().invoke(app, args[3:])
    assert again.exit_code == 0, again.output
    assert "1 points run, 2 already complete" in again.stdout
    assert json.loads((out / name / "run.json").read_text())["status"] == "complete"


def test_failed_cells_are_recorded_with_their_error_and_run_again_next_time(tmp_path):
    grid_file(tmp_path, extra="fail_after_steps = 1\n")
    first = sweep(tmp_path, "sw")
    assert first.exit_code == 1, first.output
    assert "0 points run, 0 already complete, 3 failed" in first.stdout
    record = cells(tmp_path / "sw")
    assert all(r["status"] == "failed" and "RuntimeError" in r["error"] for r in record.values()), record
    assert first.stderr.count("sweep: dummy-r50\n") == 1  # not retried within the sweep
    assert json.loads((tmp_path / "sw" / "dummy-r50" / "run.json").read_text())["status"] == "failed"
    again = sweep(tmp_path, "sw")
    assert again.exit_code == 1 and "sweep: dummy-r50: status failed" in again.stderr  # a failed cell runs again


def test_dry_run_prints_each_cell_and_a_command_that_makes_that_cell(tmp_path):
    grid_file(tmp_path)
    out = tmp_path / "sw"
    dry = sweep(tmp_path, "sw", "--executor", "local", "--dry-run")
    assert dry.exit_code == 0, dry.output
    lines = dry.stdout.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["dummy-r50", "dummy-r100", "dummy-r200"]
    assert all("local worker" in line and "): pwbench run " in line for line in lines)
    assert not out.exists()  # nothing ran, nothing was written
    # The printed command makes the cell the sweep itself would: the sweep accepts it as complete.
    cmd = shlex.split(lines[1].split("): ", 1)[1])
    made = CliRunner().invoke(app, cmd[1:])
    assert made.exit_code == 0, made.output
    done = sweep(tmp_path, "sw")
    assert done.exit_code == 0, done.output
    assert "2 points run, 1 already complete (dummy-r100)" in done.stdout


BLOCK_RAY = """import sys
class _NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoRay())
"""


def test_ray_executor_without_ray_is_one_line_naming_the_extra(tmp_path):
    """Ray is not uninstalled: a sitecustomize makes `import ray` fail as it would without it."""
    (tmp_path / "noray").mkdir()
    (tmp_path / "noray" / "sitecustomize.py").write_text(BLOCK_RAY)
    grid_file(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "noray"), "OMP_NUM_THREADS": "1"}
    probe = subprocess.run([sys.executable, "-c", "import ray"], capture_output=True, text=True, env=env)
    assert probe.returncode == 1 and "No module named 'ray'" in probe.stderr
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "sweep", "--config", str(tmp_path / "grid.toml"),
                           "--output", str(tmp_path / "sw"), "--executor", "ray"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: --executor ray needs Ray") and "pip install -e '.[ray]'" in proc.stderr
    assert not (tmp_path / "sw").exists()


def test_ctrl_c_stops_the_workers_and_leaves_nothing_that_looks_complete(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:  # --workers 2 runs at most the cores' workers: two cells never overlap
        pytest.skip("needs 2 cores (this process is pinned to fewer)")
    grid_file(tmp_path, ms=20.0)  # cells of seconds: both still running when seen, on a loaded machine too
    out = tmp_path / "sw"
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "sweep", "--config", str(tmp_path / "grid.toml"),
                             "--output", str(out), "--no-quality", "--executor", "local", "--workers", "2",
                             "--measured-parallel", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline, running = time.time() + 60, []
    while len(running) < 2 and time.time() < deadline and proc.poll() is None:
        running = sorted(out.glob(".dummy-*.partial-*")) if out.is_dir() else []
        time.sleep(0.02)
    assert len(running) == 2, proc.communicate()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    record = cells(out)
    stopped = {p.name[1:].split(".partial-")[0] for p in running}
    assert {record[n]["status"] for n in stopped} == {"interrupted"}, record
    assert not list(out.glob("*/run.json"))  # nothing looks complete
    for pid in (int(p.name.split(".partial-")[1]) for p in running):
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_a_cell_that_fails_as_it_is_stopped_is_reported_interrupted():
    """The stop (SIGTERM, raised as KeyboardInterrupt in the worker) can land in C code that turns it
    into another error: numpy's import then raises ImportError ("PyCapsule_Import could not import
    module "datetime"", seen in CI, about 1 stop in 30 here). The cell was stopped, not broken."""
    import multiprocessing

    mine, theirs = multiprocessing.Pipe()
    worker = _Worker.__new__(_Worker)  # its pipe only: no process is needed to collect a sent outcome
    worker.conn, worker.job, worker.gpu = mine, None, None
    numpy_said = 'ImportError: Original error was: PyCapsule_Import could not import module "datetime"'
    theirs.send(CellOutcome("dummy-r100", "failed", numpy_said))
    got = worker.collect(timeout=5.0, why="stopped by Ctrl-C")
    assert (got.name, got.status) == ("dummy-r100", "interrupted")
    assert got.error == f"stopped by Ctrl-C (the cell then failed: {numpy_said})"
    theirs.send(CellOutcome("dummy-r50", "complete"))  # a cell that finished as it was stopped stays complete
    assert worker.collect(timeout=5.0, why="stopped by Ctrl-C").status == "complete"
    theirs.send(CellOutcome("dummy-r200", "failed", "ValueError: x"))  # not stopped: its own failure
    assert worker.collect(timeout=5.0).status == "failed"


def test_repeats_are_interleaved_and_resume(tmp_path):
    grid = load_grid(grid_file(tmp_path, extra=""), options={}, rates=["50", "100"], repeats=2)
    folder = open_sweep(grid, tmp_path / "sw", quality=False, say=lambda line: None)
    said: list[str] = []
    result = run_sweep(grid, folder, quality=False, say=said.append)
    order = ["dummy-r50/r1", "dummy-r100/r1", "dummy-r50/r2", "dummy-r100/r2"]
    assert said == [f"sweep: {name}" for name in order] and sorted(result.ran) == sorted(order)
    run = json.loads((folder / "dummy-r100" / "r2" / "run.json").read_text())
    assert run["config"]["row"] == "dummy-r100" and run["config"]["repeat"] == 2
    assert json.loads((folder / "sweep.json").read_text())["settings"]["repeats"] == 2
    again = run_sweep(grid, open_sweep(grid, folder, quality=False), quality=False, say=said.append)
    assert again.ran == [] and sorted(again.skipped) == sorted(order)

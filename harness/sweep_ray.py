"""The `ray` executor of `pwbench sweep`: each cell a Ray task on a cluster (an address) or on a
local cluster this process starts. Resources keep measurements clean: a measured GPU cell asks
for one GPU, a measured CPU cell for a node's CPUs (pinned to that node), a simulated one for one
CPU; no task is retried. Results are written by the task into the shared sweep folder, or sent
back to this process as bytes (`results="driver"`, when nodes share no disk). docs/sweeps.md.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import socket
import tarfile
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from harness.errors import HarnessError
from harness.sweep_exec import (
    AUTO,
    CPU,
    GPU,
    SIMULATED,
    CellJob,
    CellOutcome,
    Done,
    Started,
    cores,
    resolved_kind,
    run_cell,
)

RESULTS = ("shared", "driver")


def _first_line(exc: BaseException) -> str:
    """A Ray error's first line (its message goes on with remote tracebacks), or ''."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


@ray.remote(max_retries=0)  # fail fast: a cell that failed or lost its worker is not run again in this sweep
def _cell_task(job: CellJob, pack: bool) -> tuple[CellOutcome, bytes | None]:
    context = ray.get_runtime_context()
    where = {"node_id": context.get_node_id(), "node_ip": ray.util.get_node_ip_address()}
    if not pack:
        return run_cell(job, where), None
    with tempfile.TemporaryDirectory(prefix="pwbench-cell-") as tmp:
        local = Path(tmp) / job.name  # the same last name as in the sweep folder: run.json's run_id is it
        outcome = run_cell(replace(job, args=replace(job.args, output=str(local))), where)
        if not (local / "run.json").is_file():
            return outcome, None
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            tar.add(local, arcname=".")
        return outcome, buffer.getvalue()


def unpack(data: bytes, target: Path) -> None:
    """A cell's folder sent back as bytes, written beside `target` and renamed into place (a
    folder with run.json is whole: harness/results.py)."""
    tmp = target.parent / f".{target.name}.partial-driver-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(tmp, filter="data")
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class RayExecutor:
    """Cells as Ray tasks. `address`: None starts a local cluster here (ray.init("local")),
    "auto" joins the cluster this machine is a node of (or RAY_ADDRESS), else host:port of the
    head's GCS, or ray://host:port for the Ray Client (KubeRay's head service, port 10001)."""

    name = "ray"

    def __init__(self, address: str | None = None, results: str = "shared", measured_parallel: int = 1) -> None:
        if results not in RESULTS:
            raise HarnessError(f"--ray-results must be one of {', '.join(RESULTS)}, got {results!r}")
        if measured_parallel < 1:
            raise HarnessError(f"--measured-parallel must be >= 1, got {measured_parallel}")
        self.address, self.results, self.measured_parallel = address, results, measured_parallel
        self.gpus = 0.0
        self.nodes: list[tuple[str, float]] = []  # (node id, CPUs) of the alive nodes with CPUs

    def _cluster(self) -> str:
        return self.address or "a local Ray cluster started here"

    def _kind(self, job: CellJob) -> str:
        return resolved_kind(job.kind, bool(self.gpus))

    def where(self, job: CellJob) -> str:
        kind = job.kind if job.kind != AUTO else "gpu where the cluster has one, else cpu"
        ask = {SIMULATED: "num_cpus=1", GPU: "num_gpus=1", CPU: "a node's CPUs / measured-parallel, pinned"}
        return f"a Ray task on {self._cluster()}, {ask.get(kind, kind)}, results {self.results}"

    def describe(self) -> dict[str, Any]:
        return {"executor": self.name, "address": self.address or "local", "results": self.results,
                "measured_parallel": self.measured_parallel}

    def _connect(self) -> None:
        host, _, port = (self.address or "").rpartition(":")
        if host and port.isdigit() and "://" not in self.address:  # a GCS address: Ray would retry it for minutes
            try:
                socket.create_connection((host, int(port)), timeout=10).close()
            except OSError as exc:
                raise HarnessError(f"--ray-address {self.address}: nothing answers there ({exc.strerror or exc}); "
                                   "give host:port of the cluster head's GCS (ray start --head --port)") from None
        try:
            ray.init(address=self.address or "local", log_to_driver=False, logging_level=logging.ERROR,
                     **({} if self.address else {"num_cpus": cores(), "include_dashboard": False}))
        except (ConnectionError, RuntimeError, ValueError) as exc:
            first = _first_line(exc) or type(exc).__name__
            raise HarnessError(f"--ray-address {self.address}: cannot join the Ray cluster ({first}); give "
                               "host:port of its head, ray://host:10001, or auto on one of its nodes") from None
        self.gpus = float(ray.cluster_resources().get("GPU", 0))
        self.nodes = sorted((n["NodeID"], float(n["Resources"].get("CPU", 0))) for n in ray.nodes()
                            if n.get("Alive") and n["Resources"].get("CPU"))

    def _options(self, job: CellJob, i: int) -> dict[str, Any]:
        kind = self._kind(job)
        if kind == SIMULATED:
            return {"num_cpus": 1}
        if kind == GPU:
            if not self.gpus:
                raise HarnessError(f"cell {job.name} is measured on a GPU (--set device=cuda) but the Ray cluster on "
                                   f"{self._cluster()} has none; measure on the CPU (device=cpu) or add GPU nodes")
            return {"num_gpus": 1, "num_cpus": 1}
        # A measured CPU cell takes a share of one node's CPUs: nothing else CPU-bound runs beside it.
        node, cpus = self.nodes[i % len(self.nodes)]
        return {"num_cpus": max(1.0, cpus // self.measured_parallel),
                "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

    def run(self, jobs: list[CellJob], started: Started, done: Done) -> None:
        self._connect()
        try:
            self._run(jobs, started, done)
        finally:
            ray.shutdown()  # a local cluster stops with it; a remote one just loses this driver

    def _run(self, jobs: list[CellJob], started: Started, done: Done) -> None:
        pack = self.results == "driver"
        options, k = [], 0  # every cell's resources first (a GPU cell on a cluster without one is refused)
        for job in jobs:
            options.append(self._options(job, k))
            k += self._kind(job) == CPU  # measured CPU cells: the nodes in turn
        pending: dict[Any, CellJob] = {}
        for job, opts in zip(jobs, options):
            pending[_cell_task.options(**opts).remote(job, pack)] = job
            started(job, f"queued as a Ray task on {self._cluster()}")
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    job = pending.pop(ref)
                    done(self._outcome(job, ref, pack))
        except KeyboardInterrupt:
            for ref, job in pending.items():
                ray.cancel(ref, force=True)  # the worker dies: its partial folder stays hidden, marked incomplete
                done(CellOutcome(job.name, "interrupted", "stopped by Ctrl-C", {}))
            raise

    def _outcome(self, job: CellJob, ref: Any, pack: bool) -> CellOutcome:
        try:
            outcome, data = ray.get(ref)
        except ray.exceptions.RayError as exc:  # a worker or node lost, a task cancelled
            first = _first_line(exc)
            return CellOutcome(job.name, "failed", f"{type(exc).__name__}: {first}; the cell's folder is not "
                               "complete (rerun the sweep to run it again)")
        if data is not None:
            try:
                unpack(data, Path(job.args.output))
            except (OSError, tarfile.TarError) as exc:
                return replace(outcome, status="failed", error=f"the cell ran, but its folder could not be written "
                                                                f"into {job.args.output}: {exc}")
        return replace(outcome, where={**outcome.where, "written_by": socket.gethostname()}) if pack else outcome

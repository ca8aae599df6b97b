"""Executors for `pwbench sweep`: a cell (one `pwbench run` configuration and its folder) is run
by `serial` (here, one after another), `local` (worker processes on this machine, one per GPU
or at most the cores) or `ray` (harness/sweep_ray.py). Each reports a CellOutcome per cell;
harness/sweep.py decides which cells run and records the outcomes. docs/sweeps.md.
"""

from __future__ import annotations

import multiprocessing
import os
import shlex
import signal
import socket
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import connection
from typing import Any, Protocol

from engines.base import EngineError
from harness.errors import HarnessError
from harness.run import RunArgs, execute
from workloads.base import WorkloadError

# What a cell needs from the machine: decided by its options, never by its engine's name.
SIMULATED, GPU, CPU, AUTO = "simulated", "gpu", "cpu", "auto"  # AUTO: a GPU where there is one


def resolved_kind(kind: str, has_gpu: bool) -> str:
    """A cell's kind on an executor: AUTO becomes GPU where the executor has one, else CPU."""
    return (GPU if has_gpu else CPU) if kind == AUTO else kind


def cell_kind(options: dict[str, Any]) -> str:
    """SIMULATED (runs on a CPU, measures nothing), GPU / CPU (measured on that device), or AUTO
    (the engine's default device: a GPU where the executor has one, else the CPU)."""
    if options.get("simulate"):
        return SIMULATED
    device = str(options.get("device") or "auto")
    return GPU if device.startswith("cuda") else CPU if device == "cpu" else AUTO


@dataclass(frozen=True)
class CellJob:
    name: str  # the cell's folder inside the sweep folder (a point, or <point>/r<k> with repeats)
    args: RunArgs  # args.output is the cell's folder
    kind: str  # cell_kind of its options


@dataclass(frozen=True)
class CellOutcome:
    name: str
    status: str  # the run's status (complete, failed, interrupted), or failed / interrupted without a folder
    error: str | None = None
    where: dict[str, Any] = field(default_factory=dict)  # host, pid, gpu; node_id / node_ip on Ray
    started_at_unix: float | None = None
    wall_s: float | None = None

    def record(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "name"}


def here() -> dict[str, Any]:
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {"host": socket.gethostname(), "pid": os.getpid(), **({"gpu": gpu} if gpu else {})}


def _describe(exc: Exception) -> str:
    """A user error's own line; anything else with its type and the innermost frame."""
    if isinstance(exc, (HarnessError, EngineError, WorkloadError)):
        return str(exc)
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" (at {os.path.basename(frame.filename)}:{frame.lineno})" if frame else ""
    return f"{type(exc).__name__}: {exc}{at}"


def run_cell(job: CellJob, where: dict[str, Any] | None = None) -> CellOutcome:
    """Run one cell into its folder (harness/run.py: atomic, a partial folder until complete).
    Fail fast: an exception is this cell's failure, never retried here; Ctrl-C propagates."""
    started, t0 = time.time(), time.perf_counter()
    try:
        _, run = execute(job.args)
        status, error = str(run["status"]), run.get("error")
    except Exception as exc:  # noqa: BLE001  (a cell's failure is recorded; the sweep goes on)
        status, error = "failed", _describe(exc)
    return CellOutcome(job.name, status, error, {**here(), **(where or {})}, started, time.perf_counter() - t0)


def command(job: CellJob) -> str:
    """The `pwbench run` command line that runs this cell by itself (same folder, same options)."""
    a, w = job.args, job.args.workload
    argv = ["pwbench", "run", "--workload", w.name, "--engine", a.engine, "--seed", str(w.seed)]
    if "requests" in a.given:
        argv += ["--requests", str(w.requests)]
    if "rate" in a.given:
        argv += ["--rate", f"{w.rate:g}"]
    if a.model:
        argv += ["--model", a.model]
    options = dict(a.engine_options)
    for key, flag in (("simulate", "--simulate"), ("routing", "--routing"), ("budget_bytes", "--budget"),
                      ("device", "--device"), ("dtype", "--dtype")):
        if key in options:
            argv += [flag, str(options.pop(key))]
    for key, value in options.items():
        argv += ["--set", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    if not a.quality:
        argv.append("--no-quality")
    return shlex.join([*argv, "--output", str(a.output)])


Started = Callable[[CellJob, str], None]
Done = Callable[[CellOutcome], None]


class Executor(Protocol):
    """Runs cells and reports each one's outcome through `done` as it finishes (any order);
    on Ctrl-C it stops the cells in flight, reports them interrupted and re-raises."""

    name: str

    def where(self, job: CellJob) -> str: ...  # where the cell would run (dry run); no time spent

    def describe(self) -> dict[str, Any]: ...  # what sweep.json records with each cell

    def run(self, jobs: list[CellJob], started: Started, done: Done) -> None: ...


class SerialExecutor:
    """Today's sweep: every cell here, in order, one at a time."""

    name = "serial"

    def where(self, job: CellJob) -> str:
        return f"here ({socket.gethostname()}), one cell at a time"

    def describe(self) -> dict[str, Any]:
        return {"executor": self.name}

    def run(self, jobs: list[CellJob], started: Started, done: Done) -> None:
        for job in jobs:
            started(job, "here")
            try:
                outcome = run_cell(job)
            except KeyboardInterrupt:
                done(CellOutcome(job.name, "interrupted", "stopped by Ctrl-C", here()))
                raise
            done(outcome)


def visible_gpus() -> list[str]:
    """This machine's GPUs as CUDA_VISIBLE_DEVICES entries: that variable's own list when set,
    else NVML's count (no torch import); [] without a GPU driver."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [g.strip() for g in given.split(",") if g.strip() and g.strip() != "-1"]
    try:
        import pynvml  # noqa: PLC0415  (nvidia-ml-py; asked only when a local sweep starts)
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return []


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class LocalExecutor:
    """Worker processes on this machine: one per GPU, pinned with CUDA_VISIBLE_DEVICES, on a GPU
    machine; else `workers` (at most the cores). Cells start in list order as the rules allow:
    a measured CPU cell runs with nothing else beside it but up to `measured_parallel` measured
    CPU cells; a measured GPU cell has its worker's GPU to itself; simulated cells fill every
    worker. A worker that dies fails its cell and is replaced."""

    name = "local"

    def __init__(self, workers: int | None = None, measured_parallel: int = 1, gpus: list[str] | None = None) -> None:
        if workers is not None and workers < 1:
            raise HarnessError(f"--workers must be >= 1, got {workers}")
        if measured_parallel < 1:
            raise HarnessError(f"--measured-parallel must be >= 1, got {measured_parallel}")
        self.gpus = visible_gpus() if gpus is None else list(gpus)
        if self.gpus:
            self.slots: list[str | None] = list(self.gpus[:workers] if workers else self.gpus)
        else:
            self.slots = [None] * min(workers or cores(), cores())
        self.measured_parallel = measured_parallel

    def _kind(self, job: CellJob) -> str:
        return resolved_kind(job.kind, bool(self.gpus))

    def where(self, job: CellJob) -> str:
        kind, n = self._kind(job), len(self.slots)
        if kind == SIMULATED:
            return f"any of {n} local workers"
        if kind == GPU:
            return f"a local worker with one GPU to itself (CUDA_VISIBLE_DEVICES one of {','.join(self.slots)})"
        return f"a local worker, measured, at most {self.measured_parallel} at a time and nothing else beside"

    def describe(self) -> dict[str, Any]:
        return {"executor": self.name, "workers": len(self.slots), "gpus": self.gpus,
                "measured_parallel": self.measured_parallel}

    def _admits(self, job: CellJob, running: list[str]) -> bool:
        if len(running) >= len(self.slots):
            return False
        if self._kind(job) == CPU:
            return all(k == CPU for k in running) and len(running) < self.measured_parallel
        return CPU not in running

    def run(self, jobs: list[CellJob], started: Started, done: Done) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads or CUDA
        workers: list[_Worker | None] = [None] * len(self.slots)
        queue = deque(jobs)
        try:
            while queue or any(w is not None and w.job is not None for w in workers):
                while queue and self._admits(queue[0], [self._kind(w.job) for w in workers if w and w.job]):
                    i = next(i for i, w in enumerate(workers) if w is None or w.job is None)
                    if workers[i] is None or not workers[i].process.is_alive():
                        workers[i] = _Worker(ctx, self.slots[i])
                    job = queue.popleft()
                    workers[i].send(job)
                    started(job, workers[i].label())
                busy = [w for w in workers if w is not None and w.job is not None]
                ready = set(connection.wait([w.conn for w in busy] + [w.process.sentinel for w in busy]))
                for w in busy:
                    if w.conn in ready or w.process.sentinel in ready:
                        done(w.collect())
        except KeyboardInterrupt:
            busy = [w for w in workers if w is not None and w.job is not None]
            for w in busy:
                w.process.terminate()  # SIGTERM: the worker's run abandons its partial folder, says so, exits
            for w in busy:
                done(w.collect(timeout=10.0, why="stopped by Ctrl-C"))
            raise
        finally:
            for w in workers:
                if w is not None:
                    w.close()


class _Worker:
    """A spawned process running cells sent over a pipe (_serve), one at a time."""

    def __init__(self, ctx: Any, gpu: str | None) -> None:
        self.gpu, self.job = gpu, None
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, gpu), name=f"pwbench-sweep-{gpu or 'cpu'}")
        self.process.start()
        child.close()

    def label(self) -> str:
        return f"worker pid {self.process.pid}" + (f", GPU {self.gpu}" if self.gpu is not None else "")

    def send(self, job: CellJob) -> None:
        self.job = job
        self.conn.send(job)

    def collect(self, timeout: float = 0.0, why: str | None = None) -> CellOutcome:
        """The running cell's outcome; when the process died instead, the cell failed."""
        job, self.job = self.job, None
        try:
            if self.conn.poll(timeout):
                outcome = self.conn.recv()
                if why and outcome.status == "failed":
                    # Stopped mid-cell, it may fail instead of stopping: the interrupt can land in C code
                    # that turns it into another error (numpy's import: "PyCapsule_Import could not
                    # import module "datetime""). The stop is the cause.
                    outcome = replace(outcome, status="interrupted", error=f"{why} (the cell then failed: "
                                                                           f"{outcome.error})")
                return outcome
        except (EOFError, OSError):
            pass
        self.process.join(1.0)
        code = self.process.exitcode
        if code is not None and code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = "still running" if code is None else f"exit code {code}"
        where = {"host": socket.gethostname(), "pid": self.process.pid, **({"gpu": self.gpu} if self.gpu else {})}
        status = "interrupted" if why else "failed"
        return CellOutcome(job.name, status, why or f"the worker process {self.process.pid} died ({how}) while "
                                                    "running this cell; its folder is not complete", where)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        self.conn.close()


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _serve(conn: Any, gpu: str | None) -> None:
    """A local worker's loop. CUDA_VISIBLE_DEVICES is set before any cell imports torch; Ctrl-C is
    left to the driver, which stops a worker with SIGTERM (raised here as KeyboardInterrupt)."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop)
    while True:
        try:
            job = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if job is None:
            return
        try:
            outcome = run_cell(job)
        except KeyboardInterrupt:
            conn.send(CellOutcome(job.name, "interrupted", "stopped by Ctrl-C", here()))
            return
        conn.send(outcome)


def make_executor(name: str, workers: int | None = None, measured_parallel: int = 1, ray_address: str | None = None,
                  ray_results: str = "shared") -> Executor:
    """The executor by name; `ray` needs the optional extra (one line when it is missing)."""
    if name == "serial":
        return SerialExecutor()
    if name == "local":
        return LocalExecutor(workers, measured_parallel)
    if name == "ray":
        try:
            from harness.sweep_ray import RayExecutor  # noqa: PLC0415  (Ray is optional and heavy)
        except ImportError as exc:
            if (exc.name or "").partition(".")[0] != "ray":
                raise
            raise HarnessError("--executor ray needs Ray, which is not installed: pip install -e '.[ray]' "
                               "(the `ray` extra)") from None
        return RayExecutor(ray_address, ray_results, measured_parallel)
    raise HarnessError(f"unknown executor {name!r}; valid: serial, local, ray")

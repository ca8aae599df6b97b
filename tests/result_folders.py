"""Result folders for the report and gate tests, made through harness.run.execute, and the CLI
in a subprocess (PYTHONPATH and the rest of the environment inherited)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.run import RunArgs, execute
from workloads.registry import WorkloadSpec


def make_run(folder: Path, engine: str = "dummy", seed: int = 0, **options) -> Path:
    """rag_long, 6 requests, half direct questions, at the demo model's scale (given
    explicitly, so dummy and demo-model runs have the same workload and can be compared)."""
    spec = WorkloadSpec("rag_long", requests=6, seed=seed, arrival="offline", direct_share=0.5, scale=0.25,
                        time_scale=0.1)
    execute(RunArgs(workload=spec,
                    given=frozenset({"requests", "seed", "arrival", "direct_share", "scale", "time_scale"}),
                    engine=engine, engine_options=options, output=str(folder), warmup=0, quality=False,
                    telemetry_hz=20))
    return folder


def pwbench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)

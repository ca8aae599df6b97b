"""Shared fixtures for workload tests: where the real traces are, and a runner for the trace CLI.

The real traces are read in place from $PWBENCH_TRACES (default <repo>/../shared/traces);
tests that need one skip with the reason when it is absent. Nothing is copied into the repo.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TRACES = Path(os.environ.get("PWBENCH_TRACES", Path(__file__).resolve().parents[3] / "shared" / "traces"))
REPO = Path(__file__).resolve().parents[2]
CLI = "from harness.cli.trace import trace_app; trace_app()"


@pytest.fixture(scope="session")
def real_trace():
    """real_trace("mooncake/conversation_trace.jsonl") -> its path, or skip with the reason."""

    def find(relative: str) -> Path:
        path = TRACES / relative
        if not path.exists():
            pytest.skip(f"real trace {relative} not found under {TRACES} (set PWBENCH_TRACES to the traces folder)")
        return path

    return find


@pytest.fixture
def trace_cli():
    """trace_cli(*args) -> CompletedProcess of `pwbench trace ...` in a fresh interpreter."""

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", CLI, *map(str, args)], capture_output=True, text=True, timeout=120, cwd=REPO
        )

    return run

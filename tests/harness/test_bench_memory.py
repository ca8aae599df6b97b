"""harness.bench.memory on a small case: it runs a real `pwbench run` and reports that run's
own numbers (requests and prompt tokens checked against the workload built here), and a peak
RSS measured for the child process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workloads.registry import ModelTarget, WorkloadSpec, build_workload


@pytest.mark.slow  # a benchmark's check, ~4 s: CI's slow step
def test_the_memory_benchmark_reports_the_run_it_made():
    proc = subprocess.run([sys.executable, "-m", "harness.bench.memory", "--requests", "150", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # The dummy engine's vocabulary, length limit and EOS (engines/dummy.py DummyConfig).
    workload = build_workload(WorkloadSpec("rag_long", requests=150, rate=1000.0), ModelTarget(32000, 1 << 20, (2,)))
    assert result["requests"] == result["completed"] == len(workload.requests) == 150
    assert result["input_tokens"] == sum(len(r.prompt_ids) for r in workload.requests)
    assert result["output_tokens"] == sum(r.max_new_tokens for r in workload.requests)  # the dummy never stops early
    assert result["peak_rss_mb"] > 0 and result["folder_mb"] > 0

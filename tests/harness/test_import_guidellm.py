"""`pwbench import guidellm`: a report built here as GuideLLM serializes one (timings plus the
computed per-request fields, with GuideLLM's formulas) maps request by request: pwbench's
TTFT = time_to_first_token_ms, TPOT = inter_token_latency_ms, E2E = request_latency."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.metrics import request_times

ROOT = Path(__file__).resolve().parents[2]


def guidellm_request(rng: np.random.Generator, i: int, t: float) -> dict:
    n = int(rng.integers(1, 50))
    start, first = t, t + float(rng.uniform(0.05, 0.8))
    last = first + (n - 1) * float(rng.uniform(0.01, 0.05))
    end = last + float(rng.uniform(0.0, 0.01))
    return {
        "type_": "generative_request_stats", "request_id": f"g{i}",
        "info": {"timings": {"request_start": start, "first_token_iteration": first, "last_token_iteration": last,
                             "request_end": end, "resolve_end": end, "token_iterations": n}},
        "input_metrics": {"total_tokens": int(rng.integers(10, 500))}, "output_metrics": {"total_tokens": n},
        # GuideLLM's computed fields (schemas/request_stats.py), as it writes them:
        "request_start_time": start, "request_end_time": end, "request_latency": end - start,
        "prompt_tokens": None, "output_tokens": n,
        "time_to_first_token_ms": 1000 * (first - start),
        "time_per_output_token_ms": 1000 * (last - start) / n,
        "inter_token_latency_ms": 1000 * (last - first) / (n - 1) if n > 1 else None,
    }


def report(benchmarks: int = 1, n: int = 30) -> dict:
    rng = np.random.default_rng(5)
    out = []
    for _b in range(benchmarks):
        reqs, t = [], 1.7e9
        for i in range(n):
            t += float(rng.exponential(0.3))
            r = guidellm_request(rng, i, t)
            r["prompt_tokens"] = r["input_metrics"]["total_tokens"]
            reqs.append(r)
        out.append({"type_": "generative_benchmark", "scheduler": {"strategy": {"type_": "poisson", "rate": 3.0}},
                    "benchmarker": {"backend": {"model": "Qwen/Qwen3-30B-A3B"}},
                    "requests": {"successful": reqs[2:], "errored": reqs[:2], "incomplete": []}})
    return {"benchmarks": out}


def pwbench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_import_guidellm_maps_each_request(tmp_path):
    data = report()
    src = tmp_path / "report.json"
    src.write_text(json.dumps(data))
    proc = pwbench("import", "guidellm", str(src), "--output", str(tmp_path / "run"), "--json")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout.splitlines()[-1])
    ok = data["benchmarks"][0]["requests"]["successful"]
    rows = pd.read_parquet(tmp_path / "run" / "requests.parquet").to_dict("records")
    by_id = {r["request_id"]: r for r in rows}
    for g in ok:
        t = request_times({**by_id[g["request_id"]], "token_times_s": list(by_id[g["request_id"]]["token_times_s"])})
        assert t.ttft_s * 1e3 == pytest.approx(g["time_to_first_token_ms"], rel=1e-9)
        assert t.e2e_s == pytest.approx(g["request_latency"], rel=1e-9)
        if g["inter_token_latency_ms"] is None:
            assert t.tpot_s is None
        else:
            assert t.tpot_s * 1e3 == pytest.approx(g["inter_token_latency_ms"], rel=1e-9)
    assert s["completed"] == len(ok) and s["failed"] == 2
    assert s["output_tokens"] == sum(g["output_tokens"] for g in ok)
    assert s["ttft_ms"]["mean"] == pytest.approx(np.mean([g["time_to_first_token_ms"] for g in ok]), rel=1e-9)
    itl = [g["inter_token_latency_ms"] for g in ok if g["inter_token_latency_ms"] is not None]
    assert s["tpot_ms"]["p50"] == pytest.approx(np.median(itl), rel=1e-9)
    assert s["e2e_ms"]["p99"] == pytest.approx(np.percentile([g["request_latency"] * 1e3 for g in ok], 99), rel=1e-9)
    assert all(v is None for v in s["itl_ms"].values())
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert "itl_ms" in run["engine"]["unavailable"] and run["engine"]["model"] == "Qwen/Qwen3-30B-A3B"


def test_import_guidellm_sweep_needs_an_index(tmp_path):
    src = tmp_path / "sweep.json"
    src.write_text(json.dumps(report(benchmarks=2, n=5)))
    proc = pwbench("import", "guidellm", str(src), "--output", str(tmp_path / "a"))
    assert proc.returncode == 2 and "holds 2 benchmarks (a sweep); choose one with --index 0..1" in proc.stderr
    assert not (tmp_path / "a").exists()
    proc = pwbench("import", "guidellm", str(src), "--index", "1", "--output", str(tmp_path / "b"), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[-1])["completed"] == 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"benchmarks": [{"requests": {}}]}))
    proc = pwbench("import", "guidellm", str(bad), "--output", str(tmp_path / "c"))
    assert proc.returncode == 2 and "no per-request records" in proc.stderr

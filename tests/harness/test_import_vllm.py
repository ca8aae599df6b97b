"""`pwbench import vllm`: a result JSON built here from vLLM's documented schema (per-request
lists + its aggregates computed with vLLM's own definitions, in numpy) comes back as a result
folder whose summary equals the file's numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def vllm_result(seed: int = 3, n: int = 40, with_starts: bool = True) -> dict:
    """What `vllm bench serve --save-result --save-detailed` writes, with its aggregates
    computed as vllm/benchmarks/serve.py does: TTFT/ITL/E2EL over successful requests; TPOT =
    (latency - ttft) / (output_len - 1) for output_len > 1; latency = ttft + sum(itl)."""
    rng = np.random.default_rng(seed)
    starts, ins, outs, ttfts, itls, errors = [], [], [], [], [], []
    t = 1000.0  # perf_counter seconds
    for i in range(n):
        t += float(rng.exponential(0.2))
        failed = i in (7, 23)
        out_len = 0 if failed else int(rng.integers(1, 60))
        chunks = max(1, out_len - int(rng.integers(0, 4)))  # some chunks carry several tokens
        starts.append(t)
        ins.append(int(rng.integers(10, 3000)))
        outs.append(out_len)
        ttfts.append(0.0 if failed else float(rng.uniform(0.02, 0.9)))
        itls.append([] if failed else [float(x) for x in rng.uniform(0.005, 0.06, size=chunks - 1)])
        errors.append("Bad Request: prompt too long" if failed else "")
    ok = [i for i in range(n) if not errors[i]]
    latency = {i: ttfts[i] + sum(itls[i]) for i in ok}
    duration = max(starts[i] + latency[i] for i in ok) - min(starts) + 0.05
    values = {
        "ttft": [ttfts[i] for i in ok],
        "tpot": [(latency[i] - ttfts[i]) / (outs[i] - 1) for i in ok if outs[i] > 1],
        "itl": [x for i in ok for x in itls[i]],
        "e2el": [latency[i] for i in ok],
    }
    total_in, total_out = sum(ins[i] for i in ok), sum(outs)
    data = {
        "date": "20261201-120000", "backend": "vllm", "model_id": "mistralai/Mixtral-8x7B-v0.1",
        "dataset_name": "random", "num_prompts": n, "request_rate": 5.0, "burstiness": 1.0, "max_concurrency": None,
        "duration": duration, "completed": len(ok), "failed": n - len(ok), "total_input_tokens": total_in,
        "total_output_tokens": total_out, "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration, "total_token_throughput": (total_in + total_out) / duration,
        "input_lens": ins, "output_lens": outs, "ttfts": ttfts, "itls": itls,
        "generated_texts": ["x"] * n, "errors": errors,
    }
    if with_starts:
        data["start_times"] = starts
    for m, v in values.items():
        a = np.asarray(v) * 1000
        data.update({f"mean_{m}_ms": float(a.mean()), f"median_{m}_ms": float(np.median(a)),
                     f"std_{m}_ms": float(a.std()), f"p99_{m}_ms": float(np.percentile(a, 99))})
    return data


def pwbench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


@pytest.mark.parametrize("with_starts", [True, False])
def test_import_vllm_round_trips_its_numbers(tmp_path, with_starts):
    data = vllm_result(with_starts=with_starts)
    src = tmp_path / "vllm.json"
    src.write_text(json.dumps(data))
    proc = pwbench("import", "vllm", str(src), "--output", str(tmp_path / "run"), "--json")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout.splitlines()[-1])
    approx = lambda x: pytest.approx(x, rel=1e-9)  # noqa: E731
    assert s["completed"] == data["completed"] and s["failed"] == data["failed"] and s["requests"] == 40
    assert s["input_tokens"] == data["total_input_tokens"] and s["output_tokens"] == data["total_output_tokens"]
    assert s["duration_s"] == approx(data["duration"])
    assert s["requests_per_s"] == approx(data["request_throughput"])
    assert s["output_tokens_per_s"] == approx(data["output_throughput"])
    assert s["input_tokens_per_s"] + s["output_tokens_per_s"] == approx(data["total_token_throughput"])
    for ours, theirs in (("ttft_ms", "ttft"), ("tpot_ms", "tpot"), ("itl_ms", "itl"), ("e2e_ms", "e2el")):
        assert s[ours]["mean"] == approx(data[f"mean_{theirs}_ms"]), ours
        assert s[ours]["p50"] == approx(data[f"median_{theirs}_ms"]), ours
        assert s[ours]["p99"] == approx(data[f"p99_{theirs}_ms"]), ours
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["imported"]["source_summary"]["std_ttft_ms"] == data["std_ttft_ms"]
    assert {"transfers", "memory", "queue_ms"} <= set(run["engine"]["unavailable"])
    assert ("arrival_s" in run["engine"]["unavailable"]) is (not with_starts)
    shown = pwbench("show", str(tmp_path / "run"), "--json")
    assert json.loads(shown.stdout) == run["summary"]


@pytest.mark.parametrize("mutate, fragment", [
    (lambda d: d.pop("itls"),
     "no per-request details (itls missing): save the vllm bench serve run with --save-result"),
    (lambda d: d["ttfts"].pop(), "per-request lists differ in length"),
    (lambda d: d.update(duration=0), "'duration' (seconds) is missing or not positive"),
])
def test_import_vllm_bad_files_are_one_line_errors(tmp_path, mutate, fragment):
    data = vllm_result(n=5)
    mutate(data)
    src = tmp_path / "vllm.json"
    src.write_text(json.dumps(data))
    proc = pwbench("import", "vllm", str(src), "--output", str(tmp_path / "run"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and fragment in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_import_vllm_jsonl_of_several_runs(tmp_path):
    src = tmp_path / "runs.jsonl"
    src.write_text(json.dumps(vllm_result(n=3)) + "\n" + json.dumps(vllm_result(n=4)) + "\n")
    proc = pwbench("import", "vllm", str(src), "--output", str(tmp_path / "run"))
    assert proc.returncode == 2 and "holds 2 JSON lines" in proc.stderr

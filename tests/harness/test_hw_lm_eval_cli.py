"""`pwbench hw` (measure, print, cache, and the peaks a run then uses) and `pwbench lm-eval`
(lm-eval's own command line with the pwbench model registered; arguments pass through)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.results import read_run


def pwbench(*args: str, cache: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PWBENCH_CACHE": str(cache),
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    pytest.skip("no /proc/cpuinfo: cannot name this CPU independently")


@pytest.mark.slow  # the real measurements (~32 s on 2 cores); `pwbench hw` stays via the cuda one-line error
def test_hw_cpu_measures_prints_caches_and_feeds_runs(tmp_path):
    cache, name = tmp_path / "cache", cpu_name()
    proc = pwbench("hw", "--device", "cpu", "--json", cache=cache)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    m = out["measured"]
    assert m["device"] == "cpu" and m["device_name"] == name and m["cpu_model"] == name
    assert out["datasheet"] is None  # no CPU is in the datasheet table
    # Plausible for any CPU: 0.1 GB/s - 10 TB/s copy bandwidth, 0.1 GFLOP/s - 100 TFLOP/s.
    assert 1e8 < m["memory_bandwidth_bytes_per_s"] < 1e13
    assert 1e8 < m["matmul_flops_per_s"] < 1e14 and m["matmul_flops_per_s"] == m["matmul_float32_flops_per_s"]
    assert "h2d_bytes_per_s" not in m  # nothing to measure without a device
    # The cost model's rates: decode attention (gather + SDPA), greedy's argmax, the elementwise
    # kernels; matmuls on weights read from memory run slower with 8 rows than with 512.
    for key in ("decode_attention_bytes_per_s", "argmax_bytes_per_s", "elementwise_bytes_per_s"):
        assert 1e7 < m[key] < 1e13, key
    assert m["matmul_flops_at_rows"]["8"] < m["matmul_flops_at_rows"]["512"]
    assert json.loads((cache / "hw.json").read_text()) == {name: m}

    # The table: the device, then every rate in G, the numbers of the entry it cached (a table of
    # rates, e.g. the grouped dequantization's by width and size, is cached, not printed).
    proc = pwbench("hw", "--device", "cpu", cache=cache)
    assert proc.returncode == 0, proc.stderr
    entry = json.loads((cache / "hw.json").read_text())[name]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{name} (cpu)"
    rates = {k: v for k, v in entry.items() if k.endswith("_per_s") and not isinstance(v, dict)}
    assert isinstance(entry["dequant_group_bytes_per_s"], dict)
    assert len(lines) == 1 + len(rates)
    for line, (key, value) in zip(lines[1:], rates.items()):
        assert line.split() == [key, f"{value / 1e9:,.1f}", "G"]

    # A run on this machine now takes the measured peaks, and says so.
    run_dir = tmp_path / "run"
    proc = pwbench("run", "--engine", "dummy", "--workload", "offline_batch", "--requests", "2", "--quiet",
                   "--output", str(run_dir), cache=cache)
    assert proc.returncode == 0, proc.stderr
    peaks = read_run(run_dir)["environment"]["peaks"]
    assert peaks == {**entry, "source": f"measured by pwbench hw at {entry['measured_at']}"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_hw_cuda_without_cuda_is_one_line(tmp_path):
    proc = pwbench("hw", "--device", "cuda", cache=tmp_path / "cache")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: device 'cuda' requested but this torch ({torch.__version__}) sees no CUDA device; use --device cpu"]
    assert not (tmp_path / "cache").exists()


@pytest.mark.gpu
def test_hw_cuda_measures_links_and_knows_the_datasheet(tmp_path):
    proc = pwbench("hw", "--device", "cuda", "--json", cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    m = out["measured"]
    assert m["device_name"] == torch.cuda.get_device_name(0)
    assert m["h2d_bytes_per_s"] > 1e9 and m["d2h_bytes_per_s"] > 1e9
    assert m["matmul_flops_per_s"] == m["matmul_bfloat16_flops_per_s"]
    from harness.hw import datasheet_for

    sheet = datasheet_for(m["device_name"])
    assert out["datasheet"] == (sheet[1] if sheet else None)
    if sheet:  # measured below the datasheet peak (copies and matmuls never exceed it)
        assert m["memory_bandwidth_bytes_per_s"] < sheet[1]["memory_bandwidth_bytes_per_s"]


def test_lm_eval_help_is_lm_evals_own(tmp_path):
    pytest.importorskip("lm_eval")
    proc = pwbench("lm-eval", "-h", cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: lm-eval") and "Language Model Evaluation Harness" in proc.stdout


def test_lm_eval_long_help_passes_through(tmp_path):
    """--help goes to lm-eval too (the command takes no help option of its own)."""
    pytest.importorskip("lm_eval")
    proc = pwbench("lm-eval", "--help", cache=tmp_path / "cache")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: lm-eval"), proc.stdout


@pytest.mark.slow  # a real lm-eval run (~25 s on 2 cores); `lm-eval` stays via the help tests
def test_lm_eval_offline_run_with_the_pwbench_model(tmp_path):
    """`pwbench demo tasks` writes the task YAMLs; lm-eval's CLI runs one of them on the bundled
    model through `--model pwbench`, with our --model_args, --limit and --output_path."""
    pytest.importorskip("lm_eval")
    cache, tasks, results = tmp_path / "cache", tmp_path / "tasks", tmp_path / "results"
    proc = pwbench("demo", "tasks", "--output", str(tasks), "--samples", "6", cache=cache)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tasks / "demo_rag.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["prompt"] and r["answer"] for r in rows)
    proc = pwbench("lm-eval", "--model", "pwbench", "--model_args", "engine=moe,device=cpu", "--tasks", "demo_rag",
                   "--include_path", str(tasks), "--limit", "4", "--output_path", str(results), "--log_samples",
                   cache=cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [result_file] = results.rglob("results_*.json")
    out = json.loads(result_file.read_text())
    assert out["config"]["model"] == "pwbench" and out["config"]["limit"] == 4
    assert out["config"]["model_args"] == {"engine": "moe", "device": "cpu"}
    # exact match recomputed from the logged samples: the generated words against the target.
    [samples_file] = results.rglob("samples_demo_rag_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert [s["doc"]["answer"] for s in samples] == [r["answer"] for r in rows[:4]]
    hits = [s["filtered_resps"][0].split() == s["target"].split() for s in samples]
    assert out["results"]["demo_rag"]["exact_match,none"] == pytest.approx(sum(hits) / 4)
    assert sum(hits) >= 3  # the bundled model answers ~99% of these

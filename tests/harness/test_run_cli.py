"""`pwbench run` end to end: result folder contents, summary recomputed from parquet alone,
Ctrl-C, missing NVML, bad options, and a real MoE engine on a tiny checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.metrics import summarize
from harness.results import read_rows, read_run


def pwbench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_dummy_run_summary_recomputes_from_parquet(tmp_path):
    out = tmp_path / "run"
    proc = pwbench("run", "--engine", "dummy", "--workload", "offline_batch", "--requests", "30",
                   "--input-len", "16-64", "--output-len", "8", "--set", "base_ms=2", "--set", "decode_ms_per_token=0.1",
                   "--output", str(out), "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["status"] == "complete" and last["completed"] == 30
    run = read_run(out)
    assert {p.name for p in out.iterdir()} == {"run.json", "requests.parquet", "steps.parquet", "telemetry.parquet"}
    assert run["schema_version"] == 1 and run["status"] == "complete"
    assert run["environment"]["torch"] and run["environment"]["cpu_model"]
    requests, steps = read_rows(out, "requests"), read_rows(out, "steps")
    assert len(requests) == 30 and all(len(r["token_times_s"]) == 8 for r in requests)
    again = summarize(requests, steps, run["config"]["slo"], run["engine"]["model_stats"], run["environment"]["peaks"])
    for key in ("requests_per_s", "output_tokens_per_s", "goodput_requests_per_s", "duration_s", "peak_concurrency"):
        assert again[key] == pytest.approx(run["summary"][key])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        for stat, value in run["summary"][key].items():
            assert again[key][stat] == pytest.approx(value)
    assert again["engine"] == pytest.approx(run["summary"]["engine"])
    show = pwbench("show", str(out))
    assert show.returncode == 0 and "TTFT ms" in show.stdout


def test_without_nvml_the_run_says_why(tmp_path):
    out = tmp_path / "run"
    proc = pwbench("run", "--engine", "dummy", "--workload", "offline_batch", "--requests", "5", "--output", str(out),
                   "--quiet", "--telemetry-hz", "50")
    assert proc.returncode == 0, proc.stderr
    run = read_run(out)
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pytest.skip("this machine has NVML")
    except pynvml.NVMLError:
        pass
    assert "NVML unavailable" in run["telemetry"]["gpu_unavailable"]
    assert read_rows(out, "telemetry")  # CPU series are still sampled


def test_sigint_saves_an_interrupted_run(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness.cli", "run", "--engine", "dummy", "--workload", "offline_batch",
         "--requests", "400", "--output-len", "20", "--set", "base_ms=5", "--set", "max_num_seqs=8",
         "--output", str(out), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    time.sleep(4.0)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    run = read_run(out)
    assert run["status"] == "interrupted"
    rows = read_rows(out, "requests")
    finished = [r for r in rows if r["finish_s"] is not None]
    assert 0 < len(finished) < 400
    assert all(len(r["token_times_s"]) == 20 for r in finished)
    assert run["summary"]["completed"] == len(finished)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--workload", "nope"], "nope"),
        (["--workload", "rag_long", "--slo", "ttft=3"], "unknown target"),
        (["--workload", "offline_batch", "--input-len", "x-y"], "input"),
        (["--engine", "nope"], "valid engines"),
        (["--workload", "trace:/does/not/exist.jsonl"], "exist"),
    ],
)
def test_bad_options(args, fragment, tmp_path):
    proc = pwbench("run", "--engine", "dummy", *args, "--output", str(tmp_path / "x"), "--quiet") if "--engine" not in args else \
        pwbench("run", *args, "--output", str(tmp_path / "x"), "--quiet")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert fragment in proc.stderr
    assert not (tmp_path / "x").exists()


def test_output_folder_must_be_new(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "file").write_text("x")
    proc = pwbench("run", "--engine", "dummy", "--workload", "offline_batch", "--requests", "2", "--output", str(out))
    assert proc.returncode == 2 and "already exists" in proc.stderr


def test_moe_engine_rag_long_end_to_end(checkpoints, tmp_path):
    folder = checkpoints("mixtral", max_position_embeddings=4096)
    out = tmp_path / "run"
    proc = pwbench("run", "--workload", "rag_long", "--engine", "moe", "--model", str(folder), "--requests", "20",
                   "--scale", "0.1", "--time-scale", "0.01", "--output", str(out), "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr
    run = read_run(out)
    assert run["status"] == "complete" and run["summary"]["completed"] == 20
    assert run["summary"]["engine"]["prefill_tokens_per_s"] > 0
    rows = read_rows(out, "requests")
    assert all(r["output_tokens"] == r["max_new_tokens"] for r in rows)

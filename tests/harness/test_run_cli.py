"""`pwbench run` end to end: result folder contents, the whole summary recomputed from the
parquet files by an independent implementation (pandas/numpy, below), Ctrl-C (once and
twice), an engine that crashes mid-way, missing NVML, bad options.

Subprocess runs get OMP_NUM_THREADS=1 (torch's threads spin against each other on a loaded
2-core machine: a 3 s demo run took 38 s with two) and a private PWBENCH_CACHE, so peaks
measured by a developer's `pwbench hw` never leak into a test.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from engines.runtime import cpu_attention, gemm
from harness.fidelity import REFERENCE_TEXT
from harness.results import read_run


def cli_env(cache: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PWBENCH_CACHE": str(cache), **extra}


def pwbench(*args: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def popen(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int, fragment: str) -> None:
    """Exit `code`, stderr exactly one non-empty `error:` line naming `fragment`, no traceback."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == code, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].strip() != "error:", proc.stderr
    assert fragment in lines[0] and "Traceback" not in proc.stderr + proc.stdout


def no_partial_siblings(folder: Path) -> bool:
    return not [p for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.partial")]


# -- the independent oracle: the summary from the parquet files, written here -----------------
def dist(values: list[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p95/p99 in ms; numpy's own percentile with linear interpolation."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p95": None, "p99": None}
    a = np.asarray(values, dtype=float) * 1e3
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q, method="linear")) for q in (50, 90, 95, 99)}}


def expected_summary(req: pd.DataFrame, steps: pd.DataFrame, slo: dict, model: dict, peaks: dict,
                     eos: set[int] | None = None, tokenizer=None) -> dict:
    has_error = req["error"].notna()
    done = req[~has_error & req["finish_s"].notna()]
    start = float(req["arrival_s"].min()) if len(req) else 0.0
    end = float(done["finish_s"].max()) if len(done) else start
    duration = max(end - start, 1e-9)
    ttft, tpot, itl, e2e, queue, good = [], [], [], [], [], 0
    for r in done.itertuples():
        times = np.asarray(r.token_times_s, dtype=float)
        t_first = times[0] - r.arrival_s if len(times) else None
        t_tpot = float(np.diff(times).mean()) if len(times) > 1 else None  # = (last - first) / (n - 1)
        t_e2e = r.finish_s - r.arrival_s
        if t_first is not None:
            ttft.append(t_first)
        if t_tpot is not None:
            tpot.append(t_tpot)
        itl += np.diff(times).tolist()
        e2e.append(t_e2e)
        if not pd.isna(r.started_s):
            queue.append(r.started_s - r.arrival_s)
        value = {"ttft_ms": t_first, "tpot_ms": t_tpot, "e2e_ms": t_e2e}
        good += all(value[k] is None or value[k] * 1e3 <= limit for k, limit in slo.items())
    # Peak concurrency, by brute force: at each send, the requests sent by then and not yet
    # finished (a finish at the same instant has freed its slot).
    sent, fin = done["sent_s"].to_numpy(float), done["finish_s"].to_numpy(float)
    peak = max((int(((sent <= t) & (fin > t)).sum()) for t in sent), default=0)
    out_tokens, in_tokens = int(done["output_tokens"].sum()), int(done["prompt_tokens"].sum())
    out = {
        "requests": len(req), "completed": len(done), "failed": int(has_error.sum()), "duration_s": duration,
        "requests_per_s": len(done) / duration, "input_tokens": in_tokens, "output_tokens": out_tokens,
        "input_tokens_per_s": in_tokens / duration, "output_tokens_per_s": out_tokens / duration,
        "ttft_ms": dist(ttft), "tpot_ms": dist(tpot), "itl_ms": dist(itl), "e2e_ms": dist(e2e), "queue_ms": dist(queue),
        "slo": slo, "goodput_requests_per_s": good / duration,
        "slo_attainment": good / len(done) if len(done) else None, "peak_concurrency": peak,
    }
    # Engine steps: prefill = steps with any prefill, decode = decode-only steps.
    pre = steps[steps["prefill_tokens"] > 0] if len(steps) else steps
    dec = steps[(steps["prefill_tokens"] == 0) & (steps["decode_tokens"] > 0)] if len(steps) else steps
    h2d, d2h = int(steps["h2d_bytes"].sum()) if len(steps) else 0, int(steps["d2h_bytes"].sum()) if len(steps) else 0
    out["engine"] = {
        "steps": len(steps), "busy_s": float(steps["duration_s"].sum()) if len(steps) else 0,
        "prefill_tokens_per_s": pre["prefill_tokens"].sum() / pre["duration_s"].sum() if len(pre) else None,
        "decode_tokens_per_s": dec["decode_tokens"].sum() / dec["duration_s"].sum() if len(dec) else None,
        "h2d_bytes": h2d, "d2h_bytes": d2h,
        "h2d_transfers": int(steps["h2d_transfers"].sum()) if len(steps) else 0,
        "d2h_transfers": int(steps["d2h_transfers"].sum()) if len(steps) else 0,
        "h2d_bytes_per_output_token": h2d / out_tokens if out_tokens else None,
        "d2h_bytes_per_output_token": d2h / out_tokens if out_tokens else None,
        "experts_hit_per_step_mean": float(steps["experts_hit"].mean()) if len(steps) else None,
        "preemptions": int(steps["preempted"].sum()) if len(steps) else 0,
    }
    if "ref_identical" in req and req["ref_identical"].notna().any():  # answers against the reference
        cmp = req[req["ref_identical"].notna()]
        tasks = cmp[cmp["correct"].notna()]
        out["fidelity"] = {
            "compared": len(cmp), "identical": int(cmp["ref_identical"].astype(bool).sum()),
            "fidelity": float(cmp["ref_identical"].astype(bool).mean()),
            "flips_lost": int((cmp["flip"] == "lost").sum()), "flips_gained": int((cmp["flip"] == "gained").sum()),
            "token_match_mean": float(cmp["ref_token_match"].mean()),
            "accuracy_served": float(tasks["correct"].astype(bool).mean()) if len(tasks) else None,
            "reference": REFERENCE_TEXT}
    cached = int(steps["cached_prompt_tokens"].sum()) if len(steps) else 0
    computed = int(steps["prefill_tokens"].sum()) if len(steps) else 0
    out["engine"]["cached_prompt_tokens"] = cached
    out["engine"]["prefix_cache_hit_rate"] = cached / (cached + computed) if cached + computed else None
    # Efficiency of decode-only steps: bytes read = the weights the step says it read
    # (weight_bytes_read; without it, dense weights + experts hit x bytes per expert) + K/V of
    # every attended token; FLOPs = 2 x active parameters x decode tokens.
    eff: dict = {"peaks_source": peaks.get("source")}
    if len(dec) and model:
        t = dec["duration_s"].sum()
        by_stats = model["dense_weight_bytes"] + dec["experts_hit"] * model["bytes_per_expert"]
        reported = dec["weight_bytes_read"] if "weight_bytes_read" in dec else pd.Series(0, index=dec.index)
        weights = reported.where(reported > 0, by_stats)
        read = weights.sum() + dec["context_tokens"].sum() * model["kv_bytes_per_token"]
        eff["decode_bandwidth_bytes_per_s"] = read / t
        eff["decode_flops_per_s"] = 2 * model["active_params_per_token"] * dec["decode_tokens"].sum() / t
        if peaks.get("memory_bandwidth_bytes_per_s"):
            eff["mbu"] = eff["decode_bandwidth_bytes_per_s"] / peaks["memory_bandwidth_bytes_per_s"]
        if peaks.get("matmul_flops_per_s"):
            eff["mfu"] = eff["decode_flops_per_s"] / peaks["matmul_flops_per_s"]
        if peaks.get("h2d_bytes_per_s") and steps["duration_s"].sum():
            eff["h2d_link_utilization"] = h2d / steps["duration_s"].sum() / peaks["h2d_bytes_per_s"]
    out["efficiency"] = eff
    # Memory: the peak of weights + KV after a step against the budget; expert cache and link
    # figures only where the engine reported them (x_ columns, copy time).
    mem: dict = {"budget_bytes": model.get("device_budget_bytes")}
    if len(steps):
        used = steps["device_weight_bytes"] + steps["device_kv_bytes"]
        mem["peak_device_bytes"] = int(used.max())
        mem["peak_kv_bytes"] = int(steps["device_kv_bytes"].max())
        if mem["budget_bytes"]:
            mem["peak_share_of_budget"] = used.max() / mem["budget_bytes"]
    if "x_expert_cache_hits" in steps:
        hits, misses = int(steps["x_expert_cache_hits"].sum()), int(steps["x_expert_cache_misses"].sum())
        mem.update(expert_cache_hits=hits, expert_cache_misses=misses, expert_cache_hit_rate=hits / (hits + misses))
    if "x_prefetch_issued" in steps and steps["x_prefetch_issued"].sum():
        issued, used_ = int(steps["x_prefetch_issued"].sum()), int(steps["x_prefetch_used"].sum())
        mem.update(prefetch_issued=issued, prefetch_used=used_, prefetch_accuracy=used_ / issued)
    if len(steps) and steps["copy_busy_s"].sum():
        busy, stall = steps["copy_busy_s"].sum(), steps["copy_stall_s"].sum()
        mem.update(copy_busy_s=busy, copy_stall_s=stall, copy_overlap_share=max(0.0, 1 - stall / busy),
                   link_bytes_per_s=(h2d + d2h) / busy)
        peak = model.get("link_peak_bytes_per_s") or peaks.get("h2d_bytes_per_s")
        if peak:
            mem.update(link_peak_bytes_per_s=peak, link_utilization=(h2d + d2h) / busy / peak)
    if "x_expert_copy_busy_s" in steps and steps["x_expert_copy_busy_s"].sum():
        eb, es = steps["x_expert_copy_busy_s"].sum(), steps["x_expert_copy_stall_s"].sum()
        mem.update(expert_copy_busy_s=eb, expert_copy_stall_s=es, expert_copy_overlap_share=max(0.0, 1 - es / eb))
    out["memory"] = mem
    # The cost model's predicted step times (x_predicted_step_s) against the measured ones.
    if "x_predicted_step_s" in steps and (steps["x_predicted_step_s"].fillna(0) > 0).any():
        pr = steps[steps["x_predicted_step_s"].fillna(0) > 0]
        pdec = pr[(pr["prefill_tokens"] == 0) & (pr["decode_tokens"] > 0)]
        out["plan"] = {"steps": len(pr),
                       "predicted_over_measured": pr["x_predicted_step_s"].sum() / pr["duration_s"].sum()}
        if len(pdec):
            out["plan"].update(decode_steps=len(pdec), decode_predicted_step_s_p50=pdec["x_predicted_step_s"].median(),
                               decode_measured_step_s_p50=pdec["duration_s"].median(),
                               decode_predicted_over_measured=(pdec["x_predicted_step_s"].sum()
                                                               / pdec["duration_s"].sum()))
    # Accuracy: the output decoded up to its first EOS, words compared with the answer.
    acc: dict = {}
    scored = req[req["task"].notna() & req["answer"].notna() & ~has_error] if "task" in req else req.iloc[:0]
    if tokenizer is not None and len(scored):
        for r in scored.itertuples():
            ids = [int(t) for t in r.output_ids]
            cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
            text = tokenizer.decode(ids[:cut])
            assert text == r.output_text, (r.request_id, text, r.output_text)
            hit = text.split() == r.answer.split()
            entry = acc.setdefault(r.task, {"correct": 0, "total": 0})
            entry["correct"] += hit
            entry["total"] += 1
        for entry in acc.values():
            entry["accuracy"] = entry["correct"] / entry["total"]
        total = sum(e["total"] for e in acc.values())
        correct = sum(e["correct"] for e in acc.values())
        acc["overall"] = {"correct": correct, "total": total, "accuracy": correct / total}
    out["accuracy"] = acc
    return out


def assert_same(actual, expected, path: str = "summary") -> None:
    """Same keys everywhere (nothing unchecked, nothing missing); numbers to 1e-9 relative."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (path, sorted(actual), sorted(expected))
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}.{key}")
    elif expected is None:
        assert actual is None, (path, actual)
    elif isinstance(expected, (int, float, np.integer, np.floating)) and not isinstance(expected, bool):
        assert actual is not None and math.isclose(actual, float(expected), rel_tol=1e-9, abs_tol=1e-12), \
            (path, actual, expected)
    else:
        assert actual == expected, (path, actual, expected)


def check_summary(folder: Path, tokenizer=None, eos: set[int] | None = None) -> tuple[dict, dict]:
    run = read_run(folder)
    req = pd.read_parquet(folder / "requests.parquet")
    steps = pd.read_parquet(folder / "steps.parquet")
    expected = expected_summary(req, steps, run["config"]["slo"], run["engine"]["model_stats"],
                                run["environment"]["peaks"], eos, tokenizer)
    expected["memory"].update({k: run["engine"][k] for k in ("weight_bytes", "kv_cache_bytes", "kv_capacity_tokens")})
    assert_same(run["summary"], expected)
    return run, expected


# -- runs ------------------------------------------------------------------------------------------
def test_dummy_run_summary_recomputes_from_parquet(tmp_path):
    # 12 requests, at most 4 in flight, 4 tokens each, 40 ms per step: three waves whose first
    # tokens come at ~40, ~200 and ~360 ms, so a 280 ms TTFT target splits them (8 / 4 unless
    # the machine stalls 80 ms) and queue times differ by wave.
    out = tmp_path / "run"
    proc = pwbench("run", "--engine", "dummy", "--workload", "offline_batch", "--requests", "12",
                   "--input-len", "16-64", "--output-len", "4", "--set", "base_ms=40", "--set", "max_num_seqs=4",
                   "--slo", "ttft_ms=280,tpot_ms=200", "--warmup", "0",
                   "--output", str(out), "--json", "--quiet", env=cli_env(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["status"] == "complete" and last["completed"] == 12
    assert {p.name for p in out.iterdir()} == {"run.json", "requests.parquet", "steps.parquet", "telemetry.parquet"}
    run, expected = check_summary(out)
    assert run["schema_version"] == 1 and run["status"] == "complete"
    assert run["environment"]["torch"] and run["environment"]["cpu_model"]
    assert {k: v for k, v in last.items() if k not in ("run_dir", "status")} == run["summary"]
    s = run["summary"]
    # The oracle is not comparing zeros: the figures it recomputed are spread out.
    assert 0 < s["slo_attainment"] < 1 and s["slo_attainment"] in (pytest.approx(4 / 12), pytest.approx(8 / 12))
    assert s["queue_ms"]["p99"] > s["queue_ms"]["p50"] + 40 and s["peak_concurrency"] == 12
    assert s["engine"]["prefill_tokens_per_s"] > 0 and s["engine"]["decode_tokens_per_s"] > 0
    assert s["efficiency"] == {"peaks_source": "none: run `pwbench hw` on this machine to measure peaks"}
    show = pwbench("show", str(out))
    assert show.returncode == 0 and "TTFT ms" in show.stdout


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    pytest.skip("no /proc/cpuinfo: cannot name this CPU for the peaks cache")


def test_demo_model_run_summary_with_efficiency_and_accuracy(tmp_path):
    """The bundled model on rag_long (demo tasks): efficiency against peaks `pwbench hw` would
    have cached for this CPU, accuracy from the outputs decoded here, model_stats from the
    safetensors file."""
    from safetensors import safe_open
    from tokenizers import Tokenizer

    from engines.common.demo import demo_model_path

    cache = tmp_path / "cache"
    cache.mkdir()
    cpu = _cpu_name()
    peaks = {"device_name": cpu, "memory_bandwidth_bytes_per_s": 1e10, "matmul_flops_per_s": 2e11,
             "h2d_bytes_per_s": 5e9, "measured_at": "2030-01-01T00:00:00"}
    (cache / "hw.json").write_text(json.dumps({cpu: peaks}))
    out = tmp_path / "run"
    proc = pwbench("run", "--workload", "rag_long", "--engine", "moe", "--requests", "5", "--rate", "20", "--device",
                   "cpu",
                   "--warmup", "1", "--output", str(out), "--quiet", env=cli_env(cache))
    assert proc.returncode == 0, proc.stderr
    model = demo_model_path()
    cfg = json.loads((model / "config.json").read_text())
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    run, _ = check_summary(out, tokenizer=tok, eos={cfg["eos_token_id"]})
    s = run["summary"]
    assert run["status"] == "complete" and s["completed"] == 5 and run["engine"]["device"] == "cpu"
    assert run["environment"]["peaks"]["source"] == "measured by pwbench hw at 2030-01-01T00:00:00"
    assert s["efficiency"]["mbu"] > 0 and s["efficiency"]["mfu"] > 0
    assert s["efficiency"]["h2d_link_utilization"] == 0.0  # nothing crosses a bus on the CPU
    steps = pd.read_parquet(out / "steps.parquet")
    if "weight_bytes_read" in steps:  # float32 weights at their stored size: what model_stats says
        st, dec = run["engine"]["model_stats"], steps[(steps["prefill_tokens"] == 0) & (steps["decode_tokens"] > 0)]
        expected = st["dense_weight_bytes"] + dec["experts_hit"] * st["bytes_per_expert"]
        assert (dec["weight_bytes_read"] == expected).all()
    assert s["accuracy"]["overall"]["total"] == 5 and s["accuracy"]["overall"]["correct"] >= 1
    # `--device cpu` in float32 is the quality reference itself: not compared with itself.
    assert run["quality"] == {"skipped": "this engine is the float32 reference itself"}
    # model_stats from the file: dense = every tensor but experts and the embedding (tied, so
    # the LM head reads it once); K/V = layers x (K, V) x kv heads x head dim x 4 bytes.
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    numel = {k: math.prod(v) for k, v in sizes.items()}
    experts = sum(n for k, n in numel.items() if ".experts." in k)
    embed = numel["model.embed_tokens.weight"]
    dense = sum(numel.values()) - experts - embed + (embed if "lm_head.weight" not in numel else 0)
    per_expert = 3 * cfg["hidden_size"] * cfg["intermediate_size"]
    L, E, k = cfg["num_hidden_layers"], cfg["num_local_experts"], cfg["num_experts_per_tok"]
    assert experts == L * E * per_expert
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    # On CPU float32 with MKL the LM head and every (resident) expert are also packed for its
    # GEMM, and decode attention says whether it ran the in-place kernel.
    can_pack = gemm.can_pack(torch.zeros(2, 2))
    packed = {"prepacked_bytes": 4 * (numel.get("lm_head.weight", embed) + experts)} if can_pack else {}
    assert run["engine"]["model_stats"] == pytest.approx({
        "dense_weight_bytes": 4 * dense, "bytes_per_expert": 4 * per_expert,
        "active_params_per_token": dense + L * k * per_expert,
        "kv_bytes_per_token": L * 2 * cfg["num_key_value_heads"] * head_dim * 4,
        **packed, "cpu_attention_kernel": float(cpu_attention.available()),
    })


def test_offload_run_under_a_budget_summary_recomputes(tmp_path):
    """`--engine offload --budget` with the link model on: the memory section (peak against the
    budget, expert cache, link) recomputes from steps.parquet, and no step exceeded the budget."""
    out = tmp_path / "run"
    budget = 2_300_000
    proc = pwbench("run", "--workload", "rag_long", "--requests", "4", "--rate", "20", "--engine", "offload",
                   "--budget", str(budget), "--set", "experts_per_layer=2", "--set", "prefetch=true",
                   "--set", "link_gbps=1", "--warmup", "0", "--no-quality", "--output", str(out), "--quiet",
                   env=cli_env(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr
    from tokenizers import Tokenizer

    from engines.common.demo import demo_model_path

    model = demo_model_path()
    eos = {json.loads((model / "config.json").read_text())["eos_token_id"]}
    run, _ = check_summary(out, tokenizer=Tokenizer.from_file(str(model / "tokenizer.json")), eos=eos)
    m = run["summary"]["memory"]
    assert run["engine"]["device_budget_bytes"] == budget == m["budget_bytes"]
    assert 0 < m["peak_device_bytes"] <= budget
    assert m["expert_cache_misses"] > 0 and m["link_peak_bytes_per_s"] == 1e9
    assert m["link_bytes_per_s"] == pytest.approx(1e9)  # the modelled link moves at its bandwidth
    steps = pd.read_parquet(out / "steps.parquet")
    assert ((steps["device_weight_bytes"] + steps["device_kv_bytes"]) <= budget).all()


def test_moegen_run_records_its_plan_and_the_summary_compares_predicted_and_measured(tmp_path):
    """`--engine moegen --budget` on the bundled model: the plan is in the engine info, every
    step carries a prediction, the summary's plan section recomputes from steps.parquet."""
    out = tmp_path / "run"
    budget = 1_300_000
    proc = pwbench("run", "--workload", "rag_long", "--requests", "4", "--rate", "20", "--engine", "moegen",
                   "--budget", str(budget), "--set", "host_kv_gb=0.05", "--set", "link_gbps=5",
                   "--warmup", "0", "--no-quality", "--output", str(out), "--quiet", env=cli_env(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr
    from tokenizers import Tokenizer

    from engines.common.demo import demo_model_path

    model = demo_model_path()
    eos = {json.loads((model / "config.json").read_text())["eos_token_id"]}
    run, _ = check_summary(out, tokenizer=Tokenizer.from_file(str(model / "tokenizer.json")), eos=eos)
    stats = run["engine"]["model_stats"]
    assert stats["plan_kv_on_host"] == 1 and stats["plan_predicted_decode_step_s"] > 0
    assert run["summary"]["plan"]["steps"] == run["summary"]["engine"]["steps"]
    assert 0 < run["summary"]["memory"]["peak_device_bytes"] <= budget


def test_output_text_is_cut_at_the_first_eos():
    """What accuracy scores: the words before the first EOS (the bundled model emits only EOS
    after its answer, so the runs above cannot tell a cut from no cut)."""
    from tokenizers import Tokenizer

    from engines.common.demo import demo_model_path
    from harness.run import _request_rows
    from harness.runner import RequestRecord, RunRecords

    model = demo_model_path()
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    baker, goat, eos = tok.token_to_id("baker"), tok.token_to_id("goat"), tok.token_to_id("</s>")
    assert None not in (baker, goat, eos)
    scored = RequestRecord("r0", None, 0, 0.0, 3, 6, task="rag_recall", answer="baker goat",
                           output_ids=[baker, goat, eos, goat, baker, eos])
    untasked = RequestRecord("r1", None, 0, 0.0, 3, 2, output_ids=[baker, eos])
    rows = _request_rows(RunRecords("complete", [scored, untasked], [], 0.0), str(model))
    assert [r["output_text"] for r in rows] == ["baker goat", None]
    assert rows[0]["output_tokens"] == 6


def test_peaks_are_the_engine_devices_not_the_gpu_nvml_sees(tmp_path, monkeypatch):
    """On a GPU host a run whose engine is not on CUDA (the dummy; `--device cpu`) is measured
    against this CPU's peaks, not the GPU's datasheet; telemetry still names the GPU."""
    from harness import telemetry
    from harness.run import RunArgs, execute
    from workloads.registry import WorkloadSpec

    cpu = _cpu_name()
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "hw.json").write_text(json.dumps({cpu: {"device_name": cpu, "measured_at": "M"}}))

    def fake_nvml(self):  # what NVML reports on an H200 host
        self.gpu_name, self.driver = "NVIDIA H200", "570.00"

    monkeypatch.setattr(telemetry.TelemetrySampler, "_open_nvml", fake_nvml)
    _, run = execute(RunArgs(WorkloadSpec("offline_batch", requests=2, input_tokens=4, output_tokens=2),
                             engine="dummy", output=str(tmp_path / "run"), quality=False))
    assert run["environment"]["gpu"] == "NVIDIA H200"
    assert run["environment"]["peaks"] == {"device_name": cpu, "measured_at": "M",
                                           "source": "measured by pwbench hw at M"}


def test_without_nvml_the_run_says_why(tmp_path):
    out = tmp_path / "run"
    proc = pwbench("run", "--engine", "dummy", "--workload", "offline_batch", "--requests", "5", "--output", str(out),
                   "--quiet", "--telemetry-hz", "50", env=cli_env(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr
    run = read_run(out)
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pytest.skip("this machine has NVML")
    except pynvml.NVMLError:
        pass
    assert "NVML unavailable" in run["telemetry"]["gpu_unavailable"]
    assert len(pd.read_parquet(out / "telemetry.parquet")) >= 1  # CPU series are still sampled


PROGRESS = re.compile(r"^run: (\d+)/(\d+) requests done, ")


def wait_for_line(proc: subprocess.Popen, pattern: re.Pattern | str, timeout: float = 120) -> str:
    """Read stderr lines until one matches (the run's plain progress lines: stderr is a pipe)."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if re.search(pattern, line):
            return line
    proc.kill()
    raise AssertionError(f"no line matching {pattern!r} on stderr; got {seen!r}")


def test_sigint_saves_an_interrupted_run(tmp_path):
    # 400 requests, 8 at a time, 20 steps of >= 5 ms each: >= 5 s of run. The run prints a
    # progress line each time another 40 requests finished: SIGINT after the first such line.
    out = tmp_path / "run"
    proc = popen("run", "--engine", "dummy", "--workload", "offline_batch", "--requests", "400", "--output-len", "20",
                 "--set", "base_ms=5", "--set", "max_num_seqs=8", "--output", str(out), env=cli_env(tmp_path / "cache"))
    wait_for_line(proc, r"^run: measuring 400 requests")
    done_at_signal = int(PROGRESS.match(wait_for_line(proc, PROGRESS)).group(1))
    assert done_at_signal >= 40
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "stopping: saving what was measured" in stderr and "Traceback" not in stderr
    run = read_run(out)
    assert run["status"] == "interrupted" and run["error"] is None
    rows = pd.read_parquet(out / "requests.parquet")
    finished = rows[rows["finish_s"].notna()]
    assert done_at_signal <= len(finished) < 400
    assert all(len(t) == 20 for t in finished["token_times_s"])
    assert set(rows.loc[rows["finish_s"].isna(), "error"]) <= {"interrupted"}
    assert run["summary"]["completed"] == len(finished)
    check_summary(out)
    assert no_partial_siblings(out)


def test_second_sigint_quits_at_once(tmp_path):
    # One step of the dummy takes 30 s: the first Ctrl-C can only stop the run after it; the
    # second quits at once (exit 130, "interrupted"), saving nothing and leaving no partial folder.
    # The "measuring" line comes just before the loop sends the requests and enters that step:
    # the 1 s grace covers those few statements (a Ctrl-C before the first step would end the
    # run at once, with nothing left for a second one to cut short); it is not a start-up guess.
    out = tmp_path / "run"
    proc = popen("run", "--engine", "dummy", "--workload", "offline_batch", "--requests", "4", "--warmup", "0",
                 "--set", "base_ms=30000", "--output", str(out), env=cli_env(tmp_path / "cache"))
    wait_for_line(proc, r"^run: measuring 4 requests")
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    wait_for_line(proc, r"^stopping: saving what was measured \(Ctrl-C again to quit at once\)")
    t = time.monotonic()
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - t < 15, "the second Ctrl-C waited for the 30 s step"
    assert proc.returncode == 130 and stderr.splitlines() == ["interrupted"], stderr
    assert not out.exists() and no_partial_siblings(out)


def test_engine_crash_mid_run_fails_the_run(tmp_path):
    # max_num_seqs 4, 3 tokens each: steps 1-3 serve r0-r3 (done after step 3), steps 4-5 give
    # r4-r7 two tokens; step 6 raises. r4-r9 were all sent at t=0 and never finished.
    out = tmp_path / "run"
    proc = pwbench("run", "--engine", "dummy", "--workload", "offline_batch", "--requests", "10", "--output-len", "3",
                   "--set", "max_num_seqs=4", "--set", "fail_after_steps=5", "--warmup", "0", "--output", str(out),
                   "--quiet", env=cli_env(tmp_path / "cache"))
    error = "RuntimeError: dummy engine: injected failure in step 6 (fail_after_steps=5)"
    assert_one_line_error(proc, 1, f"the run failed: {error}")
    assert "failed" in proc.stdout  # the summary table says so too
    run = read_run(out)
    assert run["status"] == "failed" and run["error"] == error and run["quality"] is None
    assert {p.name for p in out.iterdir()} == {"run.json", "requests.parquet", "steps.parquet", "telemetry.parquet"}
    rows = pd.read_parquet(out / "requests.parquet").set_index("request_id").sort_index()
    done = rows[rows["finish_s"].notna()]
    assert len(done) == 4 and all(len(t) == 3 for t in done["token_times_s"])
    assert (rows.loc[rows["finish_s"].isna(), "error"] == "not finished").sum() == 6
    assert sorted(rows.loc[rows["finish_s"].isna(), "output_tokens"]) == [0, 0, 2, 2, 2, 2]
    assert len(pd.read_parquet(out / "steps.parquet")) == 5
    _, expected = check_summary(out)
    assert expected["completed"] == 4 and expected["failed"] == 6
    assert no_partial_siblings(out)


def test_engine_crash_in_warmup_fails_the_run(tmp_path):
    out = tmp_path / "run"
    proc = pwbench("run", "--engine", "dummy", "--workload", "offline_batch", "--requests", "3", "--set",
                   "fail_after_steps=0", "--output", str(out), "--quiet", env=cli_env(tmp_path / "cache"))
    assert_one_line_error(proc, 1, "the run failed: warm-up: RuntimeError: dummy engine: injected failure in step 1")
    run = read_run(out)
    assert run["status"] == "failed" and run["error"].startswith("warm-up: RuntimeError")
    assert run["summary"]["completed"] == 0 and len(pd.read_parquet(out / "steps.parquet")) == 0


def test_a_crash_while_writing_leaves_no_folder(tmp_path):
    """run.json is written last into the hidden sibling: a failure there (after the parquet
    files) removes the sibling and never creates the result folder."""
    from harness.results import write_run

    out = tmp_path / "run"
    rows = [{"request_id": "r0", "arrival_s": 0.0}]
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_run(out, {"summary": object()}, rows, [], [])
    assert not out.exists() and list(tmp_path.iterdir()) == []
    write_run(out, {"summary": {"x": float("nan")}}, rows, [], [])  # NaN becomes null
    assert json.loads((out / "run.json").read_text()) == {"summary": {"x": None}} and no_partial_siblings(out)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--workload", "nope"], "workload='nope' is not valid"),
        (["--workload", "rag_long", "--slo", "ttft=3"], "--slo: unknown target 'ttft'"),
        (["--workload", "offline_batch", "--input-len", "x-y"], "--input-len: length range 'x-y'"),
        (["--engine", "nope"], "unknown engine 'nope'; valid engines: dummy"),
        (["--workload", "trace:/does/not/exist.jsonl"], "/does/not/exist.jsonl: no such file"),
        (["--workload", "offline_batch", "--set", "nokey=1"], "has no option 'nokey'"),
        (["--workload", "offline_batch", "--set", "max_num_seqs=many"], "expects int, got 'many'"),
    ],
)
def test_bad_options(args, fragment, tmp_path):
    engine = [] if "--engine" in args else ["--engine", "dummy"]
    proc = pwbench("run", *engine, *args, "--output", str(tmp_path / "x"), "--quiet")
    assert_one_line_error(proc, 2, fragment)
    assert not (tmp_path / "x").exists() and no_partial_siblings(tmp_path / "x")


def test_output_folder_must_be_new(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "file").write_text("x")
    proc = pwbench("run", "--engine", "dummy", "--workload", "offline_batch", "--requests", "2", "--output", str(out))
    assert_one_line_error(proc, 2, f"output folder {out} already exists and is not empty")
    assert [p.name for p in out.iterdir()] == ["file"]

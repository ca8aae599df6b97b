"""--simulate: the engines' real control code on the meta device and a virtual clock.

Control-plane exactness (issue 31's first acceptance line): an offline batch (every request
at t=0, so no decision depends on time) measured on the bundled model with its routing
recorded, then simulated on the `cpu` profile replaying that routing, takes the same
decisions step by step: KV capacity, batch composition, preemptions, prefix-cache hits, the
experts that ran, their bytes, the expert cache's hits and misses and the bytes it copied.
The oracle is the measured run itself. Sanity at scale: Mixtral-8x7B in bf16 does not fit one
H100 80 GB (engine moe refuses with the budget's claims), offload runs, and no step is
priced below the roofline of the bytes it reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engines.base import EngineError, EngineRequest
from engines.registry import create_engine

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "engines" / "demo_model")
MIXTRAL = str(ROOT / "engines" / "sim" / "presets" / "mixtral-8x7b")
# Per-step counters that are decisions (no wall time, no token values).
DECISIONS = ("num_prefill_tokens", "num_decode_tokens", "num_running", "num_waiting", "num_preempted",
             "cached_prompt_tokens", "experts_hit", "context_tokens", "weight_bytes_read", "h2d_bytes",
             "h2d_transfers", "d2h_bytes", "device_weight_bytes", "device_kv_bytes")
EXPERT_CACHE = ("expert_cache_hits", "expert_cache_misses")


def _requests() -> list[EngineRequest]:
    """Offline: shared leading blocks (prefix cache), lengths that force preemption in a small KV."""
    shared = [(7 * i) % 400 + 3 for i in range(48)]
    return [EngineRequest(f"r{i}", tuple(shared + [(11 * i + j) % 400 + 3 for j in range(10 + 7 * i)]), 12,
                          ignore_eos=True) for i in range(10)]


def _steps(engine) -> list[dict]:
    for r in _requests():
        engine.add_request(r)
    rows = []
    while engine.has_unfinished():
        out = engine.step()
        rows.append({**{k: getattr(out, k) for k in DECISIONS},
                     **{k: out.extras.get(k) for k in EXPERT_CACHE}})
    return rows


@pytest.mark.parametrize("name,options", [
    ("moe", {"kv_blocks": 12}),  # preemptions: 10 sequences of 60-130 tokens in 12 blocks of 16
    ("offload", {"experts_per_layer": 2, "budget_bytes": 6 << 20}),  # an expert cache of 2 of 4 slots
])
def test_simulated_offline_run_takes_the_measured_decisions(name, options, tmp_path):
    trace = tmp_path / "routing.parquet"
    measured = create_engine(name, {"model": DEMO, "device": "cpu", "record_routing": str(trace), **options})
    measured.start()
    try:
        want = _steps(measured)
        want_info = measured.info()
    finally:
        measured.stop()
    simulated = create_engine(name, {"model": DEMO, "simulate": "cpu", "routing": f"replay:{trace}", **options})
    simulated.start()
    try:
        got = _steps(simulated)
        info = simulated.info()
        replay = simulated.simulation.routing.describe()
    finally:
        simulated.stop()
    assert replay["replay_misses"] == 0 and replay["replay_hits"] > 0
    assert info.kv_capacity_tokens == want_info.kv_capacity_tokens
    assert info.weight_bytes == want_info.weight_bytes and info.kv_cache_bytes == want_info.kv_cache_bytes
    if name == "moe":  # the case exercises preemption and the prefix cache (recomputed blocks)
        assert any(s["num_preempted"] for s in want) and sum(s["cached_prompt_tokens"] for s in want) > 0
    else:  # and the expert cache's misses and copies
        assert sum(s["expert_cache_misses"] for s in want) > 0 and sum(s["h2d_bytes"] for s in want) > 0
    assert got == want
    assert info.device == "simulated cpu" and info.model_stats["sim_steps"] == len(want)
    assert simulated.virtual_clock.now() == pytest.approx(info.model_stats["sim_seconds"])


def test_mixtral_does_not_fit_one_h100_at_full_precision_and_offload_serves_it():
    """bf16 Mixtral-8x7B: 46.7B parameters, 93.4 GB, more than an 80 GB H100 (x 0.9)."""
    moe = create_engine("moe", {"model": MIXTRAL, "simulate": "h100-sxm"})
    with pytest.raises(EngineError, match=r"needs at least .*every routed expert .*engine offload"):
        moe.start()
    offload = create_engine("offload", {"model": MIXTRAL, "simulate": "h100-sxm", "routing": "uniform"})
    offload.start()
    try:
        assert offload.info().weight_bytes <= 0.9 * 80e9
        for i in range(4):
            offload.add_request(EngineRequest(f"r{i}", tuple(range(1, 300)), 8, ignore_eos=True))
        executor, steps = offload.simulation.executor, 0
        while offload.has_unfinished():
            out = offload.step()
            steps += 1
            cost = executor.last
            # The step reads its dense weights and the experts that ran: never faster than HBM allows.
            floor = out.weight_bytes_read / offload.simulation.profile.memory_bytes_per_s
            assert cost.seconds >= cost.roofline_s >= floor * (1 - 1e-9)
        assert steps >= 8 and offload.virtual_clock.now() > 0
    finally:
        offload.stop()


def _pwbench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_pwbench_run_simulated_writes_a_marked_result_folder(tmp_path):
    out = tmp_path / "sim"
    done = _pwbench("run", "--workload", "rag_long", "--engine", "offload", "--model", "mixtral-8x7b", "--simulate",
                    "h100-sxm", "--requests", "12", "--rate", "2", "--warmup", "0", "--quiet", "--output", str(out))
    assert done.returncode == 0, done.stderr
    run = json.loads((out / "run.json").read_text())
    sim = run["simulated"]
    assert sim["hardware"] == "h100-sxm" and sim["cost_model_version"] and sim["routing"]["kind"] == "synthetic"
    assert run["engine"]["device"] == "simulated h100-sxm" and run["summary"]["completed"] == 12
    assert run["quality"] is None  # quality is never simulated


@pytest.mark.parametrize("args,message", [
    pytest.param(("--simulate", "h900"), "unknown hardware profile 'h900'", marks=pytest.mark.slow),
    (("--routing", "uniform"), "--routing chooses a simulated run's expert choices"),
    pytest.param(("--simulate", "h100-sxm", "--routing", "zipf"), "routing spec 'zipf'", marks=pytest.mark.slow),
])
def test_bad_simulate_options_are_one_line_errors(args, message, tmp_path):
    done = _pwbench("run", "--workload", "rag_long", "--engine", "moe", "--requests", "2", "--quiet",
                    "--output", str(tmp_path / "x"), *args)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr

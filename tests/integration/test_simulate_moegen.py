"""--simulate for engine moegen: the real plan, the streaming ring and the layer-major
executor's copies on the meta device, priced by moegen's own cost model.

Control-plane exactness: an offline batch on the bundled model, its routing recorded by a
measured `moe` run (record_routing needs the flat executor; moegen computes `moe`'s tokens,
so the routing per (request, position) is the same: the replay must have no miss), is
simulated on the `cpu` profile with that routing replayed; a measured moegen run given the
simulated run's plan is the oracle: the same plan, KV capacity and, step by step, the same
batch, preemptions, experts that ran, bytes and transfers each way, device bytes. The plan
itself is checked against the planner called directly with the profile's hardware. At
scale: Mixtral-8x7B on one H100 SXM under a 60 GB budget starts, plans to stream experts,
serves requests, and no step is priced below the roofline of the bytes it reads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import CPU32

from engines.base import EngineRequest
from engines.moegen.plan import loaded_shape, make_plan
from engines.moegen.simulate import sim_hardware
from engines.registry import create_engine

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "engines" / "demo_model")
MIXTRAL = str(ROOT / "engines" / "sim" / "presets" / "mixtral-8x7b")
DEMO_EXPERT = 3 * 128 * 64 * 4  # 98,304 bytes: one demo expert in float32
DEMO_DENSE = 967_680
DECISIONS = ("num_prefill_tokens", "num_decode_tokens", "num_running", "num_waiting", "num_preempted",
             "cached_prompt_tokens", "experts_hit", "context_tokens", "weight_bytes_read", "h2d_bytes",
             "h2d_transfers", "d2h_bytes", "d2h_transfers", "device_weight_bytes", "device_kv_bytes")
RING = ("streamed_experts", "streamed_unused")
PLAN = ("kv_placement", "batch_seqs", "micro_batch", "expert_slots", "resident_experts", "staging_bytes",
        "host_share")


def _requests(n: int = 8) -> list[EngineRequest]:
    """Distinct prompts (no prefix-cache hit: every position is computed in both engines) and
    output lengths that leave the last steps with 1-2 sequences (T x top_k < E: copies wait
    for the router) after steps where every expert is queued a layer ahead."""
    return [EngineRequest(f"r{i}", tuple((13 * i + 7 * j) % 1000 + 3 for j in range(18 + 5 * i)), 3 + i,
                          ignore_eos=True) for i in range(n)]


def _steps(engine, reqs) -> list[dict]:
    for r in reqs:
        engine.add_request(r)
    rows = []
    while engine.has_unfinished():
        out = engine.step()
        rows.append({**{k: getattr(out, k) for k in DECISIONS}, **{k: out.extras.get(k) for k in RING}})
    return rows


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("routing") / "routing.parquet"
    moe = create_engine("moe", {"model": DEMO, **CPU32, "record_routing": str(path)})
    moe.start()
    try:
        _steps(moe, _requests())
    finally:
        moe.stop()
    return path


CASES = [
    # The plan's own choice: 3 experts of room beside the dense weights -> host KV, a ring and residents.
    {"budget_bytes": DEMO_DENSE + 3 * DEMO_EXPERT},
    pytest.param({"budget_bytes": 4 << 20, "kv_placement": "host", "micro_batch": 3, "expert_slots": 2,
                  "resident_experts": 1}, marks=pytest.mark.slow),
    pytest.param({"budget_bytes": 4 << 20, "kv_placement": "device", "expert_slots": 1, "resident_experts": 0},
                 marks=pytest.mark.slow),
    # KV streamed into a staging buffer cut into parts (a half of 8 blocks: decode runs are cut further)
    {"budget_bytes": 8 << 20, "kv_placement": "stream", "micro_batch": 4, "plan_context": 16, "max_model_len": 128,
     "expert_slots": 3, "resident_experts": 1},
    pytest.param({"budget_bytes": 8 << 20, "kv_placement": "split", "host_share": 0.5, "micro_batch": 2,
                  "max_model_len": 256, "expert_slots": 2, "resident_experts": 0}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("options", CASES)
def test_simulated_moegen_takes_the_measured_decisions(options, trace):
    opts = {"host_kv_gb": 0.01, **options}
    simulated = create_engine("moegen", {"model": DEMO, "simulate": "cpu", "routing": f"replay:{trace}", **opts})
    simulated.start()
    try:
        plan, sim = simulated.plan, simulated.simulation
        # The plan is the planner's for the profile's machine (the oracle: make_plan called directly).
        shape = loaded_shape(simulated.loaded, DEMO_EXPERT, "moegen")
        hw = sim_hardware(sim.profile, "float32", shape, True, simulated.config.plan_context)
        want_plan = make_plan(simulated.config, shape, hw, simulated.checkpoint.config.max_position_embeddings)
        got = _steps(simulated, _requests())
        info = simulated.info()
        replay = sim.routing.describe()
        executor = simulated.executor
    finally:
        simulated.stop()
    assert [getattr(plan, k) for k in PLAN] == [getattr(want_plan, k) for k in PLAN]
    assert replay["replay_misses"] == 0 and replay["replay_hits"] > 0
    # The measured engine runs the simulated run's plan (its peaks are this machine's, not the profile's).
    fixed = {"kv_placement": plan.kv_placement, "micro_batch": plan.micro_batch, "expert_slots": plan.expert_slots,
             "resident_experts": plan.resident_experts}
    if plan.kv_placement == "split":
        fixed["host_share"] = plan.host_share
    measured = create_engine("moegen", {"model": DEMO, **CPU32, **opts, **fixed})
    measured.start()
    try:
        measured_plan = measured.plan
        want = _steps(measured, _requests())
        want_info = measured.info()
    finally:
        measured.stop()
    assert [getattr(measured_plan, k) for k in PLAN] == [getattr(plan, k) for k in PLAN]
    assert info.kv_capacity_tokens == want_info.kv_capacity_tokens
    assert info.weight_bytes == want_info.weight_bytes and info.kv_cache_bytes == want_info.kv_cache_bytes
    # The case streams experts and (but for device placement) moves KV or activations across the link.
    assert sum(s["streamed_experts"] for s in want) > 0 and sum(s["h2d_bytes"] for s in want) > 0
    if plan.kv_placement != "device":
        assert sum(s["d2h_bytes"] for s in want) > 0
    assert got == want
    assert info.device == "simulated cpu" and info.model_stats["sim_steps"] == len(want)
    assert simulated.virtual_clock.now() == pytest.approx(info.model_stats["sim_seconds"])
    assert executor.totals.seconds >= executor.totals.roofline_s > 0


def test_mixtral_on_one_h100_streams_experts_under_a_60gb_budget():
    engine = create_engine("moegen", {"model": MIXTRAL, "simulate": "h100-sxm", "routing": "uniform",
                                      "budget_bytes": 60 * 10**9, "max_num_seqs": 16})
    engine.start()
    try:
        plan, profile = engine.plan, engine.simulation.profile
        info = engine.info()
        total = 32 * 8
        assert 0 < plan.resident_experts < total and plan.expert_slots > 0  # 93 GB of weights in 60 GB
        assert info.weight_bytes <= 60 * 10**9
        for i in range(6):
            engine.add_request(EngineRequest(f"r{i}", tuple(range(1 + i, 200 + 37 * i)), 6, ignore_eos=True))
        executor, steps = engine.executor, 0
        while engine.has_unfinished():
            out = engine.step()
            steps += 1
            cost = executor.last
            floor = out.weight_bytes_read / profile.memory_bytes_per_s
            assert cost.seconds >= cost.roofline_s >= floor * (1 - 1e-9)
            # The experts and activations the step copied cross the link in the price (at most its pinned rate).
            assert cost.parts["link_busy"] >= out.h2d_bytes / profile.link_pinned_bytes_per_s * (1 - 1e-9)
            assert out.h2d_bytes > 0
            assert out.device_weight_bytes + out.device_kv_bytes <= 60 * 10**9
        assert steps >= 6 and engine.virtual_clock.now() > 0
        assert engine.info().model_stats["sim_steps"] == steps
    finally:
        engine.stop()

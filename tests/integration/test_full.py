"""Engine `full`: pagedweight's per-expert bit widths under moegen's module-based batching.

Oracles: the `moe` engine's greedy and seeded tokens (a budget that holds every expert at 16
bits: the paged backend under the layer-major executor must compute exactly what `moe` does);
the budget itself, checked after every step; each expert's quality floor, derived by hand from
the measured sensitivities; the bytes of each on-demand fetch from the expert's own store;
engine `pagedweight`, which refuses the budgets `full` runs.
"""

from __future__ import annotations

import pytest
from engine_runs import generate, random_requests
from tiny_models import ARCHS, CPU32

from engines.base import EngineError, SamplingParams
from harness.calibration import create_calibrated
from harness.offline import run_offline

DEMO = "engines/demo_model"
DEMO_DENSE = 967_680
DEMO_EXPERTS = 8 * 3 * 128 * 64 * 4  # 8 routed experts (2 MoE layers x 4) in float32: 786,432 bytes
ROOMY = 64 << 20
SMALL_HOST_KV = {"host_kv_gb": 0.01}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path / "cache"))


def requests(vocab: int, n: int = 6, new: int = 10, **kw):
    return random_requests(vocab, n, new, lo=10, hi=90, **kw)


# Expert input widths the 32-wide quantization groups divide (the tiny models' odd 40 and 48 do not).
GROUPABLE = {"qwen2_moe": {"moe_intermediate_size": 64}, "qwen3_moe": {"moe_intermediate_size": 64},
             "glm4_moe": {"moe_intermediate_size": 64}, "olmoe": {"intermediate_size": 64}}


@pytest.mark.parametrize("arch", [  # qwen3_moe in the default run (~5 s); the others take 25-55 s each
    *(a if a == "qwen3_moe" else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS),
    pytest.param("demo", marks=pytest.mark.slow)])
def test_full_precision_budget_gives_moes_greedy_tokens(arch, checkpoints):
    model = DEMO if arch == "demo" else checkpoints(arch, **GROUPABLE.get(arch, {}))
    reqs = requests(1109 if arch == "demo" else 257)
    expected, _, _ = generate("moe", model, reqs)
    for case in ({"kv_placement": "host", **SMALL_HOST_KV, "micro_batch": 2},
                 {"kv_placement": "device", "max_num_batched_tokens": 64},
                 {"kv_placement": "stream", **SMALL_HOST_KV, "micro_batch": 2, "max_model_len": 128},
                 {"kv_placement": "split", **SMALL_HOST_KV, "host_share": 0.5, "max_model_len": 128},
                 {}):  # the plan's own choice
        got, steps, info = generate("full", model, reqs, budget_bytes=ROOMY, **case)
        assert got == expected, (arch, case)
        assert all(s.extras["mean_bits"] == 16 and s.extras["demotions"] == 0 for s in steps), (arch, case)
        if case.get("kv_placement") == "host":
            assert all(s.device_kv_bytes == 0 for s in steps)
        if case.get("kv_placement") in ("host", "stream", "split"):
            assert info.model_stats["plan_kv_on_host"] == 1


@pytest.mark.slow  # the demo model twice (~18 s on 2 cores); greedy parity stays via qwen3_moe above
def test_no_budget_means_the_whole_device_and_full_precision():
    reqs = requests(1109, n=4)
    expected, _, moe = generate("moe", DEMO, reqs)
    got, steps, info = generate("full", DEMO, reqs)
    assert got == expected
    # every weight at full precision + the KV pool moe sizes by default
    assert info.device_budget_bytes == DEMO_DENSE + DEMO_EXPERTS + moe.kv_cache_bytes
    assert all(s.extras["mean_bits"] == 16 for s in steps)


@pytest.mark.slow  # the demo model twice (~17 s on 2 cores)
def test_seeded_sampling_matches_moe():
    reqs = requests(1109, n=4, new=12, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=7))
    expected, _, _ = generate("moe", DEMO, reqs)
    got, _, _ = generate("full", DEMO, reqs, budget_bytes=ROOMY, kv_placement="host", **SMALL_HOST_KV)
    assert got == expected


@pytest.mark.slow  # three budgets per placement on the demo model (23-30 s each on 2 cores)
@pytest.mark.parametrize("placement", ["host", "device", "stream"])
def test_below_full_precision_the_budget_holds_and_no_expert_sits_below_its_quality_floor(placement):
    """Budgets from a half of the experts down to less than every expert at its floor: after
    every step the device holds at most the budget (dense + pages + staging slots + KV blocks),
    and every expert on the device is at or above the lowest width whose measured error is
    within max_expert_error (derived here from the engine's own sensitivity table)."""
    reqs = requests(1109, n=8, new=8)
    # device KV needs room for the plan's sequence; stream a staging buffer of 2 x 8 blocks of a layer
    kv = {"device": 1_200_000, "stream": 2 * 8 * 16 * 512}.get(placement, 0)
    for share in (0.5, 0.15, 0.06):  # 0.06: below every expert at its (>= 4-bit) floor
        budget = DEMO_DENSE + int(share * DEMO_EXPERTS) + kv
        engine = create_calibrated("full", {"model": DEMO, **CPU32, "budget_bytes": budget, "kv_placement": placement,
                                            **SMALL_HOST_KV, "max_model_len": 128, "micro_batch": 1})
        engine.start()
        steps, bits_seen = [], []
        try:
            def on_step(s, engine=engine):
                steps.append(s)
                bits_seen.append({k: engine.experts.bits(k) for k in engine.experts.stores})
            done = run_offline(engine, reqs, on_step=on_step)
            sens, bound, widths = engine.paged.sensitivity, engine.config.max_expert_error, engine.paged.bit_widths
        finally:
            engine.stop()
        assert len(done) == len(reqs) and all(c.finish_reason == "length" for c in done.values())
        assert all(s.device_weight_bytes + s.device_kv_bytes <= budget for s in steps), (placement, share)
        floors = {k: min(b for b in widths if b == 16 or sens[k][b] <= bound) for k in sens}
        for held in bits_seen:
            assert all(b == 0 or b >= floors[k] for k, b in held.items()), (placement, share)
        if share == 0.06 and placement != "device":  # less than every expert at its floor: some leave
            assert sum(s.extras["on_demand_fetches"] for s in steps) > 0


def test_an_expert_that_left_the_device_crosses_once_per_layer_step_at_its_quality_floor():
    """A budget with room for no expert page beside the staging slot: every routed expert is
    fetched when its layer runs, once per step for all the tokens routed to it (module-based
    batching), so each step's h2d bytes are the fetched experts' floor-width bytes (from their
    own stores) plus the activations host attention sends back up."""
    reqs = requests(1109, n=6, new=5)
    engine = create_calibrated("full", {"model": DEMO, **CPU32, "kv_placement": "host", **SMALL_HOST_KV,
                                        "budget_bytes": DEMO_DENSE + 1})
    with pytest.raises(EngineError, match=r"too small for engine full.*a staging slot for one expert"):
        engine.start()
    probe = create_calibrated("full", {"model": DEMO, **CPU32, "kv_placement": "host", **SMALL_HOST_KV,
                                       "budget_bytes": ROOMY})
    probe.start()
    try:
        staging = probe.experts.staging_slot_bytes()  # one: copies are memcpys at issue without a link model
        fetch = {k: probe.experts.stores[k].transfer_bytes(0, probe.paged.quality[k]) for k in probe.experts.stores}
    finally:
        probe.stop()
    engine = create_calibrated("full", {"model": DEMO, **CPU32, "kv_placement": "host", **SMALL_HOST_KV,
                                        "budget_bytes": DEMO_DENSE + staging})
    engine.start()
    routed: list[set] = []
    steps = []
    try:
        backend = engine.experts
        inner = backend.forward

        def forward(layer, x, d):
            routed[-1].update((layer, e) for e in d.active)
            return inner(layer, x, d)
        backend.forward = forward

        def on_step(s):
            steps.append(s)
            routed.append(set())
        routed.append(set())
        run_offline(engine, reqs, on_step=on_step)
    finally:
        engine.stop()
    q_size = 128
    for s, keys in zip(steps, routed):
        tokens = s.num_prefill_tokens + s.num_decode_tokens
        assert s.extras["on_demand_fetches"] == len(keys)
        assert s.h2d_bytes == sum(fetch[k] for k in keys) + 2 * tokens * q_size * 4
        assert s.device_weight_bytes == DEMO_DENSE + staging


def test_with_the_link_model_experts_that_left_are_fetched_through_two_slots():
    """With the CPU link model copies run on the link's thread: experts that left the device
    are fetched into two staging slots (normal tensors the thread may write: once they were
    inference tensors and such a run failed), both inside the budget at every step."""
    reqs = requests(1109, n=6, new=6)
    budget = DEMO_DENSE + int(0.08 * DEMO_EXPERTS)
    got, steps, info = generate("full", DEMO, reqs, budget_bytes=budget, kv_placement="host", link_gbps=25,
                                **SMALL_HOST_KV)
    assert all(len(t) == 6 for t in got.values())
    assert sum(s.extras["on_demand_fetches"] for s in steps) > 0
    assert info.model_stats["plan_expert_slots"] == 2
    assert all(s.device_weight_bytes <= budget for s in steps)


@pytest.mark.slow  # kept under the README's ~12 min; CI's slow step runs it
def test_full_runs_a_budget_pagedweight_refuses():
    budget = DEMO_DENSE + int(0.06 * DEMO_EXPERTS) + 20_000  # below every expert at its 4-bit floor + KV
    with pytest.raises(EngineError, match="too small for engine pagedweight"):
        create_calibrated("pagedweight", {"model": DEMO, **CPU32, "budget_bytes": budget}).start()
    reqs = requests(1109, n=4, new=4)
    got, steps, _ = generate("full", DEMO, reqs, budget_bytes=budget, **SMALL_HOST_KV)
    assert len(got) == 4 and all(len(v) == 4 for v in got.values())
    assert all(s.device_weight_bytes + s.device_kv_bytes <= budget for s in steps)


def test_bad_options_are_one_line_errors():
    for options, match in (({"kv_placement": "gpu"}, "engine full: kv_placement must be one of auto"),
                           ({"expert_bits": 4}, "engine full pages its own expert precisions"),
                           ({"representation": "nope"}, "engine full: representation must be one of")):
        engine = create_calibrated("full", {"model": DEMO, **CPU32, "budget_bytes": ROOMY, **options})
        with pytest.raises(EngineError, match=match) as err:
            engine.start()
        assert "\n" not in str(err.value)

"""Engine `offload` and the device budget.

Oracles: the `moe` engine's greedy tokens (same model, experts resident); transformers' own
router logits for which experts each step needs, replayed through a cache simulation written
here for the transfer counters; bytes / bandwidth for the link model.
"""

from __future__ import annotations

import pytest
import torch
from engine_runs import generate, random_requests
from tiny_models import ARCHS, CPU32, build_hf_model

from engines.base import EngineError, EngineRequest
from engines.registry import create_engine
from engines.runtime.checkpoint import open_checkpoint

DEMO = "engines/demo_model"
MOE_LAYERS = 2  # every test model has two MoE layers (qwen2_moe: layers 0 and 2; deepseek_v3, glm4_moe: 1, 2)


requests = random_requests


def total(steps, key: str) -> int:
    return sum(s.extras.get(key, 0) for s in steps)


# gpt-oss: tests/integration/test_biased_experts.py, on a variant whose routing reaches every
# expert (the tiny checkpoint's large attention biases send every token to the same two).
@pytest.mark.parametrize("arch", [*(a for a in ARCHS if a != "gpt_oss"), "demo"])
def test_offload_gives_the_same_greedy_tokens_as_moe(arch, checkpoints):
    model = DEMO if arch == "demo" else checkpoints(arch)
    reqs = requests(1109 if arch == "demo" else 257)
    expected, _, info = generate("moe", model, reqs)
    experts = 4 if arch == "demo" else open_checkpoint(model).config.num_experts
    for case in ({"experts_per_layer": 1}, {"experts_per_layer": 2, "policy": "lfu"},
                 {"experts_per_layer": min(experts - 1, 5), "prefetch": True}, {"experts_per_layer": experts}):
        got, steps, info = generate("offload", model, reqs, **case)
        assert got == expected, (arch, case)
        misses = total(steps, "expert_cache_misses")
        if case["experts_per_layer"] < experts:  # evictions: more misses than the slots to fill
            assert misses > MOE_LAYERS * case["experts_per_layer"]
        assert total(steps, "expert_cache_hits") > 0


def test_offload_at_any_budget_keeps_within_it_and_serves_every_request():
    """Budgets from the minimum up to everything resident: same tokens as moe, and after every
    step device weights + KV blocks <= budget; when KV runs short requests wait or are preempted."""
    reqs = requests(1109, n=8, new=24, lo=40, hi=160)
    expected, _, _ = generate("moe", DEMO, reqs)
    probe = create_engine("offload", {"model": DEMO, **CPU32, "experts_per_layer": 1})
    probe.start()
    minimum = sum(n for _, n in probe.budget.parts())
    probe.stop()
    preempted = 0
    for budget in (minimum + 16 * 16384, minimum + 400_000, minimum + 1_500_000, 6 << 20):
        got, steps, info = generate("offload", DEMO, reqs, budget_bytes=budget)
        assert got == expected, budget
        assert info.device_budget_bytes == budget
        for s in steps:
            assert s.device_weight_bytes + s.device_kv_bytes <= budget
            assert s.device_kv_bytes > 0 or s.num_running == 0
        preempted += sum(s.num_preempted for s in steps)
    assert preempted > 0  # the smallest budget made requests wait for KV (not vacuous)


@pytest.mark.parametrize("budget", [2_000_000, 2_400_000, 4 << 20])
def test_moe_under_a_budget_keeps_within_it(budget):
    reqs = requests(1109, n=8, new=24, lo=40, hi=160)
    expected, _, _ = generate("moe", DEMO, reqs)
    got, steps, info = generate("moe", DEMO, reqs, budget_bytes=budget)
    assert got == expected
    assert info.kv_cache_bytes + info.weight_bytes <= budget
    assert all(s.device_weight_bytes + s.device_kv_bytes <= budget for s in steps)
    assert max(s.device_kv_bytes for s in steps) > 0


def test_a_budget_below_the_minimum_is_an_error_that_states_it():
    probe = create_engine("offload", {"model": DEMO, **CPU32, "experts_per_layer": 1})
    probe.start()
    parts = probe.budget.parts()
    probe.stop()
    minimum = sum(n for _, n in parts)
    engine = create_engine("offload", {"model": DEMO, **CPU32, "budget_bytes": minimum - 1})
    with pytest.raises(EngineError,
                       match=rf"at least .* \({minimum} bytes\) = dense weights .* \+ one expert per MoE layer"):
        engine.start()
    engine = create_engine("offload", {"model": DEMO, **CPU32, "budget_bytes": minimum})
    engine.start()  # exactly the minimum serves
    engine.stop()
    with pytest.raises(EngineError, match="does not manage device memory"):
        create_engine("hf", {"model": DEMO, "budget_bytes": 1 << 30})


# -- transfer accounting by hand ------------------------------------------------------------------

def routed_experts(model, ids: list[int]) -> list[list[set[int]]]:
    """transformers' router: per position, per MoE layer, the experts it picks (top-k)."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return [[set(torch.topk(logits[p], k).indices.tolist()) for logits in out.router_logits] for p in range(len(ids))]


def simulate(schedule: list[list[set[int]]], slots: int, policy: str) -> int:
    """Misses of a per-layer cache of `slots` experts over `schedule` (per step, per layer, the
    experts needed; never more than `slots`). A miss takes a free slot, else evicts among
    experts this layer does not need now: lru the least recently used, lfu the least used
    (ties: least recent, then lowest id). Every expert that runs counts as one use at that
    layer call; the order of layer calls is the clock."""
    layers = len(schedule[0])
    resident = [set() for _ in range(layers)]
    last = [dict() for _ in range(layers)]
    uses = [dict() for _ in range(layers)]
    misses, clock = 0, 0
    for step in schedule:
        for i, need in enumerate(step):
            clock += 1
            for e in sorted(need - resident[i]):
                misses += 1
                if len(resident[i]) == slots:
                    evictable = resident[i] - need
                    key = (lambda x: (last[i][x], x)) if policy == "lru" else (lambda x: (uses[i][x], last[i][x], x))
                    resident[i].discard(min(evictable, key=key))
                resident[i].add(e)
            for e in need:
                last[i][e] = clock
                uses[i][e] = uses[i].get(e, 0) + 1
    return misses


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_transfer_counters_match_a_hand_simulation(policy, checkpoints):
    """One request with a one-token prompt, so every step runs one token: each layer needs
    top_k = 2 experts of 6 and holds 3. Expected bytes = misses x (gate_up + down bytes)."""
    model = build_hf_model("mixtral")
    folder = checkpoints("mixtral")
    new = 24
    reqs = [EngineRequest("r", (11,), new, ignore_eos=True)]
    tokens, steps, info = generate("offload", folder, reqs, experts_per_layer=3, policy=policy)
    ids = [11, *tokens["r"]]
    schedule = routed_experts(model, ids)[:new]  # step t runs position t
    misses = simulate(schedule, 3, policy)
    cfg = model.config
    per_expert = 3 * cfg.hidden_size * cfg.intermediate_size * 4
    assert info.model_stats["bytes_per_expert"] == per_expert
    assert total(steps, "expert_cache_misses") == misses
    assert sum(s.h2d_bytes for s in steps) == misses * per_expert
    assert sum(s.h2d_transfers for s in steps) == 2 * misses  # gate_up and down per expert
    assert total(steps, "expert_cache_hits") + misses == 2 * 2 * new  # uses: layers x top_k x steps
    assert misses > 2 * 3  # more than the first fills: evictions happened
    again = generate("offload", folder, reqs, experts_per_layer=3, policy=policy)[1]
    assert [s.h2d_bytes for s in again] == [s.h2d_bytes for s in steps]  # same schedule, same counters


def test_prefetch_counters_are_deterministic_and_counted():
    reqs = requests(1109, n=4, new=12)
    runs = [generate("offload", DEMO, reqs, experts_per_layer=2, prefetch=True)[1] for _ in range(2)]
    key = [(s.h2d_bytes, dict(s.extras)) for s in runs[0]]
    assert key == [(s.h2d_bytes, dict(s.extras)) for s in runs[1]]
    issued = total(runs[0], "prefetch_issued")
    assert issued > 0 and 0 <= total(runs[0], "prefetch_used") <= issued
    misses = total(runs[0], "expert_cache_misses")
    assert sum(s.h2d_bytes for s in runs[0]) == (misses + issued) * 98_304  # 3 x 128 x 64 x 4 bytes


# -- the link model ---------------------------------------------------------------------------------

@pytest.mark.slow  # seconds of modelled copies per case (11-13 s each on 2 cores); moegen's link test stays fast
@pytest.mark.parametrize("prefetch", [False, True])
def test_a_slower_link_adds_the_stall_the_engine_reports(prefetch):
    """Copies on a modelled link take bytes / bandwidth; compute overlaps part of it. The step
    time grows by the link time minus the overlap the engine reports (its stall), within
    timer noise: tolerances are 20% + 40 ms over ~3 s of copying."""
    reqs = requests(1109, n=1, new=4, lo=20, hi=40)
    options = {"experts_per_layer": 1, "prefetch": prefetch}

    def timed(**extra):
        import time

        engine = create_engine("offload", {"model": DEMO, **CPU32, **options, **extra})
        engine.start()
        durations, steps = [], []
        for r in reqs:
            engine.add_request(r)
        while engine.has_unfinished():
            t0 = time.perf_counter()
            steps.append(engine.step())
            durations.append(time.perf_counter() - t0)
        engine.stop()
        return sum(durations), steps

    gbps = 0.0005  # 98 KB per expert -> 197 ms per copy: long against a thread's wake-up lateness
    timed()  # warm-up: the first run pays for allocations and kernel selection
    # A loaded machine only ever adds time (late thread wake-ups make the link look slower,
    # a busy core the compute): the fastest of three interleaved runs of each is compared.
    runs = [(timed(), timed(link_gbps=gbps)) for _ in range(3)]
    base, base_steps = min((r[0] for r in runs), key=lambda r: r[0])
    slow, steps = min((r[1] for r in runs), key=lambda r: r[0])
    h2d = sum(s.h2d_bytes for s in steps)
    busy = sum(s.copy_busy_s for s in steps)
    stall = sum(s.copy_stall_s for s in steps)
    overlap = max(0.0, busy - stall)  # what the engine reports as hidden behind compute
    predicted = h2d / (gbps * 1e9) - overlap
    assert h2d == sum(s.h2d_bytes for s in base_steps)  # the link changes time, not decisions
    assert busy == pytest.approx(h2d / (gbps * 1e9), rel=1e-6)
    assert 0 < stall <= busy + 0.05 * len(steps)
    assert slow - base == pytest.approx(stall, rel=0.2, abs=0.04)  # the growth is the reported stall
    assert slow - base == pytest.approx(predicted, rel=0.2, abs=0.04)

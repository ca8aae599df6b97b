"""The moegen cost model and its plan, with given hardware numbers (no model, no torch).

Oracles: module times computed by hand from the roofline (bytes / bandwidth vs FLOPs / rate);
the direction a plan must move when the budget, the link or the batch changes.
"""

from __future__ import annotations

import dataclasses

import pytest

from engines.modbatch.cost import KV_READS, Hardware, ModelShape, Plan, Workload, candidate_plans, choose_plan, step_cost

MB = 1 << 20
# Mixtral-8x7B-like in bf16: 32 layers x 8 experts of 3 x 4096 x 14336 x 2 bytes (352 MB).
MIXTRAL = ModelShape(layers=32, moe_layers=32, experts=8, top_k=2, hidden=4096, q_size=4096, kv_size=1024, heads=32,
                     head_dim=128, intermediate=14336, vocab=32000, dense_bytes=3_200 * MB, layer_dense_bytes=90 * MB,
                     head_bytes=250 * MB, expert_bytes=3 * 4096 * 14336 * 2, kv_bytes_per_token=2 * 32 * 1024 * 2,
                     dtype_bytes=2)
H200 = Hardware(device_bytes_per_s=4.8e12, device_flops_per_s=790e12, host_bytes_per_s=200e9, host_flops_per_s=2e12,
                link_bytes_per_s=55e9)
BLOCK = 16 * MIXTRAL.kv_bytes_per_token


def test_one_layer_by_hand():
    """A one-layer toy, every number chosen so each module's roofline side is known."""
    shape = ModelShape(layers=1, moe_layers=1, experts=4, top_k=2, hidden=100, q_size=100, kv_size=50, heads=2,
                       head_dim=50, intermediate=200, vocab=1000, dense_bytes=10_000, layer_dense_bytes=1_000,
                       head_bytes=4_000, expert_bytes=1_000_000, kv_bytes_per_token=400, dtype_bytes=4)
    hw = Hardware(device_bytes_per_s=1e9, device_flops_per_s=1e12, host_bytes_per_s=1e9, host_flops_per_s=1e12,
                  link_bytes_per_s=1e8)
    plan = Plan("device", 10, 10, expert_slots=4, resident_experts=0, device_kv_bytes=0)
    c = step_cost(shape, hw, plan, decode_seqs=10, prefill_tokens=0, decode_context=10 * 50, prefill_context=0)
    dense = max(1_000 / 1e9, 2 * 10 * 100 * (2 * 100 + 2 * 50) / 1e12)  # 1 us (bytes)
    attention = max(KV_READS * 500 * 400 / 1e9, 4 * 2 * 50 * 500 / 1e12)  # 600 us (bytes)
    experts = max(4 * 1e6 / 1e9, 10 * 2 * 6 * 100 * 200 / 1e12)  # 4 ms (bytes: 4 experts)
    link = 4 * 1e6 / 1e8  # 40 ms: every expert streams
    head = max(4_000 / 1e9, 2 * 10 * 100 * 1000 / 1e12)
    assert c.compute_s == pytest.approx(dense + attention + experts + head)
    assert c.link_s == pytest.approx(link)
    assert c.total_s == pytest.approx(max(dense + attention + experts, link) + head)  # link-bound
    assert c.h2d_bytes == 4 * 1_000_000


TWO = ("device", "host")  # the placements of the tests below (stream/split move KV bytes too: tested further down)


def test_more_budget_keeps_more_experts_resident_and_moves_fewer_bytes():
    work = Workload(seqs=512, context=1500)
    previous = None
    for gb in (12, 20, 40, 80, 130):
        plan = choose_plan(MIXTRAL, H200, gb << 30, work, BLOCK, placements=TWO)
        if previous is not None:
            assert plan.resident_experts >= previous.resident_experts
            assert plan.predicted.h2d_bytes <= previous.predicted.h2d_bytes
            assert plan.tokens_per_s >= previous.tokens_per_s * 0.999
        previous = plan
    assert previous.resident_experts == MIXTRAL.total_experts and previous.predicted.h2d_bytes == 0


def test_kv_goes_to_the_host_when_the_device_cannot_hold_the_batch():
    work = Workload(seqs=512, context=4000)  # 512 x 4000 x 128 KiB = 250 GiB of KV
    tight = choose_plan(MIXTRAL, H200, 40 << 30, work, BLOCK, placements=TWO)
    assert tight.kv_placement == "host" and tight.batch_seqs == 512
    # With every placement the KV still stays in the host tier (host, stream or split).
    assert choose_plan(MIXTRAL, H200, 40 << 30, work, BLOCK).kv_placement != "device"
    small = Workload(seqs=8, context=512)  # 0.5 GiB of KV
    roomy = choose_plan(MIXTRAL, H200, 130 << 30, small, BLOCK)
    assert roomy.kv_placement == "device" and roomy.batch_seqs == 8 and roomy.device_kv_bytes > 0


def test_link_bound_memory_bound_and_compute_bound_regimes():
    plan = Plan("device", 256, 256, expert_slots=16, resident_experts=0, device_kv_bytes=0)
    slow = dataclasses.replace(H200, link_bytes_per_s=5e9)
    c = step_cost(MIXTRAL, slow, plan, 256, 0, 256 * 1000, 0)
    assert c.total_s == pytest.approx(c.link_s + (c.total_s - c.link_s), rel=1e-9) and c.link_s > 5 * c.compute_s
    resident = dataclasses.replace(plan, expert_slots=0, resident_experts=MIXTRAL.total_experts)
    # From 8 tokens on every expert runs: a step reads all weights whatever the batch, so
    # doubling a small batch barely costs (memory-bound), while 4096 tokens with short
    # contexts do 512x the expert FLOPs of 8 and take many times longer (compute-bound).
    one = step_cost(MIXTRAL, H200, resident, 8, 0, 8 * 1000, 0)
    two = step_cost(MIXTRAL, H200, resident, 16, 0, 16 * 1000, 0)
    many = step_cost(MIXTRAL, H200, resident, 4096, 0, 4096 * 10, 0)
    assert one.link_s == 0 and two.compute_s < 1.3 * one.compute_s
    assert many.compute_s > 5 * one.compute_s


def test_a_slower_link_never_speeds_a_plan_up_and_the_chosen_plan_is_the_best_candidate():
    work = Workload(seqs=256, context=1000)
    for link in (5e9, 25e9, 55e9, 200e9):
        hw = dataclasses.replace(H200, link_bytes_per_s=link)
        plans = candidate_plans(MIXTRAL, hw, 30 << 30, work, BLOCK)
        best = choose_plan(MIXTRAL, hw, 30 << 30, work, BLOCK)
        assert best.tokens_per_s == pytest.approx(max(p.tokens_per_s for p in plans))
    rates = [choose_plan(MIXTRAL, dataclasses.replace(H200, link_bytes_per_s=x), 30 << 30, work, BLOCK).tokens_per_s
             for x in (5e9, 25e9, 55e9, 200e9)]
    assert rates == sorted(rates)


def test_a_budget_without_room_for_one_expert_is_refused():
    with pytest.raises(ValueError, match="holds no expert slot"):
        choose_plan(MIXTRAL, H200, MIXTRAL.dense_bytes + 1, Workload(8, 100), BLOCK)

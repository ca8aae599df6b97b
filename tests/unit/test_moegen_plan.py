"""The moegen cost model and its plan, with given hardware numbers (no model, no torch).

Oracles: module times computed by hand from the roofline (bytes / bandwidth vs FLOPs / rate);
the direction a plan must move when the budget, the link or the batch changes.
"""

from __future__ import annotations

import dataclasses

import pytest

from engines.moegen.cost import (
    KV_READS,
    BatchPlan,
    Hardware,
    ModelShape,
    Workload,
    candidate_plans,
    choose_plan,
    staging_bytes,
    step_cost,
)

MB = 1 << 20
# Mixtral-8x7B-like in bf16: 32 layers x 8 experts of 3 x 4096 x 14336 x 2 bytes (352 MB).
MIXTRAL = ModelShape(layers=32, moe_layers=32, experts=8, top_k=2, hidden=4096, q_size=4096, kv_size=1024, heads=32,
                     head_dim=128, intermediate=14336, vocab=32000, dense_bytes=3_200 * MB, layer_dense_bytes=90 * MB,
                     head_bytes=250 * MB, expert_bytes=3 * 4096 * 14336 * 2, kv_bytes_per_token=2 * 32 * 1024 * 2,
                     dtype_bytes=2)
H200 = Hardware(device_bytes_per_s=4.8e12, device_flops_per_s=790e12, host_bytes_per_s=200e9, host_flops_per_s=2e12,
                link_bytes_per_s=55e9)
BLOCK = 16 * MIXTRAL.kv_bytes_per_token
# A one-layer toy, every number chosen so each module's roofline side is known by hand.
TOY = ModelShape(layers=1, moe_layers=1, experts=4, top_k=2, hidden=100, q_size=100, kv_size=50, heads=2,
                 head_dim=50, intermediate=200, vocab=1000, dense_bytes=10_000, layer_dense_bytes=1_000,
                 head_bytes=4_000, expert_bytes=1_000_000, kv_bytes_per_token=400, dtype_bytes=4)
TOY_HW = Hardware(device_bytes_per_s=1e9, device_flops_per_s=1e12, host_bytes_per_s=1e9, host_flops_per_s=1e12,
                  link_bytes_per_s=1e8)


def test_one_layer_by_hand():
    """A one-layer toy, every number chosen so each module's roofline side is known."""
    shape = TOY
    hw = TOY_HW
    plan = BatchPlan("device", 10, 10, expert_slots=4, resident_experts=0, device_kv_bytes=0)
    c = step_cost(shape, hw, plan, decode_seqs=10, prefill_tokens=0, decode_context=10 * 50, prefill_context=0)
    dense = max(1_000 / 1e9, 2 * 10 * (1_000 / 4) / 1e12)  # 1 us (bytes); FLOPs: every dense parameter
    attention = max(KV_READS * 500 * 400 / 1e9, 4 * 2 * 50 * 500 / 1e12)  # 600 us (bytes)
    experts = max(4 * 1e6 / 1e9, 10 * 2 * 6 * 100 * 200 / 1e12)  # 4 ms (bytes: 4 experts)
    link = 4 * 1e6 / 1e8  # 40 ms: every expert streams
    head = max(4_000 / 1e9, 2 * 10 * 100 * 1000 / 1e12)
    assert c.compute_s == pytest.approx(dense + attention + experts + head)
    assert c.link_s == pytest.approx(link)
    assert c.total_s == pytest.approx(max(dense + attention + experts, link) + head)  # link-bound
    assert c.h2d_bytes == 4 * 1_000_000


def test_measured_decode_attention_rate_prices_the_kv_once():
    """With `pwbench hw`'s decode-attention rate the attention term is the KV bytes attended
    (each once) over that rate, on whichever processor attends; prefill keeps its roofline."""
    shape = TOY
    base = TOY_HW
    rated = dataclasses.replace(base, attention_bytes_per_s=5e7, host_attention_bytes_per_s=2.5e7)
    for placement, rate in (("device", 5e7), ("host", 2.5e7)):
        plan = BatchPlan(placement, 10, 10, expert_slots=4, resident_experts=4, device_kv_bytes=0)
        before = step_cost(shape, base, plan, 10, 0, 10 * 50, 0)
        after = step_cost(shape, rated, plan, 10, 0, 10 * 50, 0)
        # 500 keys x 400 B: 600 us as KV_READS x bytes at 1 GB/s, 4 ms (device) or 8 ms (host) measured.
        assert after.total_s - before.total_s == pytest.approx(500 * 400 / rate - KV_READS * 500 * 400 / 1e9)
    # A prefill chunk of 20 tokens (210 causal key-query pairs) adds its own roofline to the measured decode part.
    plan = BatchPlan("device", 10, 10, expert_slots=4, resident_experts=4, device_kv_bytes=0)
    mixed = step_cost(shape, rated, plan, 10, 20, 10 * 50, 210, prefill_chunks=1)
    alone = step_cost(shape, dataclasses.replace(rated, attention_bytes_per_s=None), plan, 10, 20, 10 * 50, 210,
                      prefill_chunks=1)
    old = max((KV_READS * 500 + 20) * 400 / 1e9, 4 * 2 * 50 * 710 / 1e12)
    new = 500 * 400 / 5e7 + max(20 * 400 / 1e9, 4 * 2 * 50 * 210 / 1e12)
    assert mixed.total_s - alone.total_s == pytest.approx(new - old)


def test_on_one_processor_copies_are_memcpys_beside_compute():
    """A CPU run (shared_processor): each copied byte is also read and written by a memcpy on
    the cores that compute, so the layer's compute grows by 2 x bytes / bandwidth."""
    shape = TOY
    gpu = dataclasses.replace(TOY_HW, link_bytes_per_s=1e10)
    cpu = dataclasses.replace(gpu, shared_processor=True)
    plan = BatchPlan("device", 10, 10, expert_slots=4, resident_experts=0, device_kv_bytes=0)
    apart = step_cost(shape, gpu, plan, 10, 0, 10 * 50, 0)
    shared = step_cost(shape, cpu, plan, 10, 0, 10 * 50, 0)
    # 4 experts of 1 MB streamed: 4 ms of link (hidden under 4.6 ms of compute), 8 ms of memcpy.
    assert shared.compute_s - apart.compute_s == pytest.approx(2 * 4e6 / 1e9)
    assert shared.total_s - apart.total_s == pytest.approx(2 * 4e6 / 1e9)
    assert shared.link_s == apart.link_s


def test_host_attentions_round_trip_is_waited_for_and_activations_slow_with_the_step():
    """Host placement: the layer waits for q/k/v to go down and the output to come up (serial,
    not hidden under compute); the elementwise rate is interpolated in log(tokens) between
    its measured step sizes."""
    shape = TOY
    hw = dataclasses.replace(TOY_HW, link_bytes_per_s=1e7)
    host = BatchPlan("host", 10, 10, expert_slots=4, resident_experts=4, device_kv_bytes=0)
    device = dataclasses.replace(host, kv_placement="device")
    c_host, c_dev = (step_cost(shape, hw, p, 10, 0, 10 * 50, 0) for p in (host, device))
    trip = 10 * (100 + 100 + 2 * 50) * 4 / 1e7  # 1.2 ms: q/k/v down, output up, nothing to hide under
    attention = max(KV_READS * 500 * 400 / 1e9, 4 * 2 * 50 * 500 / 1e12)  # the same on either side here
    assert c_host.total_s - c_dev.total_s == pytest.approx(trip)
    assert c_host.host_s == pytest.approx(attention) and c_dev.host_s == 0

    ew = dataclasses.replace(hw, elementwise_bytes_per_s=20e9, elementwise_at_tokens=((256, 20e9), (8192, 5e9)))
    assert ew.elementwise_rate(100) == 20e9 and ew.elementwise_rate(10**5) == 5e9
    assert ew.elementwise_rate(1448) == pytest.approx(12.5e9, rel=1e-3)  # halfway in log(tokens)
    assert hw.elementwise_rate(256) is None


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
    plan = BatchPlan("device", 256, 256, expert_slots=16, resident_experts=0, device_kv_bytes=0)
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


# -- stream and split ---------------------------------------------------------------------------------

def test_stream_one_layer_by_hand():
    """10 sequences of 50 tokens in 2 micro-batches of 5, every expert resident (no expert link):
    200,000 KV bytes cross per layer, the second micro-batch's copy hidden under the first's
    attention, the first's (half) exposed once per step."""
    plan = BatchPlan("stream", 10, 5, expert_slots=0, resident_experts=4, device_kv_bytes=0, staging_bytes=1)
    c = step_cost(TOY, TOY_HW, plan, decode_seqs=10, prefill_tokens=0, decode_context=500, prefill_context=0)
    dense = 1_000 / 1e9  # bytes-bound (6e-7 s of FLOPs)
    attention = KV_READS * 500 * 400 / 1e9  # 600 us on the device over the staged blocks
    kv_link = 500 * 400 / 1e8  # 2 ms: the layer's KV over the link
    gather = 2 * 500 * 400 / 1e9  # 400 us: the host's gather into its staging copy
    experts = 4 * 1e6 / 1e9  # 4 ms, all resident
    act_link = 10 * 2 * 50 * 4 / 1e8  # the new K/V back to the host pool
    head = 4_000 / 1e9
    assert c.link_s == pytest.approx(kv_link + act_link)
    assert c.compute_s == pytest.approx(dense + experts + gather + attention + head)
    assert c.total_s == pytest.approx(dense + experts + gather + max(attention, kv_link) + head + kv_link / 2)
    assert c.h2d_bytes == 500 * 400
    assert c.host_s == 0


def test_split_one_layer_by_hand():
    """The same batch with host_share 0.5: the host attends 5 sequences (q/k/v down, output up)
    while the device attends the other 5 over their streamed KV (half the bytes): max of the
    two on separate processors, their sum on one."""
    plan = BatchPlan("split", 10, 5, expert_slots=0, resident_experts=4, device_kv_bytes=0, staging_bytes=1,
                     host_share=0.5)
    c = step_cost(TOY, TOY_HW, plan, decode_seqs=10, prefill_tokens=0, decode_context=500, prefill_context=0)
    host = KV_READS * 250 * 400 / 1e9  # 300 us
    device = KV_READS * 250 * 400 / 1e9  # 300 us
    kv_link = 250 * 400 / 1e8  # 1 ms
    gather = 2 * 250 * 400 / 1e9
    # host rows' o up and q/k/v down; device rows' k/v down
    act = (5 * 100 * 4 + 5 * (100 + 2 * 50) * 4 + 5 * 2 * 50 * 4) / 1e8
    rest = 1_000 / 1e9 + 4 * 1e6 / 1e9 + gather
    head = 4_000 / 1e9
    assert c.host_s == pytest.approx(host)
    assert c.link_s == pytest.approx(kv_link + act)
    wait = 5 * (2 * 100 + 2 * 50) * 4 / 1e8  # the host rows' round trip is waited for
    assert c.total_s == pytest.approx(rest + max(host, max(device, kv_link)) + head + kv_link / 2 + wait)
    assert c.h2d_bytes == 5 * 100 * 4 + 250 * 400
    shared = step_cost(TOY, dataclasses.replace(TOY_HW, shared_processor=True), plan, 10, 0, 500, 0)
    memcpy = 2 * (kv_link + act) * 1e8 / 1e9  # one processor: the copies' memcpys (read + write) add up too
    assert shared.total_s == pytest.approx(rest + host + max(device, kv_link) + head + kv_link / 2 + memcpy + wait)


LONG = Workload(seqs=256, context=8000)  # 256 x 8000 x 128 KiB = 250 GiB of KV; 20 GiB holds 16 sequences


def best_per_placement(hw, budget, work=LONG):
    best = {}
    for p in candidate_plans(MIXTRAL, hw, budget, work, BLOCK):
        if p.kv_placement not in best or p.tokens_per_s > best[p.kv_placement].tokens_per_s:
            best[p.kv_placement] = p
    return best


def test_stream_is_chosen_when_the_link_is_fast_the_host_slow_and_device_kv_does_not_fit():
    hw = dataclasses.replace(H200, link_bytes_per_s=400e9, host_flops_per_s=5e9)
    plan = choose_plan(MIXTRAL, hw, 20 << 30, LONG, BLOCK)
    assert plan.kv_placement == "stream" and plan.batch_seqs == 256
    best = best_per_placement(hw, 20 << 30)
    assert best["device"].batch_seqs < 256 and best["device"].tokens_per_s < plan.tokens_per_s
    # The staging buffer is inside the budget, beside the weights.
    assert 0 < plan.staging_bytes
    experts = (plan.expert_slots + plan.resident_experts) * MIXTRAL.expert_bytes
    assert MIXTRAL.dense_bytes + plan.staging_bytes + experts <= 20 << 30


def test_host_is_chosen_when_the_link_is_slow():
    hw = dataclasses.replace(H200, link_bytes_per_s=5e9)
    plan = choose_plan(MIXTRAL, hw, 20 << 30, LONG, BLOCK)
    assert plan.kv_placement == "host"
    best = best_per_placement(hw, 20 << 30)
    assert best["stream"].tokens_per_s < best["split"].tokens_per_s < plan.tokens_per_s


def test_split_is_chosen_when_host_and_link_are_comparable_and_beats_both():
    """H200 figures: host attention (3 reads at 200 GB/s) and streaming (1 read at 55 GB/s)
    take about as long per sequence, so running about half the sequences on each side (in
    parallel: separate processors) is faster than either alone."""
    plan = choose_plan(MIXTRAL, H200, 20 << 30, LONG, BLOCK)
    assert plan.kv_placement == "split" and 0.3 < plan.host_share < 0.7
    best = best_per_placement(H200, 20 << 30)
    assert plan.tokens_per_s > max(best["host"].tokens_per_s, best["stream"].tokens_per_s)
    assert plan.predicted.total_s < min(best["host"].predicted.total_s, best["stream"].predicted.total_s)
    # A fixed share is kept as given.
    fixed = choose_plan(MIXTRAL, H200, 20 << 30, LONG, BLOCK, placements=("split",), host_share=0.25)
    assert fixed.host_share == 0.25 and fixed.tokens_per_s < plan.tokens_per_s


def test_stream_needs_its_staging_buffer_in_the_budget():
    """A staging half holds at least one sequence of the longest length (max_seq_blocks)."""
    half = 2048  # blocks of one layer: a 32k-token sequence
    staged = staging_bytes(MIXTRAL, BLOCK, 1, 8000, half)
    assert staged == 2 * half * BLOCK // MIXTRAL.layers
    room = MIXTRAL.dense_bytes + MIXTRAL.expert_bytes + staged
    plans = candidate_plans(MIXTRAL, H200, room, LONG, BLOCK, placements=("stream",), max_seq_blocks=half)
    # Micro-batches of 1 and 2 sequences of 8000 tokens (500 blocks each) fit that half; 8 do not.
    assert {(p.micro_batch, p.resident_experts, p.expert_slots, p.staging_bytes) for p in plans} == \
        {(1, 0, 1, staged), (2, 0, 1, staged)}
    with pytest.raises(ValueError, match="no plan fits"):
        candidate_plans(MIXTRAL, H200, room - 1, LONG, BLOCK, placements=("stream",), max_seq_blocks=half)


def test_few_row_matmuls_and_greedy_sampling_cost_what_pwbench_hw_measured():
    """With `pwbench hw`'s rate-by-rows points, a matmul's FLOP/s is interpolated in log(rows)
    (flat beyond the points), and the head pays its logits' argmax at the measured rate."""
    hw = Hardware(device_bytes_per_s=1e9, device_flops_per_s=1e12, host_bytes_per_s=1e9, host_flops_per_s=1e12,
                  link_bytes_per_s=None, flops_at_rows=((8, 1e11), (128, 5e11), (1024, 1e12)), sample_bytes_per_s=2e8)
    assert hw.matmul_flops(4) == 1e11 and hw.matmul_flops(8) == 1e11 and hw.matmul_flops(4096) == 1e12
    assert hw.matmul_flops(32) == pytest.approx(1e11 + 0.5 * 4e11)  # halfway from 8 to 128 in log(rows)
    shape = TOY
    plan = BatchPlan("device", 32, 32, expert_slots=0, resident_experts=4, device_kv_bytes=0)
    c = step_cost(shape, hw, plan, decode_seqs=32, prefill_tokens=0, decode_context=32 * 50, prefill_context=0)
    rate32, rate16 = hw.matmul_flops(32), hw.matmul_flops(16)  # projections: 32 rows; experts: 32 x 2 / 4
    dense = max(1_000 / 1e9, 2 * 32 * (1_000 / 4) / rate32)
    attention = max(KV_READS * 1600 * 400 / 1e9, 4 * 2 * 50 * 1600 / 1e12)
    experts = max(4 * 1e6 / 1e9, 32 * 2 * 6 * 100 * 200 / rate16)
    head = max(4_000 / 1e9, 2 * 32 * 100 * 1000 / rate32) + 32 * 1000 * 4 / 2e8
    assert c.compute_s == pytest.approx(dense + attention + experts + head)


def test_activations_move_through_elementwise_kernels_at_the_measured_rate():
    """With `elementwise_bytes_per_s`, each layer also pays its activations: per token
    14 x hidden + 6 x (q + kv) + q elements, per expert assignment 6 x hidden + 5 x intermediate."""
    shape = TOY
    base = Hardware(device_bytes_per_s=1e9, device_flops_per_s=1e12, host_bytes_per_s=1e9, host_flops_per_s=1e12,
                    link_bytes_per_s=None)
    plan = BatchPlan("device", 10, 10, expert_slots=0, resident_experts=4, device_kv_bytes=0)
    args = dict(decode_seqs=10, prefill_tokens=0, decode_context=500, prefill_context=0)
    without = step_cost(shape, base, plan, **args)
    with_act = step_cost(shape, dataclasses.replace(base, elementwise_bytes_per_s=5e8), plan, **args)
    per_token = 14 * 100 + 6 * (100 + 50) + 100
    per_assignment = 6 * 100 + 5 * 200
    assert with_act.compute_s - without.compute_s == pytest.approx((10 * per_token + 20 * per_assignment) * 4 / 5e8)


# Published configs (config.json on the Hugging Face hub), the fields model_shape reads.
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "max_position_embeddings": 163840,
    "num_experts_per_tok": 8, "n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "intermediate_size": 18432, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "num_nextn_predict_layers": 1, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}
GPT_OSS_120B = {
    "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "num_hidden_layers": 36,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
    "num_experts_per_tok": 4, "num_local_experts": 128, "intermediate_size": 2880, "sliding_window": 128,
    "attention_bias": True, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
}


@pytest.mark.parametrize("raw, params_b, kv_per_token", [
    # The model cards: DeepSeek-V3 671B parameters (without its 14B multi-token-prediction module);
    # MLA caches a 512 latent + a 64 rope key per token and layer: 61 x 576 x 2 bytes.
    (DEEPSEEK_V3, 671.0, 61 * (512 + 64) * 2),
    # gpt-oss-120b 116.8B parameters (sinks, router and expert biases included); K and V of 8
    # heads of 64 per layer.
    (GPT_OSS_120B, 116.8, 36 * 2 * 8 * 64 * 2),
])
def test_model_shape_counts_the_published_parameters_and_kv_bytes(raw, params_b, kv_per_token):
    from engines.runtime.config import parse_config
    from engines.runtime.shape import model_shape

    shape = model_shape(parse_config(raw, "config.json"), 2)  # bf16
    params = (shape.dense_bytes + shape.total_experts * shape.expert_bytes) / 2
    assert params / 1e9 == pytest.approx(params_b, abs=0.05)
    assert shape.kv_bytes_per_token == kv_per_token

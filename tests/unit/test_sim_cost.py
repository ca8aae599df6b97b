"""The simulator's cost model (engines/sim/cost.py) and the cpu calibration (engines/sim/calibrate.py).

Oracles: step times computed by hand on a hand-made profile; moegen's independently written
and measured-against cost model (engines/moegen/cost.py) on the bundled model; the roofline
bound over random steps; the measurement dict's own ratios for the calibration.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engines.runtime.config import parse_config
from engines.runtime.shape import ModelShape, model_shape
from engines.sim.calibrate import cpu_rates, fit_cpu_curves
from engines.sim.cost import CostModel, ExpertRun, StepWork, _Interp, shape_key
from engines.sim.hardware import Curve, HardwareProfile

REPO = Path(__file__).resolve().parents[2]


def flat(eff: float) -> Curve:
    return Curve(((1.0, eff),), "test")


def profile(name: str = "toy", *, bw: float = 1e9, peak: float = 1e12, link: float = 1e8, op: float = 1e-6,
            step: float = 5e-6, dtype: str = "bfloat16", **curves: Curve) -> HardwareProfile:
    eff = {"gemm": flat(0.5), "grouped_gemm": flat(0.25), "attention_decode": flat(0.8),
           "attention_prefill": flat(0.4), "elementwise": flat(0.5), "sample": flat(0.5), "copy": flat(0.5),
           "copy_overlap": flat(0.5), **curves}
    return HardwareProfile(name=name, description="hand-made", memory_bytes=1 << 30, memory_bytes_per_s=bw,
                           flops_per_s={dtype: peak}, link_bytes_per_s=link, link_pinned_bytes_per_s=link,
                           host_memory_bytes=1 << 30, host_memory_bytes_per_s=bw, host_flops_per_s=peak,
                           step_overhead_s=step, efficiency=eff, sources={}, default_dtype=dtype, op_overhead_s=op)


# One layer, one expert: hidden 4, q = kv = 4 (one head of 4), intermediate 8, vocab 10, bf16.
TINY = ModelShape(layers=1, moe_layers=1, experts=1, top_k=1, hidden=4, q_size=4, kv_size=4, heads=1, head_dim=4,
                  intermediate=8, vocab=10, dense_bytes=0, layer_dense_bytes=200, head_bytes=88, expert_bytes=192,
                  kv_bytes_per_token=16, dtype_bytes=2)
TINY_WORK = StepWork(decode_contexts=(10,), experts=(ExpertRun(0, 1, 192, 16.0),), dense_bytes_read=288,
                     kv_bytes_per_token=16, logit_rows=1)
# By hand, one decode token (bandwidth 1e9 B/s, 1e12 FLOP/s):
#   dense     max(200 B / 1e9, 2 x 100 params / 1e12) / gemm 0.5                       =   400 ns
#   head      max(88 B / 1e9, 2 x 44 params / 1e12) / 0.5 = 176 ns; argmax 10 x 2 B / (1e9 x 0.5) = 40 ns
#   expert    max(192 B / (1e9 x 0.25), 2 x 3 x 4 x 8 FLOPs / (1e12 x 0.25))            =   768 ns
#   attention 10 tokens x 16 B / (1e9 x 0.8) (FLOPs 160 / (1e12 x 0.5): less)           =   200 ns
#   activations ((14 x 4 + 6 x 8 + 4) + (6 x 4 + 5 x 8)) x 2 B / (1e9 x 0.5) = 344 B x 2 ns =   688 ns
#   dispatch  1 us x (122 + 34 x 1 decode group + 8 per expert run)                   =   164 us
#   overhead                                                                            =     5 us
# Dispatch and compute add, on the cpu profile (one processor) and on a device (this runtime's MoE
# layers wait for their routing counts on the host, so launches cannot run ahead).
TINY_DEVICE = (400 + 216 + 768 + 200 + 688) * 1e-9
TINY_COMPUTE = TINY_DEVICE + 164e-6


def test_tiny_step_by_hand():
    cost = CostModel(profile(), TINY, "bfloat16").step(TINY_WORK)
    assert cost.parts["dense"] == pytest.approx(400e-9)
    assert cost.parts["head"] == pytest.approx(216e-9)
    assert cost.parts["experts"] == pytest.approx(768e-9)
    assert cost.parts["attention"] == pytest.approx(200e-9)
    assert cost.parts["activations"] == pytest.approx(688e-9)
    assert cost.parts["dispatch"] == pytest.approx(164e-6)
    assert cost.seconds == pytest.approx(TINY_COMPUTE + 5e-6)
    cpu = CostModel(profile("cpu"), TINY, "bfloat16").step(TINY_WORK)
    assert cpu.parts["dispatch"] == pytest.approx(164e-6) and cpu.seconds == pytest.approx(TINY_COMPUTE + 5e-6)
    assert cost.roofline_s == pytest.approx((288 + 192 + 160) / 1e9)
    # the runtime's time per decode sequence and layer (cost model 8): 3 us x 1 layer x 1 sequence
    per_seq = CostModel(replace(profile("cpu"), decode_sequence_overhead_s=3e-6), TINY, "bfloat16").step(TINY_WORK)
    assert per_seq.parts["dispatch"] == pytest.approx(167e-6) and per_seq.seconds == pytest.approx(cpu.seconds + 3e-6)
    two = CostModel(replace(profile("cpu"), decode_sequence_overhead_s=3e-6), TINY, "bfloat16").step(
        replace(TINY_WORK, decode_contexts=(10, 10), decode_groups=1))
    assert two.parts["dispatch"] == pytest.approx(170e-6)  # the same calls (one group), two sequences
    assert sum(v for k, v in cost.parts.items() if k != "link_busy") == pytest.approx(cost.seconds)


def test_prefill_attention_by_hand():
    # A 6-token chunk after 4 cached tokens: the runtime's masked SDPA computes the whole 6 x (4 + 6)
    # rectangle: 60 pairs x 4 x 1 x 4 FLOPs = 960 at 1e12 x 0.4 = 2.4 ns; reading 4 and writing 6
    # tokens' KV: 160 B / 1e9 = 160 ns (the larger).
    model = CostModel(profile(), TINY, "bfloat16")
    work = StepWork(prefill=((6, 4),), kv_bytes_per_token=16)
    assert model.step(work).parts["attention"] == pytest.approx(160e-9)
    fast = CostModel(profile(bw=1e15), TINY, "bfloat16")
    assert fast.step(work).parts["attention"] == pytest.approx(max(960 / 0.4e12, 160 / 1e15))
    assert model.step(work).roofline_s == pytest.approx(4 * 16 / 1e9)  # the cached context is read
    # from position 0, causal: 6 x 6 / 2 = 18 pairs x 16 FLOPs = 288 at 0.4e12 = 0.72 ns
    first = StepWork(prefill=((6, 0),), kv_bytes_per_token=16)
    assert fast.step(first).parts["attention"] == pytest.approx(288 / 0.4e12)
    # after context at the attention_prefill_context curve where the profile has one (0.1: 9.6 ns),
    # the chunk from position 0 still at attention_prefill
    ctx = CostModel(profile(bw=1e15, attention_prefill_context=flat(0.1)), TINY, "bfloat16")
    assert ctx.step(work).parts["attention"] == pytest.approx(960 / 0.1e12)
    assert ctx.step(first).parts["attention"] == pytest.approx(288 / 0.4e12)


def test_the_masked_rectangle_is_what_the_runtime_attends():
    """prefill_attention_pairs' rectangle is the runtime's: `context_mask` has chunk x (context +
    chunk) entries of which the chunk's causal share is True, and paged attention over a chunk after
    context equals SDPA over the whole sequence's last rows."""
    from engines.runtime.attention import context_mask
    from engines.sim.cost import prefill_attention_pairs

    mask = context_mask(4, 10, None)
    assert mask.shape == (6, 10) and mask.numel() == prefill_attention_pairs(6, 4)
    assert int(mask.sum()) == 6 * 4 + 6 * 7 // 2  # each query sees the context and the chunk up to itself
    assert prefill_attention_pairs(6, 0) == 18
    q, k, v = torch.randn(3, 1, 2, 10, 8).unbind(0)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    tail = torch.nn.functional.scaled_dot_product_attention(q[:, :, 4:], k, v, attn_mask=mask)
    torch.testing.assert_close(tail, full[:, :, 4:])


def test_prefill_overheads_by_hand():
    # Two prefill segments (6 and 3 tokens; an empty one does not count) and one decode row, 3 layers of
    # hidden 4: 3 x (1 us x 9 tokens x 4 + 20 us x 2 segments) = 228 us over the 5 us step overhead; a
    # decode-only step has none, and a profile without the rates (a GPU's) adds nothing.
    from engines.sim.cost import prefill_overhead_s

    shape = replace(TINY, layers=3)
    work = StepWork(prefill=((6, 0), (3, 4), (0, 2)), decode_contexts=(10,), kv_bytes_per_token=16)
    rated = replace(profile(), prefill_element_overhead_s=1e-6, prefill_segment_overhead_s=2e-5)
    assert CostModel(rated, shape, "bfloat16").step(work).parts["overhead"] == pytest.approx(5e-6 + 228e-6)
    assert CostModel(profile(), shape, "bfloat16").step(work).parts["overhead"] == pytest.approx(5e-6)
    decode = replace(work, prefill=())
    assert CostModel(rated, shape, "bfloat16").step(decode).parts["overhead"] == pytest.approx(5e-6)
    assert prefill_overhead_s(rated, shape, 9, 2) == pytest.approx(228e-6)
    assert prefill_overhead_s(rated, shape, 0, 0) == 0
    # and 3 x 50 us in a step that prefills, none in one that does not
    stepped = replace(rated, prefill_step_overhead_s=5e-5)
    assert CostModel(stepped, shape, "bfloat16").step(work).parts["overhead"] == pytest.approx(5e-6 + 378e-6)
    assert CostModel(stepped, shape, "bfloat16").step(decode).parts["overhead"] == pytest.approx(5e-6)


def test_a_models_own_prefill_rates_replace_the_profiles_for_its_shape():
    # The profile's rates (1 us an element, 20 us a segment) against a model's own (0.1 us, 0, 40 us a step)
    # at TINY's shape key: 3 layers x (0.1 us x 9 tokens x 4 + 40 us) = 130.8 us for 9 tokens in 2 segments;
    # a model of another shape still pays the profile's 228 us; the assumptions say which.
    from engines.sim.cost import prefill_overhead_rates, prefill_overhead_s, shape_key

    shape, other = replace(TINY, layers=3), replace(TINY, layers=3, hidden=8)
    key = shape_key(shape)
    rated = replace(profile(), prefill_element_overhead_s=1e-6, prefill_segment_overhead_s=2e-5,
                    model_prefill_element_overhead_s={key: 1e-7}, model_prefill_segment_overhead_s={key: 0.0},
                    model_prefill_step_overhead_s={key: 4e-5})
    assert prefill_overhead_s(rated, shape, 9, 2) == pytest.approx(130.8e-6)
    assert prefill_overhead_s(rated, other, 9, 2) == pytest.approx(3 * (1e-6 * 9 * 8 + 2e-5 * 2))
    assert prefill_overhead_rates(rated, shape)[:3] == (1e-7, 0.0, 4e-5)
    work = StepWork(prefill=((6, 0), (3, 4)), decode_contexts=(), kv_bytes_per_token=16)
    model = CostModel(rated, shape, "bfloat16")
    assert model.step(work).parts["overhead"] == pytest.approx(5e-6 + 130.8e-6)
    said = model.assumptions()
    assert said["prefill_step_overhead_s"] == 4e-5 and key in said["prefill_overhead_source"]
    assert "bundled" in CostModel(rated, other, "bfloat16").assumptions()["prefill_overhead_source"]


def test_executor_overhead_by_hand():
    # Keys layer_major (10 us a layer, 0.5 us a layer-token) and pagedweight (20 us, 0): over 4 layers and
    # a step of 6 tokens, 4 x ((10 + 0.5 x 6) + 20) us = 132 us; a key the profile lacks adds 0, as do no
    # keys, a step without tokens and a profile without the tables (a GPU's).
    from engines.sim.cost import executor_overhead_s

    p = replace(profile(), executor_overhead_s={"layer_major": 1e-5, "pagedweight": 2e-5},
                executor_token_overhead_s={"layer_major": 5e-7})
    assert executor_overhead_s(p, ("layer_major", "pagedweight"), 4, 6) == pytest.approx(132e-6)
    assert executor_overhead_s(p, ("layer_major", "offload"), 4, 6) == pytest.approx(4 * 13e-6)
    assert executor_overhead_s(p, (), 4, 6) == 0
    assert executor_overhead_s(p, ("pagedweight",), 4, 0) == 0
    assert executor_overhead_s(profile(), ("pagedweight",), 4, 6) == 0


def test_copies_add_overlap_or_share_the_processor():
    # h2d 1000 B in 2 transfers, d2h 500 B in 1, at 1e8 x copy 0.5: 20 us and 10 us.
    copies = dict(h2d_bytes=1000, h2d_transfers=2, d2h_bytes=500, d2h_transfers=1)
    base = CostModel(profile(), TINY, "bfloat16")
    waited = base.step(replace(TINY_WORK, **copies))
    assert waited.seconds == pytest.approx(TINY_COMPUTE + 5e-6 + 20e-6)  # full duplex: the longer direction
    # Overlapped: one transfer (20 us / 3) waited for, the rest at half speed beside compute (192 us: hidden).
    over = base.step(replace(TINY_WORK, copies_overlap=True, **copies))
    assert over.seconds == pytest.approx(TINY_COMPUTE + 5e-6 + 20e-6 / 3)
    assert over.parts["link_busy"] == pytest.approx(20e-6 / 3 + 2 * (20e-6 * 2 / 3))
    # Without the dispatch overhead compute (2.272 us) is shorter than the copies: they show.
    lean = CostModel(profile(op=0.0), TINY, "bfloat16")
    c = (400 + 216 + 768 + 200 + 688) * 1e-9
    rest = 2 * 20e-6 * 2 / 3
    assert lean.step(replace(TINY_WORK, copies_overlap=True, **copies)).seconds == \
        pytest.approx(c + 5e-6 + 20e-6 / 3 + (rest - c))
    # The cpu profile: copies are memcpys on the compute cores, both directions add, never overlap.
    cpu = CostModel(profile("cpu"), TINY, "bfloat16")
    for overlap in (False, True):
        assert cpu.step(replace(TINY_WORK, copies_overlap=overlap, **copies)).seconds == \
            pytest.approx(TINY_COMPUTE + 5e-6 + 30e-6)


# mistralai/Mixtral-8x7B-v0.1 config.json (Hugging Face), the fields the shape reads.
MIXTRAL = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
           "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 32768,
           "rms_norm_eps": 1e-5, "rope_theta": 1e6, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def test_quantized_experts_cheaper_than_bf16_at_decode_on_a_gpu():
    # H100 SXM: 3.35 TB/s HBM, 989 TFLOP/s bf16 dense (NVIDIA datasheet); curves as hand-made
    # estimates (4-bit dequant kernels near memory speed at decode, as Marlin reports).
    h100 = profile("h100-test", bw=3.35e12, peak=989e12, link=55e9, op=0.0, step=20e-6,
                   grouped_gemm=Curve(((1, 0.5), (64, 0.7), (512, 0.8)), "test"),
                   dequant_gemm_4=Curve(((1, 0.7), (64, 0.6), (512, 0.3)), "test"),
                   dequant_gemm_8=Curve(((1, 0.75), (512, 0.4)), "test"))
    shape = model_shape(parse_config(MIXTRAL, "Mixtral-8x7B config"), 2)
    model = CostModel(h100, shape, "bfloat16")
    params = shape.expert_bytes // 2
    for tokens in (1, 4, 16):
        bf16 = model.step(StepWork(experts=(ExpertRun(0, tokens, shape.expert_bytes, 16.0),) * 64,
                                   decode_contexts=(512,) * tokens, kv_bytes_per_token=shape.kv_bytes_per_token))
        q4_bytes = int(params * 4.25 / 8)
        q4 = model.step(StepWork(experts=(ExpertRun(0, tokens, q4_bytes, 4.25),) * 64,
                                 decode_contexts=(512,) * tokens, kv_bytes_per_token=shape.kv_bytes_per_token))
        assert q4.parts["experts"] < bf16.parts["experts"] / 2
        assert q4.seconds < bf16.seconds


def test_cpu_dequantization_is_priced_at_its_measured_rate_per_scheme():
    # TINY's expert is 192 B at bf16 (96 weights). On the cpu profile a 4-bit expert dequantizes
    # its full-width weights (192 B) at dequant_cpu_<scheme>(4) of 1e9 B/s, then runs the dense
    # GEMM: max(192 B / (1e9 x 0.25), 192 FLOPs / (1e12 x 0.25)) = 768 ns.
    cpu = profile("cpu", dequant_cpu_packed=Curve(((2, 0.02), (8, 0.04)), "test"),
                  dequant_cpu_bitplanes=Curve(((4, 0.05),), "test"))
    model = CostModel(cpu, TINY, "bfloat16")
    gemm = 768e-9

    def experts(scheme: str) -> float:
        return model.step(replace(TINY_WORK, experts=(ExpertRun(0, 1, 60, 4.0, 1, scheme),))).parts["experts"]

    # packed at 4 bits: interpolated in log(bits) between 2 (0.02) and 8 (0.04): 0.03
    assert experts("packed") == pytest.approx(192 / (1e9 * 0.03) + gemm)
    assert experts("bitplanes") == pytest.approx(192 / (1e9 * 0.05) + gemm)
    # a scheme not measured: the older count, 2 x the full-width bytes at the elementwise rate (0.5)
    assert experts("mxfp4") == pytest.approx(2 * 192 / (1e9 * 0.5) + gemm)
    assert "dequant_cpu_{bitplanes, packed}" in model.assumptions()["quantized_experts"]


def test_a_packed_experts_calls_are_all_in_what_the_calibration_times():
    """A packed (RTN) expert run's torch calls beyond a full-width one's (OPS_PER_QUANTIZED_EXPERT_CPU)
    are all made indexing its two matrices (`QuantizedWeight.expert`, then `dequantize`), which is what
    `pwbench hw calibrate --model` times (harness/bench/cpu_ops.py `model_dequant_seconds`): the oracle
    is a TorchFunctionMode count of the static engines' CPU path indexing an expert
    (engines/quant/ops.py `_DequantizedStack`) against a dense stack's. So a run priced on the model's
    own curve pays no call again; on the generic curve or none, its 82 calls at op_overhead_s."""
    from torch.overrides import TorchFunctionMode

    from engines.quant.ops import _DequantizedStack
    from engines.quant.qweight import quantize_rtn
    from engines.sim.cost import OPS_PER_QUANTIZED_EXPERT_CPU

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    weights = torch.randn(2, 64, 32), torch.randn(2, 32, 32)
    packed = [_DequantizedStack(quantize_rtn(w, 4, 32), torch.float32) for w in weights]
    with Count():
        for stack in packed:
            stack[1]
    quantized, Count.calls = Count.calls, 0
    with Count():
        for w in weights:
            w[1]
    assert quantized - Count.calls == OPS_PER_QUANTIZED_EXPERT_CPU["packed"]

    work = replace(TINY_WORK, experts=(ExpertRun(0, 1, 60, 4.0, 3, "packed"),))
    full = CostModel(profile("cpu"), TINY, "bfloat16").step(replace(work, experts=(ExpertRun(0, 1, 192, 16.0, 3),)))
    own = {f"dequant_cpu_packed@{shape_key(TINY)}": flat(0.04)}
    for curves, calls in (({}, 3 * 82), ({"dequant_cpu_packed": flat(0.02)}, 3 * 82), (own, 0)):
        model = CostModel(profile("cpu", **curves), TINY, "bfloat16")
        # 1 us a call
        assert model.step(work).parts["dispatch"] - full.parts["dispatch"] == pytest.approx(calls * 1e-6)
        assert model.cpu_dequantization(work.experts)[1] == calls


def test_the_models_own_dequantization_curve_replaces_the_generic_one():
    key = shape_key(TINY)
    cpu = profile("cpu", dequant_cpu_packed=flat(0.02), **{f"dequant_cpu_packed@{key}": flat(0.04),
                                                            "dequant_cpu_packed@d9-other": flat(0.5)})
    model = CostModel(cpu, TINY, "bfloat16")
    run = replace(TINY_WORK, experts=(ExpertRun(0, 1, 60, 4.0, 1, "packed"),))
    # 192 full-width bytes at 1e9 x 0.04, then the dense GEMM (768 ns)
    assert model.step(run).parts["experts"] == pytest.approx(192 / (1e9 * 0.04) + 768e-9)
    assert "measured on this model's experts" in model.assumptions()["quantized_experts"]
    assert "packed 82" in model.assumptions()["quantized_experts"]
    assert model.assumptions()["shaped_curves"] == {"dequant_cpu_packed": f"dequant_cpu_packed@{key}"}


def test_a_packed_experts_gemm_after_its_dequantization_is_priced_at_its_own_curve():
    """On the cpu profile the static engines' reference dequantizes each RTN expert right before its
    GEMMs, which then read weights just written, in the caches: `pwbench hw calibrate --model` times
    them so (grouped_gemm_dequantized@key, a fraction of the FLOP peak: no memory term). A packed
    run's GEMM: 2 x 3 x 4 x 8 = 192 FLOPs / (1e12 x 0.0005) = 384 ns, where grouped_gemm prices
    max(192 B / 1e9, 192 FLOPs / 1e12) / 0.25 = 768 ns. Pagedweight's bit planes (a layer's group
    dequantized in one stacked call, its temporaries out of the caches) keep grouped_gemm; without
    the curve, packed keeps it too."""
    key = shape_key(TINY)
    dequant = {"dequant_cpu_packed": flat(0.02), "dequant_cpu_bitplanes": flat(0.05)}
    hot = CostModel(profile("cpu", **dequant, **{f"grouped_gemm_dequantized@{key}": flat(0.0005)}), TINY,
                    "bfloat16")
    cold = CostModel(profile("cpu", **dequant), TINY, "bfloat16")

    def experts(model: CostModel, scheme: str, bits: float = 4.0) -> float:
        return model.step(replace(TINY_WORK, experts=(ExpertRun(0, 1, 60, bits, 1, scheme),))).parts["experts"]

    assert experts(hot, "packed") == pytest.approx(192 / (1e9 * 0.02) + 384e-9)
    assert experts(cold, "packed") == pytest.approx(192 / (1e9 * 0.02) + 768e-9)
    assert experts(hot, "bitplanes") == experts(cold, "bitplanes") == pytest.approx(192 / (1e9 * 0.05) + 768e-9)
    # an expert at the model's width is not dequantized: the resident experts' curve (60 B / (1e9 x 0.25))
    assert experts(hot, "packed", 16.0) == experts(cold, "packed", 16.0) == pytest.approx(240e-9)
    assert "grouped_gemm_dequantized" in hot.assumptions()["quantized_experts"]
    assert "grouped_gemm_dequantized" not in cold.assumptions()["quantized_experts"]


def test_grouped_cpu_dequantization_is_priced_by_the_groups_bytes():
    # TINY (one MoE layer): its expert is 192 B at full width. dequant_group_bitplanes_4 gives 0.05
    # at one expert's bytes and 0.01 at ten's: one 4-bit run is priced at 0.05, ten alike runs (one
    # layer dequantizes them in one stacked call) at 0.01 each; packed runs keep dequant_cpu_packed.
    cpu = profile("cpu", dequant_cpu_packed=Curve(((4, 0.02),), "test"),
                  dequant_cpu_bitplanes=Curve(((4, 0.05),), "test"),
                  dequant_group_bitplanes_4=Curve(((192, 0.05), (1920, 0.01)), "test"))
    model = CostModel(cpu, TINY, "bfloat16")
    gemm = 768e-9

    def experts(count: int, scheme: str = "bitplanes") -> float:
        return model.step(replace(TINY_WORK, experts=(ExpertRun(0, 1, 60, 4.0, count, scheme),))).parts["experts"]

    assert experts(1) == pytest.approx(192 / (1e9 * 0.05) + gemm)
    assert experts(10) == pytest.approx(10 * (192 / (1e9 * 0.01) + gemm))
    assert experts(10, "packed") == pytest.approx(10 * (192 / (1e9 * 0.02) + gemm))
    assert "dequant_group_*" in model.assumptions()["quantized_experts"]


@st.composite
def step_works(draw):
    runs = tuple(ExpertRun(draw(st.integers(0, 3)), draw(st.integers(1, 600)), draw(st.integers(1, 10**9)),
                           draw(st.sampled_from([2.0, 3.1, 4.25, 8.5, 16.0])))
                 for _ in range(draw(st.integers(0, 12))))
    h2d, d2h = draw(st.integers(0, 10**10)), draw(st.integers(0, 10**10))
    return StepWork(
        prefill=tuple(draw(st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 10**5)), max_size=3))),
        decode_contexts=tuple(draw(st.lists(st.integers(1, 10**5), max_size=40))),
        experts=runs, dense_bytes_read=draw(st.integers(0, 10**11)),
        h2d_bytes=h2d, d2h_bytes=d2h, h2d_transfers=draw(st.integers(1 if h2d else 0, 50)),
        d2h_transfers=draw(st.integers(1 if d2h else 0, 50)), copies_overlap=draw(st.booleans()),
        kv_bytes_per_token=draw(st.integers(1, 10**6)), logit_rows=draw(st.integers(0, 64)))


curves = st.lists(st.tuples(st.floats(1, 1e6), st.floats(0.01, 1.0)), min_size=1, max_size=4,
                  unique_by=lambda p: p[0]).map(lambda pts: Curve(tuple(sorted(pts)), "random"))


@settings(max_examples=150, deadline=None)
@given(work=step_works(), name=st.sampled_from(["cpu", "gpu"]), gemm=curves, grouped=curves, dq=curves,
       att=curves, overlap=curves)
# Found by hypothesis: on the cpu profile a quantized run storing more bytes than TINY's full-width
# expert (192 B) was priced by its dequantization of 192 B alone, below reading its stored bytes.
@example(work=StepWork(decode_contexts=(1,), experts=(ExpertRun(0, 1, 753_001_649, 2.0),), kv_bytes_per_token=1,
                       logit_rows=0),
         name="cpu", gemm=flat(1.0), grouped=flat(1.0), dq=flat(1.0), att=flat(1.0), overlap=flat(1.0))
def test_never_below_the_roofline(work, name, gemm, grouped, dq, att, overlap):
    shape = TINY if name == "cpu" else replace(TINY, layers=4, hidden=4096, intermediate=1536, q_size=4096,
                                               kv_size=512, heads=32, head_dim=128, vocab=150000,
                                               layer_dense_bytes=10**8, head_bytes=10**9)
    p = profile(name, bw=3e12, peak=1e15, gemm=gemm, grouped_gemm=grouped, dequant_gemm_4=dq,
                attention_decode=att, copy_overlap=overlap)
    cost = CostModel(p, shape, "bfloat16").step(work)
    assert cost.seconds >= cost.roofline_s * (1 - 1e-12)
    assert sum(v for k, v in cost.parts.items() if k != "link_busy") == pytest.approx(cost.seconds)


@settings(max_examples=200, deadline=None)
@given(c=curves, x=st.floats(0.01, 1e7))
def test_interpolation_is_the_curves(c, x):
    assert _Interp(c.points).at(x) == pytest.approx(c.at(x), rel=1e-12)


# A `pwbench hw --device cpu` measurement dict (harness/hw.py `measure`), with rates of the order
# docs/moegen.md reports for these CPUs.
MEASURED = {
    "measured_at": "2025-01-01T00:00:00", "memory_bandwidth_bytes_per_s": 20e9, "matmul_flops_per_s": 150e9,
    "matmul_flops_at_rows": {"1": 5e9, "2": 9e9, "4": 17e9, "8": 30e9, "32": 80e9, "128": 120e9, "512": 140e9,
                             "1024": 150e9},
    "argmax_bytes_per_s": 8e9, "elementwise_bytes_per_s": 12e9,
    "elementwise_bytes_per_s_at_tokens": {"256": 12e9, "8192": 5e9},
    "decode_attention_bytes_per_s": 5e9, "prefill_attention_flops_per_s": 30e9,
    "skinny_matmul_bytes_per_s": 15e9, "op_overhead_s": 3.4e-6,
}


def test_calibrate_efficiency_is_measured_over_peak():
    fit = fit_cpu_curves(MEASURED)
    n, bw, peak = 1024, 20e9, 150e9
    # rows 8: bound = FLOPs / bytes x bandwidth = 2 x 8 x n^2 / (4 x (n^2 + 16 n)) x 20e9 (< the peak)
    bound8 = 2 * 8 * n * n / (4 * (n * n + 16 * n)) * bw
    gemm = dict(fit["gemm"]["points"])
    assert gemm[8] == pytest.approx(30e9 / bound8)
    assert gemm[512] == pytest.approx(140e9 / 150e9)  # compute-bound there: over the peak
    assert gemm[1024] == pytest.approx(1.0)
    assert fit["grouped_gemm"]["points"] == fit["gemm"]["points"]
    assert fit["attention_decode"]["points"] == [[64, 5e9 / bw]]
    assert fit["attention_prefill"]["points"] == [[128, 30e9 / peak]]
    assert fit["elementwise"]["points"] == [[256.0, 12e9 / bw], [8192.0, 5e9 / bw]]
    assert fit["sample"]["points"] == [[256, 8e9 / bw]]
    dq = fit_cpu_curves({**MEASURED, "dequant_full_bytes_per_s_by_bits": {"packed": {"4": 0.4e9, "2": 0.3e9},
                                                                         "bitplanes": {"8": 1e9}}})
    assert dq["dequant_cpu_packed"]["points"] == [[2.0, 0.3e9 / bw], [4.0, 0.4e9 / bw]]
    assert dq["dequant_cpu_bitplanes"]["points"] == [[8.0, 1e9 / bw]]
    by_group = {"bitplanes": {"4": {"4e6": 1e9, "8e7": 0.5e9}}}
    grouped = fit_cpu_curves({**MEASURED, "dequant_group_bytes_per_s": by_group})
    assert grouped["dequant_group_bitplanes_4"]["points"] == [[4e6, 1e9 / bw], [8e7, 0.5e9 / bw]]
    assert "dequant_cpu_packed" not in fit  # not measured: no curve (the cost model states its count)
    assert cpu_rates(MEASURED) == {"memory_bytes_per_s": bw, "flops_per_s": {"float32": peak},
                                   "link_pinned_bytes_per_s": bw / 2, "op_overhead_s": 3.4e-6}
    for c in fit.values():  # every curve is one a profile takes
        Curve(tuple(map(tuple, c["points"])), c["source"])
        assert all(0 < e <= 1 for _, e in c["points"]) and c["source"]
    # A cache-resident kernel faster than the copy bandwidth is clipped, and says so.
    fast = fit_cpu_curves({**MEASURED, "elementwise_bytes_per_s_at_tokens": {"256": 30e9}})["elementwise"]
    assert fast["points"] == [[256.0, 1.0]] and "clipped" in fast["source"]
    with pytest.raises(ValueError, match="memory_bandwidth_bytes_per_s.*rerun `pwbench hw"):
        fit_cpu_curves({**MEASURED, "memory_bandwidth_bytes_per_s": 0})


def cpu_profile_from(m: dict) -> HardwareProfile:
    rates = cpu_rates(m)
    eff = {k: Curve(tuple(map(tuple, c["points"])), c["source"]) for k, c in fit_cpu_curves(m).items()}
    return replace(profile("cpu", bw=rates["memory_bytes_per_s"], peak=rates["flops_per_s"]["float32"],
                           link=rates["link_pinned_bytes_per_s"], op=rates["op_overhead_s"], step=0.0,
                           dtype="float32"), efficiency={"copy_overlap": flat(1.0), **eff})


@pytest.mark.parametrize(("model", "seqs"), [("demo", 1), ("demo", 4), ("demo", 16), ("demo", 64), ("demo", 256),
                                             ("mixtral", 4), ("mixtral", 8), ("mixtral", 128), ("mixtral", 512)])
def test_cpu_decode_step_matches_moegen(model, seqs):
    """The same `pwbench hw` measurements through moegen's model (all experts resident, KV on
    the device) and this one give the same decode step within a few percent (Mixtral at batches
    whose rows per expert and per step were measured). By design they differ in: dense FLOPs
    (every dense parameter here, the attention projections there), GEMM bytes at decode
    (moegen's skinny_matmul rate, here the matmul curve's roofline fraction), and between
    measured row counts (here the efficiency against the roofline bound is interpolated, there
    the FLOP/s: ~20% apart at 16 rows with these numbers), and torch calls per layer (moegen's
    model counts a mean over its steps, 180; this one a base and each decode attention group, one
    here: 122 + 34), which the comparison takes off."""
    from engines.moegen.cost import OPS_PER_LAYER as MOEGEN_OPS_PER_LAYER
    from engines.moegen.cost import BatchPlan, decode_cost
    from engines.moegen.hardware import hardware
    from engines.sim.cost import OPS_PER_DECODE_GROUP, OPS_PER_LAYER

    path = REPO / "engines" / "demo_model" / "config.json"
    raw = json.loads(path.read_text()) if model == "demo" else MIXTRAL
    mc = parse_config(raw, str(path))
    shape = model_shape(mc, 4)
    context = 200
    hw = hardware("test-cpu", on_cpu=True, link_bytes_per_s=None, peaks=MEASURED)
    plan = BatchPlan("device", seqs, seqs, 0, shape.total_experts, 1 << 30)
    expected = decode_cost(shape, hw, plan, seqs, context).total_s
    # Assignments spread evenly over the experts, as moegen's model assumes.
    active = min(shape.experts, seqs * shape.top_k)
    runs = tuple(ExpertRun(layer, seqs * shape.top_k // active, shape.expert_bytes, 32.0)
                 for layer in range(shape.moe_layers) for _ in range(active))
    # The engine's dense bytes read: every dense tensor but the embedding table (tied: it is the head).
    embed = 0 if mc.tie_word_embeddings else shape.vocab * shape.hidden * 4
    work = StepWork(decode_contexts=(context,) * seqs, experts=runs, dense_bytes_read=shape.dense_bytes - embed,
                    kv_bytes_per_token=shape.kv_bytes_per_token, logit_rows=seqs)
    got = CostModel(cpu_profile_from(MEASURED), shape, "float32").step(work).seconds
    fewer_calls = (MOEGEN_OPS_PER_LAYER["gqa"] - OPS_PER_LAYER["gqa"] - OPS_PER_DECODE_GROUP["gqa"]) * shape.layers
    assert got == pytest.approx(expected - fewer_calls * cpu_rates(MEASURED)["op_overhead_s"], rel=0.03)


def test_aggregated_runs_cost_as_separate_ones():
    model = CostModel(profile(), TINY, "bfloat16")
    runs = (*[ExpertRun(0, 3, 192, 16.0)] * 3, ExpertRun(0, 1, 48, 4.0))
    separate = model.step(replace(TINY_WORK, experts=runs))
    together = model.step(replace(TINY_WORK, experts=(ExpertRun(0, 3, 192, 16.0, count=3), runs[-1])))
    assert together.seconds == pytest.approx(separate.seconds)
    assert together.parts == pytest.approx(separate.parts) and together.roofline_s == separate.roofline_s


def test_bad_dtype_is_one_line():
    with pytest.raises(ValueError, match=r"no FLOP rate for dtype 'float8'.*\['bfloat16'\]") as err:
        CostModel(profile(), TINY, "float8")
    assert "\n" not in str(err.value)


def test_assumptions_name_every_number():
    model = CostModel(replace(profile(), efficiency={"gemm": flat(0.5)}), TINY, "bfloat16")
    a = model.assumptions()
    assert a["version"] == CostModel.VERSION and a["memory_bytes_per_s"] == 1e9 and a["op_overhead_s"] == 1e-6
    assert a["efficiency"]["gemm"]["points"] == [[1.0, 0.5]]
    assert "1.0 assumed" in a["efficiency"]["grouped_gemm"]["source"]
    json.dumps(a)
    assert math.isfinite(model.step(TINY_WORK).seconds)


def test_curves_measured_on_the_models_shapes_replace_the_generic_ones():
    """A profile's gemm@K / grouped_gemm@K / head@K (K: this shape's key) price that model's dense
    layers, experts and LM head; another shape's keyed curves are not read; without a head curve
    the LM head reads gemm."""
    key = shape_key(TINY)
    assert key == "d4-h1-q4-kv4-i8-v10-b2"
    shaped = profile(**{f"gemm@{key}": flat(0.25), f"grouped_gemm@{key}": flat(0.125), f"head@{key}": flat(1.0),
                        "gemm@d9-q9-kv9-i9-v9-b2": flat(0.01)})
    plain, mine = CostModel(profile(), TINY, "bfloat16"), CostModel(shaped, TINY, "bfloat16")
    a, b = plain.step(TINY_WORK).parts, mine.step(TINY_WORK).parts
    assert b["dense"] == pytest.approx(2 * a["dense"])  # gemm 0.5 -> 0.25
    assert b["experts"] == pytest.approx(2 * a["experts"])  # grouped_gemm 0.25 -> 0.125
    # head: 88 B / 1e9 at 1.0 instead of 0.5 (176 -> 88 ns), the argmax's 40 ns unchanged
    assert a["head"] == pytest.approx(216e-9) and b["head"] == pytest.approx(128e-9)
    other = CostModel(profile(**{"gemm@d9-q9-kv9-i9-v9-b2": flat(0.01)}), TINY, "bfloat16")
    assert other.step(TINY_WORK).parts == a
    notes = mine.assumptions()
    assert notes["shaped_curves"] == {k: f"{k}@{key}" for k in ("gemm", "grouped_gemm", "head")}
    # prefill attention: chunk 8 x (0 + 8 / 2) x 4 x 1 x 4 FLOPs / (1e12 x eff), eff 0.4 generic, 0.1 measured
    pre = StepWork(prefill=((8, 0),), kv_bytes_per_token=0, dense_bytes_read=288, logit_rows=1)
    att = CostModel(profile(**{f"attention_prefill@{key}": flat(0.1)}), TINY, "bfloat16").step(pre).parts
    assert att["attention"] == pytest.approx(4 * plain.step(pre).parts["attention"])
    # decode attention: 10 tokens x 16 B at 1e9 x 0.2 (measured on this model's cache) = 800 ns, not 200
    dec = CostModel(profile(**{f"attention_decode@{key}": flat(0.2)}), TINY, "bfloat16").step(TINY_WORK).parts
    assert a["attention"] == pytest.approx(200e-9) and dec["attention"] == pytest.approx(800e-9)
    assert f"gemm@{key}" in notes["efficiency"] and "gemm@d9-q9-kv9-i9-v9-b2" not in notes["efficiency"]
    assert "none" in plain.assumptions()["shaped_curves"]


def test_a_staircase_measured_at_every_row_count_prices_each_row_count_as_timed():
    """CPU F.linear below 16 rows takes the rows in blocks of three, each reading the whole weight:
    the LM head's time is a staircase in the rows (harness/bench/cpu_ops.py MODEL_ROWS). Fitted from
    every row count, the head of a step with r logit rows costs the time measured at r (plus the
    argmax, r x 10 x 2 B / (1e9 x 0.5) = r x 40 ns); fitted from powers of two only, 6 and 12 rows
    fall between the steps of the staircase."""
    from engines.sim.calibrate import fit_model_curves

    key = shape_key(TINY)

    def timed(r: int) -> float:  # 1 us per block of three rows, 1 us from 16 (the packed kernel)
        return 1e-6 if r >= 16 else 1e-6 * math.ceil(r / 3)

    def head_s(rows: tuple[int, ...], logit_rows: int) -> float:
        entry = {"dtype_bytes": 2, "params": {"head": 44}, "seconds": {"head": {str(r): timed(r) for r in rows}}}
        curve = fit_model_curves(key, entry, 1e9, 1e12)[f"head@{key}"]
        model = CostModel(profile(**{f"head@{key}": Curve(tuple(map(tuple, curve["points"])), "fit")}), TINY,
                          "bfloat16")
        return model.step(replace(TINY_WORK, logit_rows=logit_rows)).parts["head"]

    every = tuple(range(1, 17))
    for r in (1, 3, 4, 6, 7, 12, 15, 16):
        assert head_s(every, r) == pytest.approx(timed(r) + r * 40e-9)
    powers = (1, 2, 4, 8, 16)
    assert head_s(powers, 6) > 1.1 * head_s(every, 6)  # between 4 rows' 2 us and 8 rows' 3 us
    assert head_s(powers, 12) < 0.8 * head_s(every, 12)  # between 8 rows' 3 us and 16 rows' 1 us


def test_model_shape_curves_are_the_roofline_over_the_seconds_measured():
    """engines/sim/calibrate.py: a model's shape measurement (seconds by part and rows) -> curves
    keyed by its shape; the FLOP peak is the best GEMM rate measured, so none clips."""
    from engines.sim.calibrate import best_flops, fit_model_curves

    entry = {"model": "m", "measured_at": "t", "dtype_bytes": 4, "matrices": {"expert": [[16, 4], [4, 8]]},
             "params": {"expert": 96, "head": 40},
             "seconds": {"expert": {"1": 1e-6, "64": 2e-6}, "head": {"1": 1e-6}}}
    bw, peak = 1e9, 1e10
    curves = fit_model_curves("K", entry, bw, peak)
    assert set(curves) == {"grouped_gemm@K", "head@K"}
    # 1 row: max(4 x 96 B / 1e9, 2 x 96 / 1e10) = 384 ns over 1 us; 64 rows: max(384 ns, 1228.8 ns) / 2 us
    assert curves["grouped_gemm@K"]["points"] == [[1.0, pytest.approx(0.384)], [64.0, pytest.approx(0.6144)]]
    assert "[16, 4] + [4, 8]" in curves["grouped_gemm@K"]["source"]
    m = {"memory_bandwidth_bytes_per_s": bw, "matmul_flops_per_s": 5e9, "matmul_flops_at_rows": {"1": 1e8},
         "model_gemm": {"K": entry}}
    # the best rate: 64 rows x 2 x 96 FLOPs in 2 us = 6.144 GFLOP/s, above the 1024^3 matmul's 5
    assert best_flops(m) == (pytest.approx(6.144e9), "model_gemm[K] (a GEMM of that model's shapes)")
    assert cpu_rates(m)["flops_per_s"]["float32"] == pytest.approx(6.144e9)
    fit = fit_cpu_curves(m)
    assert fit["grouped_gemm@K"]["points"][-1] == [64.0, pytest.approx(1.0)]
    # causal SDPA of 2 heads of 4 over a 10-token chunk in 1 us: 4 x 2 x 4 x 10 x 10 / 2 FLOPs / peak / seconds
    att = {**entry, "attention": {"heads": 2, "kv_heads": 1, "head_dim": 4}, "seconds": {"attention": {"10": 1e-6}}}
    assert fit_model_curves("K", att, bw, peak)["attention_prefill@K"]["points"] == [[10.0, pytest.approx(0.16)]]
    # one sequence's decode attention at 128, 512 and 1536 tokens: 50 us + 0.3 us a token exactly; the
    # cache's 640 bytes a token over 0.3 us at 1e9 B/s = 2.13 (clipped to 1), at the contexts' mean
    dec = {**entry, "decode_kv_bytes_per_token": 640,
           "seconds": {"decode_attention": {str(c): 5e-5 + 3e-7 * c for c in (128, 512, 1536)}}}
    curve = fit_model_curves("K", dec, bw, peak)["attention_decode@K"]
    assert curve["points"] == [[pytest.approx(2176 / 3), 1.0]] and "clipped" in curve["source"]
    assert fit_model_curves("K", dec, 1e10, peak)["attention_decode@K"]["points"][0][1] == pytest.approx(640 / 3e3)
    # after 10 tokens of context, the masked 10 x 20 rectangle in 2 us: 4 x 2 x 4 x 200 / peak / seconds
    att["seconds"]["attention_context"] = {"10": 2e-6}
    assert fit_model_curves("K", att, bw, peak)["attention_prefill_context@K"]["points"] == [
        [10.0, pytest.approx(0.32)]]
    assert fit["gemm"]["points"][0][1] <= 1
    # one expert's dequantization (96 params, 384 full-width bytes) in 2 us at 4 bits, 1 us at 8
    dq = {**entry, "dequant_group_size": 4, "seconds": {"dequant_packed": {"4": 2e-6, "8": 1e-6}}}
    curve = fit_model_curves("K", dq, bw, peak)["dequant_cpu_packed@K"]
    assert curve["points"] == [[4.0, pytest.approx(0.192)], [8.0, pytest.approx(0.384)]]
    assert "group 4" in curve["source"] and "[16, 4] + [4, 8]" in curve["source"]
    assert "its torch calls included" in curve["source"]  # all of a packed run's: none priced again
    # the expert's GEMMs right after its dequantization (weights in the caches: the FLOPs alone bound
    # them), 1 row in 0.5 us: 2 x 96 FLOPs / 1e10 = 19.2 ns over 0.5 us
    hot = {**entry, "params": {"expert_dequantized": 96}, "seconds": {"expert_dequantized": {"1": 5e-7}}}
    curve = fit_model_curves("K", hot, bw, peak)["grouped_gemm_dequantized@K"]
    assert curve["points"] == [[1.0, pytest.approx(0.0384)]] and "FLOPs at the peak" in curve["source"]

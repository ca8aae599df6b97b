"""GPTQ, AWQ and MoE calibration against properties that hold whatever the implementation:
GPTQ with uncorrelated inputs is round-to-nearest (the paper's update vanishes), act-order
groups follow the Hessian diagonal, AWQ's search includes RTN, and the calibration pass routes
layer 0 exactly as transformers' own Mixtral router does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tiny_models import build_hf_model

from engines.quant.awq import act_scale, linear_loss, search_scale
from engines.quant.calibrate import QuantizeOptions, quantize_model, random_prompts
from engines.quant.gptq import gptq_quantize, hessian
from engines.quant.qweight import dequantize, quantize_rtn, unpack
from engines.runtime.checkpoint import load_weights, open_checkpoint
from engines.runtime.transfer import TransferLedger

CPU = torch.device("cpu")


def correlated_inputs(n: int, d: int, seed: int) -> torch.Tensor:
    """Inputs with correlated channels of very different sizes, as LLM activations have."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=torch.Generator().manual_seed(99)) / d**0.5
    sizes = torch.logspace(-1, 1, d)[torch.randperm(d, generator=torch.Generator().manual_seed(98))]
    return (torch.randn(n, d, generator=g) @ mix + 0.3 * torch.randn(n, d, generator=g)) * sizes


def output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float((x @ (w_hat - w).T).pow(2).mean())


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    for bits, symmetric in [(4, False), (3, True), (2, False)]:
        got = gptq_quantize(w, torch.eye(128), bits, 32, symmetric, scale_dtype=torch.float32)
        want = quantize_rtn(w, bits, 32, symmetric, scale_dtype=torch.float32)
        assert torch.equal(unpack(got)[0], unpack(want)[0])
        assert torch.equal(got.scales, want.scales)
        assert torch.equal(unpack(got)[1], unpack(want)[1])


def test_gptq_beats_rtn_on_held_out_correlated_inputs():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    x, held_out = correlated_inputs(2048, 256, 2), correlated_inputs(1024, 256, 3)
    for bits in (4, 3):
        for act_order in (False, True):
            q = gptq_quantize(w, hessian(x), bits, 64, act_order=act_order)
            rtn = quantize_rtn(w, bits, 64, scale_dtype=torch.float16)
            gptq_err = output_error(held_out, w, dequantize(q, torch.float32))
            rtn_err = output_error(held_out, w, dequantize(rtn, torch.float32))
            assert gptq_err < 0.8 * rtn_err, (bits, act_order, gptq_err, rtn_err)


def test_act_order_groups_follow_the_hessian_diagonal():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(4))
    x = correlated_inputs(512, 128, 5)
    h = hessian(x)
    q = gptq_quantize(w, h, 4, 32, act_order=True)
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    expected = torch.empty(128, dtype=torch.long)
    expected[order] = torch.arange(128) // 32  # the k-th largest diagonal goes to group k // 32
    assert torch.equal(q.g_idx.long(), expected)


def test_awq_search_includes_rtn_and_helps_outlier_channels():
    x = correlated_inputs(1024, 128, 6)
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(7)) * 0.05
    choice = search_scale(act_scale(x), linear_loss(x, w, 4, 32, False))
    plain = quantize_rtn(w, 4, 32)
    assert abs(choice.rtn_loss - output_error(x, w, dequantize(plain, torch.float32))) < 0.05 * choice.rtn_loss
    assert choice.alpha > 0 and choice.loss < choice.rtn_loss


def test_calibration_routes_layer_0_like_transformers_and_tops_up_experts(checkpoints):
    folder = checkpoints("mixtral")
    ckpt = open_checkpoint(folder)
    weights, experts = load_weights(ckpt, CPU, torch.float32, TransferLedger(CPU))
    prompts = random_prompts(ckpt.config.vocab_size, 6, 40, seed=3, exclude=(2,))
    minimum = 150  # about the mean share of the 480 assignments; some experts get fewer
    result = quantize_model(ckpt.config, weights, experts, prompts,
                            QuantizeOptions("gptq", 4, 32, min_expert_tokens=minimum))

    model = build_hf_model("mixtral")
    counts = torch.zeros(ckpt.config.num_experts, dtype=torch.long)
    with torch.no_grad():
        for p in prompts:
            logits = model(torch.tensor([p]), output_router_logits=True).router_logits[0]
            counts += torch.bincount(torch.topk(F.softmax(logits, -1), 2).indices.flatten(), minlength=6)
    layer0 = result.layers[0]
    assert list(layer0.routed) == counts.tolist()
    for report in result.layers:
        assert sum(report.routed) == 2 * result.tokens
        assert all(n + a == max(n, minimum) for n, a in zip(report.routed, report.added))
    assert any(a > 0 for r in result.layers for a in r.added)
    assert sorted(result.experts) == [0, 1]

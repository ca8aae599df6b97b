"""MXFP4 experts and gpt-oss's biased, clamped experts in the quantized ops.

Oracles: the OCP Microscaling v1.0 definition of E2M1 and E8M0 decoded one value at a time in
Python floats, and a per-token loop over each token's experts written from gpt-oss's expert
definition (gate/up with bias, gate <= limit, |up| <= limit, (up + 1) * gate * sigmoid(alpha *
gate), down with bias). The Triton kernels run under the interpreter on CPU (small shapes).
"""

from __future__ import annotations

import math

import pytest
import torch

from engines.quant.ops import fused_moe, fused_moe_reference, mxfp4_matmul, mxfp4_matmul_reference
from engines.quant.qweight import QuantizedExperts, dequantize, quantize_rtn
from engines.runtime.experts import Dispatch, dispatch, grouped_swiglu, swiglu
from engines.runtime.mxfp4 import (
    Mxfp4Expert,
    Mxfp4Experts,
    Mxfp4Weight,
    dequantize_mxfp4,
    mxfp4_expert_forward,
    mxfp4_moe_reference,
)

E, I, D, T, A = 3, 32, 64, 6, 2
CLAMP = (1.5, 1.702)
# Triton runs compiled on a CUDA device where there is one, else interpreted on CPU (conftest).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def to_device(x, d, experts):
    """The inputs of one fused_moe call on DEVICE (Dispatch's counts stay on the host)."""
    d = Dispatch(d.token_index.to(DEVICE), d.weights.to(DEVICE), d.counts)
    if isinstance(experts, Mxfp4Experts):
        moved = Mxfp4Experts(experts.gate_up.map_tensors(lambda t: t.to(DEVICE)),
                             experts.down.map_tensors(lambda t: t.to(DEVICE)), experts.gate_up_bias.to(DEVICE),
                             experts.down_bias.to(DEVICE), experts.clamp)
    else:
        moved = QuantizedExperts(experts.gate_up.to(DEVICE), experts.down.to(DEVICE), experts.gate_up_bias.to(DEVICE),
                                 experts.down_bias.to(DEVICE), experts.clamp)
    return x.to(DEVICE), d, moved


def e2m1(code: int) -> float:
    """OCP E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man * 0.5) * 2.0 ** (exp - 1))


def random_weight(*shape: int, seed: int) -> Mxfp4Weight:
    g = torch.Generator().manual_seed(seed)
    *lead, cols = shape
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 128, (*lead, cols // 32), dtype=torch.uint8, generator=g)
    return Mxfp4Weight(blocks, scales)


def random_experts(seed: int = 0) -> Mxfp4Experts:
    g = torch.Generator().manual_seed(seed)
    return Mxfp4Experts(random_weight(E, 2 * I, D, seed=seed), random_weight(E, D, I, seed=seed + 1),
                        torch.randn(E, 2 * I, generator=g), torch.randn(E, D, generator=g), CLAMP)


def random_dispatch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g) * 0.1
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    weights = torch.rand(T, A, generator=g)
    return x, ids, weights, dispatch(ids, weights, torch.bincount(ids.flatten(), minlength=E).tolist())


def loop_reference(x, ids, weights, gate_up, down, gate_up_bias, down_bias, clamp) -> torch.Tensor:
    """Each token alone, each of its experts alone, in float64."""
    limit, alpha = clamp
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = gate_up[e].double() @ x[t].double() + gate_up_bias[e].double()
            gate, up = h[:I].clamp(max=limit), h[I:].clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out[t] += float(weights[t, k]) * (down[e].double() @ act + down_bias[e].double())
    return out


def test_dequantize_follows_the_ocp_definition():
    blocks = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # every byte once
    scales = torch.tensor([0, 1, 100, 126, 127, 128, 130, 150, 200, 220, 127, 127, 127, 127, 127, 127],
                          dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales, torch.float64)  # [16 * 32]; the math runs in float32
    want = [e2m1((b >> (4 * half)) & 0xF) * 2.0 ** (int(scales[g]) - 127)
            for g in range(16) for b in blocks[g].tolist() for half in (0, 1)]
    assert got.tolist() == want
    assert math.copysign(1.0, got[1].item()) == 1.0 and got[16].item() == 0.0  # byte 8's low nibble: -0


def test_records_count_four_bit_bytes():
    experts = random_experts()
    blocks = E * (2 * I * D + D * I) // 2
    scale_bytes = E * (2 * I * D + D * I) // 32
    biases = E * (2 * I + D) * 4
    assert experts.nbytes() == blocks + scale_bytes + biases
    assert experts.expert_nbytes(1) == experts.expert(1).nbytes() == (blocks + scale_bytes + biases) // E


def test_reference_equals_dense_experts_bit_for_bit():
    experts = random_experts()
    x, _, _, d = random_dispatch()
    assert torch.equal(mxfp4_moe_reference(x, d, experts), grouped_swiglu(x, d, experts.dequantize(torch.float32)))


def test_reference_matches_per_token_loop():
    experts = random_experts()
    x, ids, weights, d = random_dispatch()
    dense = experts.dequantize(torch.float64)
    want = loop_reference(x, ids, weights, dense.gate_up, dense.down, dense.gate_up_bias, dense.down_bias, CLAMP)
    got = mxfp4_moe_reference(x, d, experts)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


def test_one_expert_from_its_parts():
    """What offload/pagedweight will run: an expert rebuilt from its part tensors."""
    experts = random_experts()
    x, _, _, d = random_dispatch()
    part = Mxfp4Expert.from_tensors({k: v.clone() for k, v in experts.expert(2).tensors().items()}, CLAMP)
    assert set(experts.expert(2).tensors()) == {"gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales",
                                                "gate_up_bias", "down_bias"}
    dense = experts.dequantize(torch.float32)
    want = swiglu(x, dense.gate_up[2], dense.down[2], dense.gate_up_bias[2], dense.down_bias[2], CLAMP)
    assert torch.equal(mxfp4_expert_forward(x, part), want)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_mxfp4_matmul(impl, use_kernels):
    use_kernels(impl)
    w = random_weight(48, D, seed=5)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(1))
    want = x.double() @ w.dequantize(torch.float64).T
    got = mxfp4_matmul(x.to(DEVICE), w.map_tensors(lambda t: t.to(DEVICE))).cpu()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(mxfp4_matmul_reference(x, w), x @ w.dequantize(torch.float32).T)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fused_moe_mxfp4_biases_and_clamp(impl, use_kernels):
    use_kernels(impl)
    experts = random_experts(seed=2)
    x, ids, weights, d = random_dispatch(seed=3)
    dense = experts.dequantize(torch.float64)
    want = loop_reference(x, ids, weights, dense.gate_up, dense.down, dense.gate_up_bias, dense.down_bias, CLAMP)
    got = fused_moe(*to_device(x, d, experts)).cpu()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fused_moe_quantized_with_biases_and_clamp(impl, use_kernels):
    """pwbench's group-wise experts carry gpt-oss's biases and clamp through both paths."""
    use_kernels(impl)
    g = torch.Generator().manual_seed(4)
    q = QuantizedExperts(quantize_rtn(torch.randn(E, 2 * I, D, generator=g), 8, 32),
                         quantize_rtn(torch.randn(E, D, I, generator=g) * 0.1, 4, 32),
                         torch.randn(E, 2 * I, generator=g), torch.randn(E, D, generator=g), CLAMP)
    x, ids, weights, d = random_dispatch(seed=5)
    want = loop_reference(x, ids, weights, dequantize(q.gate_up, torch.float64), dequantize(q.down, torch.float64),
                          q.gate_up_bias, q.down_bias, CLAMP)
    got = fused_moe(*to_device(x, d, q)).cpu()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(fused_moe_reference(x, d, q), fused_moe_reference(x, d, q))  # deterministic
    assert q.nbytes() == q.gate_up.nbytes() + q.down.nbytes() + E * (2 * I + D) * 4

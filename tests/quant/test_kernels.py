"""Triton kernels against the torch reference (interpreter on CPU, compiled on a GPU), and the
reference against the dense runtime math on rtn.py's weights. Shapes stay tiny: the
interpreter runs every program in numpy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.quant.ops import dequant_matmul, dequant_matmul_reference, fused_moe, fused_moe_reference
from engines.quant.qweight import (
    SUPPORTED_BITS,
    QuantizedExperts,
    pack,
    quantize_experts,
    quantize_rtn,
    stack,
    unpack,
)
from engines.quant.rtn import rtn_fake_quantize
from engines.runtime.experts import Dispatch, dispatch, grouped_swiglu, route
from engines.runtime.weights import DenseExperts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# max |kernel - reference| / max |reference|. float32 is what CPU runs (interpreter); the half
# types only run on a GPU, where tensor cores round products and SwiGLU's input to 8/11 bits.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPES = list(TOLERANCE) if DEVICE.type == "cuda" else [torch.float32]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if not want.numel():
        return
    scale = want.float().abs().max().clamp(min=1e-6)
    err = (got.float() - want.float()).abs().max() / scale
    assert err <= TOLERANCE[want.dtype], f"relative error {err:.2e} > {TOLERANCE[want.dtype]:.0e} ({want.dtype})"


def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def act_order(w: torch.Tensor, bits: int, group_size: int, seed: int):
    """A GPTQ act-order style record: groups are a random permutation of the input columns."""
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(seed)).to(w.device)
    qp = quantize_rtn(w[:, perm], bits, group_size)
    codes_p, zeros = unpack(qp)
    codes = torch.empty_like(codes_p)
    codes[:, perm] = codes_p
    g_idx = torch.empty(w.shape[1], dtype=torch.int32, device=w.device)
    g_idx[perm] = torch.arange(w.shape[1], dtype=torch.int32, device=w.device) // group_size
    return pack(codes, qp.scales, zeros, bits, group_size, g_idx)


def skewed_dispatch(tokens: int, experts: int, dtype, seed: int) -> Dispatch:
    """Top-2 routing where expert 0 gets no token, expert 1 exactly one, the others many."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts - 2, generator=gen)[:2] + 2 for _ in range(tokens)])
    ids[0, 0] = 1
    weights = torch.rand(tokens, 2, generator=gen)
    counts = torch.bincount(ids.flatten(), minlength=experts).tolist()
    assert counts[0] == 0 and counts[1] == 1 and min(counts[2:]) > 1
    return dispatch(ids.to(DEVICE), weights.to(DEVICE, dtype), counts)


# --- the torch reference against the dense math ----------------------------------------------


def test_reference_dequant_matmul_is_linear_on_rtn_weights():
    w, x = randn(37, 64, seed=0), randn(5, 64, seed=1)
    want = F.linear(x, rtn_fake_quantize(w, 3, 32))
    assert torch.equal(dequant_matmul_reference(x, quantize_rtn(w, 3, 32)), want)


def test_reference_fused_moe_is_grouped_swiglu_on_rtn_weights():
    dense = DenseExperts(randn(4, 128, 64, seed=2, scale=0.1), randn(4, 64, 64, seed=3, scale=0.1))
    x, d = randn(9, 64, seed=4), skewed_dispatch(9, 4, torch.float32, seed=5)
    fake = DenseExperts(rtn_fake_quantize(dense.gate_up, 4, 32), rtn_fake_quantize(dense.down, 4, 32))
    assert torch.equal(fused_moe_reference(x, d, quantize_experts(dense, 4, 32)), grouped_swiglu(x, d, fake))


# --- Triton against the reference -------------------------------------------------------------


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_dequant_matmul_kernel(use_kernels, bits, group_size, symmetric):
    use_kernels("triton")
    for dtype in DTYPES:
        w = randn(37, 2 * group_size, seed=bits, dtype=dtype)  # odd number of outputs
        x = randn(7, 2 * group_size, seed=group_size, dtype=dtype)
        qw = quantize_rtn(w, bits, group_size, symmetric)
        assert_close(dequant_matmul(x, qw), dequant_matmul_reference(x, qw))


@pytest.mark.parametrize("bits", [3, 4])
def test_dequant_matmul_kernel_act_order(use_kernels, bits):
    use_kernels("triton")
    qw = act_order(randn(45, 128, seed=7), bits, 32, seed=8)
    assert qw.g_idx is not None
    x = randn(3, 128, seed=9)
    assert_close(dequant_matmul(x, qw), dequant_matmul_reference(x, qw))


def test_dequant_matmul_kernel_one_and_no_tokens(use_kernels):
    use_kernels("triton")
    qw = quantize_rtn(randn(50, 64, seed=10), 2, 32)
    for tokens in (1, 0):
        x = randn(tokens, 64, seed=11)
        assert_close(dequant_matmul(x, qw), dequant_matmul_reference(x, qw))


@pytest.mark.parametrize("bits, group_size, symmetric", [
    (2, 32, False), (3, 32, True), (3, 64, False), (4, 64, True), (4, 128, False), (8, 32, False),
])
def test_fused_moe_kernel(use_kernels, bits, group_size, symmetric):
    use_kernels("triton")
    hidden = inter = 2 * group_size if group_size < 128 else group_size
    for dtype in DTYPES:
        dense = DenseExperts(randn(4, 2 * inter, hidden, seed=bits, dtype=dtype, scale=0.1),
                             randn(4, hidden, inter, seed=bits + 1, dtype=dtype, scale=0.1))
        experts = quantize_experts(dense, bits, group_size, symmetric)
        x, d = randn(11, hidden, seed=12, dtype=dtype), skewed_dispatch(11, 4, dtype, seed=13)
        assert_close(fused_moe(x, d, experts), fused_moe_reference(x, d, experts))


def test_fused_moe_kernel_act_order_experts(use_kernels):
    use_kernels("triton")
    gate_up = stack([act_order(randn(128, 64, seed=20 + e, scale=0.1), 4, 32, seed=e) for e in range(4)])
    down = stack([quantize_rtn(randn(64, 64, seed=30 + e, scale=0.1), 4, 32) for e in range(4)])
    experts = QuantizedExperts(gate_up, down)
    x, d = randn(6, 64, seed=14), skewed_dispatch(6, 4, torch.float32, seed=15)
    assert_close(fused_moe(x, d, experts), fused_moe_reference(x, d, experts))


def test_fused_moe_no_tokens(use_kernels):
    use_kernels("triton")
    experts = quantize_experts(DenseExperts(randn(2, 64, 32, seed=16), randn(2, 32, 32, seed=17)), 4, 32)
    empty = Dispatch(torch.zeros(0, dtype=torch.long, device=DEVICE), torch.zeros(0, device=DEVICE), [0, 0])
    out = fused_moe(randn(0, 32, seed=18), empty, experts)
    assert out.shape == (0, 32)



# --- GPU: larger shapes, compiled kernels, half precision -------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_dequant_matmul_large(use_kernels, bits, group_size, dtype):
    use_kernels("triton")
    w = randn(3000, 2048, seed=bits, dtype=dtype, scale=0.02)
    qw = quantize_rtn(w, bits, group_size, symmetric=bits == 8)
    for tokens in (1, 16, 257):
        x = randn(tokens, 2048, seed=tokens, dtype=dtype)
        assert_close(dequant_matmul(x, qw), dequant_matmul_reference(x, qw))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fused_moe_large(use_kernels, bits, dtype):
    use_kernels("triton")
    experts_n, hidden, inter = 8, 1024, 768
    dense = DenseExperts(randn(experts_n, 2 * inter, hidden, seed=bits, dtype=dtype, scale=0.03),
                         randn(experts_n, hidden, inter, seed=bits + 1, dtype=dtype, scale=0.03))
    experts = quantize_experts(dense, bits, 128)
    router = randn(experts_n, hidden, seed=99, dtype=dtype)
    for tokens in (1, 33, 512):
        x = randn(tokens, hidden, seed=tokens, dtype=dtype)
        ids, weights = route(x, router, 2, normalize=True)
        d = dispatch(ids, weights, torch.bincount(ids.flatten(), minlength=experts_n).tolist())
        assert_close(fused_moe(x, d, experts), fused_moe_reference(x, d, experts))

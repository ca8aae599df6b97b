"""Our packed format: bit packing against a big-integer oracle, exact round trips for every bit
width / group size / symmetry, RTN against rtn.py, stacking, and one-line errors."""

from __future__ import annotations

import pytest
import torch

from engines.base import ModelLoadError
from engines.quant.qweight import (
    SUPPORTED_BITS,
    SUPPORTED_GROUP_SIZES,
    QuantFormatError,
    QuantizedExperts,
    QuantizedWeight,
    concat_rows,
    dequantize,
    pack,
    pack_bits,
    quantize_experts,
    quantize_rtn,
    stack,
    unpack,
    unpack_bits,
)
from engines.quant.rtn import rtn_fake_quantize
from engines.runtime.weights import DenseExperts

SCHEMES = [(b, g, s) for b in SUPPORTED_BITS for g in SUPPORTED_GROUP_SIZES for s in (False, True)]


def stream_words(values: list[int], bits: int) -> list[int]:
    """Oracle: one Python integer as the row's bit stream, value i at bit i*bits, cut into
    32-bit words, each read as a signed int32."""
    stream = 0
    for i, v in enumerate(values):
        stream |= v << (i * bits)
    words = -(-len(values) * bits // 32)
    out = [(stream >> (32 * j)) & 0xFFFFFFFF for j in range(words)]
    return [w - (1 << 32) if w >= 1 << 31 else w for w in out]


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("n", [1, 7, 32, 45, 96])
def test_pack_bits_matches_a_big_integer_bit_stream(bits, n):
    gen = torch.Generator().manual_seed(bits * 100 + n)
    values = torch.randint(0, 1 << bits, (3, n), generator=gen)
    packed = pack_bits(values, bits)
    assert packed.dtype == torch.int32
    assert packed.tolist() == [stream_words(row, bits) for row in values.tolist()]
    assert torch.equal(unpack_bits(packed, bits, n).long(), values)


@pytest.mark.parametrize("bits, group_size, symmetric", SCHEMES)
def test_pack_unpack_round_trips_exactly(bits, group_size, symmetric):
    gen = torch.Generator().manual_seed(bits + group_size)
    out, inp = 37, 2 * group_size  # odd number of output rows
    codes = torch.randint(0, 1 << bits, (out, inp), generator=gen)
    zeros = None if symmetric else torch.randint(0, 1 << bits, (out, inp // group_size), generator=gen)
    qw = pack(codes, torch.rand(out, inp // group_size, generator=gen), zeros, bits, group_size)
    assert qw.qdata.shape == (out, inp * bits // 32)  # dense: no wasted bit, 3-bit included
    got_codes, got_zeros = unpack(qw)
    assert torch.equal(got_codes.long(), codes)
    want_zeros = torch.full_like(got_zeros, 1 << (bits - 1)) if symmetric else zeros
    assert torch.equal(got_zeros.long(), want_zeros.long())
    again = pack(got_codes, qw.scales, None if symmetric else got_zeros, bits, group_size)
    assert torch.equal(again.qdata, qw.qdata)


@pytest.mark.parametrize("bits, group_size, symmetric", SCHEMES)
def test_dequantize_of_rtn_equals_rtn_fake_quantize(bits, group_size, symmetric):
    w = torch.randn(2, 37, 256, generator=torch.Generator().manual_seed(bits))  # stacked, odd rows
    qw = quantize_rtn(w, bits, group_size, symmetric)
    assert qw.lead == (2,) and qw.shape == (37, 256)
    assert torch.equal(dequantize(qw), rtn_fake_quantize(w, bits, group_size, symmetric))


def test_one_signed_group_keeps_zero_in_range():
    """rtn.py's zero point leaves [0, 2^bits) for a group of one sign; ours widens the range
    to include 0 (as GPTQ does), so it packs, and the error stays within one step."""
    w = torch.rand(4, 32) + 1.0  # every weight in [1, 2)
    qw = quantize_rtn(w, 4, 32)
    _, zeros = unpack(qw)
    assert int(zeros.max()) == 0
    step = qw.scales.float().repeat_interleave(32, dim=-1)
    assert bool(((dequantize(qw) - w).abs() <= step / 2 + 1e-6).all())


def test_half_precision_scales_and_explicit_scale_dtype():
    w = torch.randn(16, 64).to(torch.bfloat16)
    assert quantize_rtn(w, 4, 32).scales.dtype == torch.bfloat16
    qw = quantize_rtn(w, 4, 32, scale_dtype=torch.float32)
    assert torch.equal(dequantize(qw, torch.bfloat16), rtn_fake_quantize(w, 4, 32))


def test_nbytes_is_bits_per_weight_plus_scales_and_zeros():
    qw = quantize_rtn(torch.randn(64, 256).half(), 4, 128)
    assert qw.nbytes() == 64 * 256 // 2 + 64 * 2 * 2 + 64 * 1 * 4  # codes, fp16 scales, one zero word/row


def test_stack_concat_and_expert_views():
    gen = torch.Generator().manual_seed(0)
    gate, up = (quantize_rtn(torch.randn(32, 64, generator=gen), 3, 32) for _ in range(2))
    fused = concat_rows([gate, up])
    assert fused.shape == (64, 64)
    assert torch.equal(dequantize(fused), torch.cat([dequantize(gate), dequantize(up)]))
    stacked = stack([fused, fused])
    assert stacked.lead == (2,)
    assert torch.equal(dequantize(stacked.expert(1)), dequantize(fused))


def test_quantize_experts_matches_per_matrix_rtn():
    gen = torch.Generator().manual_seed(1)
    dense = DenseExperts(torch.randn(3, 64, 32, generator=gen), torch.randn(3, 32, 32, generator=gen))
    qe = quantize_experts(dense, 4, 32, symmetric=True)
    assert qe.num_experts == 3
    assert torch.equal(dequantize(qe.down), rtn_fake_quantize(dense.down, 4, 32, symmetric=True))
    assert qe.nbytes() == qe.gate_up.nbytes() + qe.down.nbytes()


def test_errors_name_the_field_and_the_supported_values():
    w = torch.randn(8, 64)
    with pytest.raises(QuantFormatError, match=r"bits must be one of \(2, 3, 4, 8\), got 5"):
        quantize_rtn(w, 5, 32)
    with pytest.raises(QuantFormatError, match=r"group_size must be one of \(32, 64, 128\), got 16"):
        quantize_rtn(w, 4, 16)
    with pytest.raises(QuantFormatError, match="group_size 128 must divide the input dimension 64"):
        quantize_rtn(w, 4, 128)
    assert issubclass(QuantFormatError, ModelLoadError)
    qw = quantize_rtn(w, 4, 32)
    with pytest.raises(QuantFormatError, match=r"QuantizedWeight.qdata: expected shape \[8, 8\]"):
        QuantizedWeight(qw.qdata[:, :4], qw.scales, qw.zeros, 4, 32, False, (8, 64))
    with pytest.raises(QuantFormatError, match="zeros: must be None exactly when symmetric"):
        QuantizedWeight(qw.qdata, qw.scales, qw.zeros, 4, 32, True, (8, 64))
    codes, zeros = unpack(qw)
    act_order = pack(codes, qw.scales, zeros, 4, 32, g_idx=torch.arange(64, dtype=torch.int32).flip(0) // 32)
    with pytest.raises(QuantFormatError, match="different g_idx"):
        concat_rows([qw, act_order])
    with pytest.raises(QuantFormatError, match="does not fit down"):
        QuantizedExperts(stack([qw]), stack([qw]))

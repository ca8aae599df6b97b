"""Checkpoint formats against tensors packed by hand, in slow obvious loops, from each format's
published definition (AutoGPTQ/GPTQModel qlinear pack, AutoAWQ WQLinear_GEMM.from_linear,
compressed-tensors pack_to_int32), then converted back bit for bit; plus one-line errors."""

from __future__ import annotations

import re

import pytest
import torch

from engines.quant.calibrate import QuantizeOptions
from engines.quant.convert import (
    from_awq,
    from_compressed_tensors,
    from_gptq,
    to_awq,
    to_compressed_tensors,
    to_gptq,
)
from engines.quant.export import folder_scheme
from engines.quant.hf_format import (
    FolderScheme,
    only_experts_dynamic,
    quantization_config,
    read_scheme,
)
from engines.quant.qweight import SUPPORTED_BITS, QuantFormatError, dequantize

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column order_map[i]


def to_int32(word: int) -> int:
    word &= 0xFFFFFFFF
    return word - (1 << 32) if word >= 1 << 31 else word


def pack_sequential(values: list[int], bits: int) -> list[int]:
    """Value i at bit i*bits of one long stream (GPTQ along a column; compressed-tensors along a
    row), 32 bits per word. For 3 bits this is AutoGPTQ's 10 + split + 10 + split + 10 rule."""
    if bits == 3:
        return pack_gptq_3bit(values)
    per = 32 // bits
    return [to_int32(sum(v << (bits * j) for j, v in enumerate(values[i : i + per])))
            for i in range(0, len(values), per)]


def pack_gptq_3bit(values: list[int]) -> list[int]:
    """AutoGPTQ's 3-bit loop: 32 values -> 3 words, values 10 and 21 split across words."""
    assert len(values) % 32 == 0
    words = []
    for i in range(0, len(values), 32):
        v = values[i : i + 32]
        w0 = sum(v[j] << (3 * j) for j in range(10)) | (v[10] << 30)
        w1 = ((v[10] >> 2) & 1) | sum(v[11 + j] << (3 * j + 1) for j in range(10)) | (v[21] << 31)
        w2 = ((v[21] >> 1) & 3) | sum(v[22 + j] << (3 * j + 2) for j in range(10))
        words += [to_int32(w0), to_int32(w1), to_int32(w2)]
    return words


def pack_dense_padded(values: list[int], bits: int) -> list[int]:
    """Dense stream for any length (compressed-tensors zero points along `out`): pad to 32 values."""
    padded = values + [0] * (-len(values) % 32)
    return pack_sequential(padded, bits)[: -(-len(values) * bits // 32)]


def columns(t: torch.Tensor) -> list[list[int]]:
    return t.T.tolist()


def oracle_weight(codes, zeros, scales, g_idx):
    """W[n, k] = (code[n, k] - zero[n, g(k)]) * scale[n, g(k)], written out per column."""
    w = torch.empty(codes.shape)
    for k in range(codes.shape[1]):
        g = int(g_idx[k])
        w[:, k] = (codes[:, k].float() - zeros[:, g].float()) * scales[:, g].float()
    return w


def random_layer(bits, out, inp, gs, seed, act_order=False, zero_min=0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (out, inp), generator=gen)
    zeros = torch.randint(zero_min, 1 << bits, (out, inp // gs), generator=gen)
    scales = (torch.rand(out, inp // gs, generator=gen) * 0.1 + 0.01).half()
    g_idx = torch.arange(inp) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(inp, generator=gen)]
    return codes, zeros, scales, g_idx.to(torch.int32)


# --- GPTQ -------------------------------------------------------------------------------------


def hand_gptq(codes, zeros, scales, g_idx, bits, v1=True):
    """GPTQ tensors: qweight packs each output column's codes along `in`; qzeros packs each
    group's zero points along `out`, minus one in v1; scales [groups, out]."""
    qweight = torch.tensor([pack_sequential(col, bits) for col in codes.tolist()], dtype=torch.int32).T
    stored = (zeros - 1) % (1 << bits) if v1 else zeros
    qzeros = torch.tensor([pack_dense_padded(row, bits) for row in columns(stored)], dtype=torch.int32)
    return {"qweight": qweight.contiguous(), "qzeros": qzeros, "scales": scales.T.contiguous(), "g_idx": g_idx}


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("group_size, act_order", [(32, False), (64, True), (128, False)])
def test_gptq_v1_hand_packed_loads_and_writes_back_bit_for_bit(bits, group_size, act_order):
    codes, zeros, scales, g_idx = random_layer(bits, 64, 256, group_size, bits, act_order, zero_min=1)
    tensors = hand_gptq(codes, zeros, scales, g_idx, bits)
    qw = from_gptq(**tensors, bits=bits, group_size=group_size, sym=False, name="layers.0.gate_proj")
    assert (qw.g_idx is not None) == act_order
    assert torch.equal(dequantize(qw, torch.float32), oracle_weight(codes, zeros, scales, g_idx))
    back = to_gptq(qw)
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name


def test_gptq_v2_stores_zero_points_as_is_and_v1_wraps_zero():
    codes, zeros, scales, g_idx = random_layer(4, 40, 64, 32, 7)
    zeros[0, 0] = 0  # v1 writes 0 - 1 as 15 (all ones); we read it back as 0
    for v1, fmt in ((True, "gptq"), (False, "gptq_v2")):
        tensors = hand_gptq(codes, zeros, scales, g_idx, 4, v1=v1)
        qw = from_gptq(**tensors, bits=4, group_size=32, sym=False, checkpoint_format=fmt)
        assert torch.equal(dequantize(qw, torch.float32), oracle_weight(codes, zeros, scales, g_idx))
        assert torch.equal(to_gptq(qw, checkpoint_format=fmt)["qzeros"], tensors["qzeros"])


def test_gptq_symmetric_layer_becomes_a_symmetric_record():
    codes, zeros, scales, g_idx = random_layer(4, 40, 64, 32, 3)
    zeros.fill_(8)  # sym=True: GPTQ stores 7 = 8 - 1 in every nibble
    tensors = hand_gptq(codes, zeros, scales, g_idx, 4)
    assert int(tensors["qzeros"][0, 0]) == 0x77777777
    qw = from_gptq(**tensors, bits=4, group_size=32, sym=True)
    assert qw.symmetric and qw.zeros is None
    assert torch.equal(to_gptq(qw)["qzeros"], tensors["qzeros"])
    zeros[0, 0] = 3
    with pytest.raises(QuantFormatError, match=r"qzeros: the layer is declared symmetric"):
        from_gptq(**hand_gptq(codes, zeros, scales, g_idx, 4), bits=4, group_size=32, sym=True)


# --- AWQ --------------------------------------------------------------------------------------


def hand_awq(codes, zeros, scales):
    """AutoAWQ GEMM: qweight [in, out/8] and qzeros [groups, out/8], word col of row r holding
    column col*8 + order_map[i] in nibble i."""
    def pack_rows(m):  # m [rows, out]
        out = torch.zeros(m.shape[0], m.shape[1] // 8, dtype=torch.int64)
        for col in range(m.shape[1] // 8):
            for i in range(8):
                out[:, col] |= m[:, col * 8 + AWQ_ORDER_MAP[i]].long() << (4 * i)
        return torch.tensor([[to_int32(v) for v in row] for row in out.tolist()], dtype=torch.int32)

    return {"qweight": pack_rows(codes.T), "qzeros": pack_rows(zeros.T), "scales": scales.T.contiguous()}


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_hand_packed_loads_and_writes_back_bit_for_bit(group_size):
    codes, zeros, scales, g_idx = random_layer(4, 40, 256, group_size, group_size)
    tensors = hand_awq(codes, zeros, scales)
    qw = from_awq(**tensors, bits=4, group_size=group_size, name="layers.1.experts.3.up_proj")
    assert torch.equal(dequantize(qw, torch.float32), oracle_weight(codes, zeros, scales, g_idx))
    back = to_awq(qw)
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name


# --- compressed-tensors -----------------------------------------------------------------------


def hand_compressed_tensors(codes, zeros, scales, bits, legacy_3bit=False):
    """pack-quantized: signed q = code - 2^(bits-1) stored with +2^(bits-1) offset, i.e. the code
    itself; weight rows packed along `in`, zero points packed along `out` (packed_dim=0)."""
    offset = 1 << (bits - 1)
    signed_q, signed_zp = codes - offset, zeros - offset
    if legacy_3bit:  # compressed-tensors < dense packing: 10 values per word, 2 bits unused
        def pack_row(vals):
            return [to_int32(sum(v << (3 * j) for j, v in enumerate(vals[i : i + 10])))
                    for i in range(0, len(vals), 10)]
    else:
        def pack_row(vals):
            return pack_dense_padded(vals, bits)
    packed = torch.tensor([pack_row([q + offset for q in row]) for row in signed_q.tolist()], dtype=torch.int32)
    zp = torch.tensor([pack_row([z + offset for z in col]) for col in columns(signed_zp)], dtype=torch.int32).T
    return {"weight_packed": packed, "weight_scale": scales.to(torch.bfloat16),
            "weight_shape": torch.tensor(codes.shape), "weight_zero_point": zp.contiguous()}


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("group_size", [32, 128])
def test_compressed_tensors_hand_packed_loads_and_writes_back_bit_for_bit(bits, group_size):
    codes, zeros, scales, g_idx = random_layer(bits, 37, 256, group_size, bits * group_size)  # odd out
    tensors = hand_compressed_tensors(codes, zeros, scales, bits)
    qw = from_compressed_tensors(**tensors, bits=bits, group_size=group_size, symmetric=False, name="mlp.down_proj")
    want = oracle_weight(codes, zeros, tensors["weight_scale"], g_idx)
    assert torch.equal(dequantize(qw, torch.float32), want)
    back = to_compressed_tensors(qw)
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name


def test_compressed_tensors_legacy_3bit_and_symmetric():
    codes, zeros, scales, g_idx = random_layer(3, 37, 64, 32, 5)
    legacy = hand_compressed_tensors(codes, zeros, scales, 3, legacy_3bit=True)
    assert legacy["weight_packed"].shape == (37, 7)  # ceil(64 / 10), not the dense 6
    qw = from_compressed_tensors(**legacy, bits=3, group_size=32, symmetric=False)
    assert torch.equal(dequantize(qw, torch.float32), oracle_weight(codes, zeros, legacy["weight_scale"], g_idx))
    sym = hand_compressed_tensors(codes, torch.full_like(zeros, 4), scales, 3)
    del sym["weight_zero_point"]  # symmetric schemes do not save it
    qs = from_compressed_tensors(**sym, bits=3, group_size=32, symmetric=True)
    assert qs.symmetric and set(to_compressed_tensors(qs)) == {"weight_packed", "weight_scale", "weight_shape"}
    with pytest.raises(QuantFormatError, match="weight_zero_point: missing; an asymmetric scheme needs it"):
        from_compressed_tensors(**sym, bits=3, group_size=32, symmetric=False)


# --- errors -----------------------------------------------------------------------------------


def test_conversion_errors_name_the_tensor_and_the_supported_values():
    codes, zeros, scales, g_idx = random_layer(4, 40, 64, 32, 11, zero_min=1)
    gptq = hand_gptq(codes, zeros, scales, g_idx, 4)
    with pytest.raises(QuantFormatError, match=r"^L: bits must be one of \(2, 3, 4, 8\), got 6$"):
        from_gptq(**gptq, bits=6, group_size=32, sym=False, name="L")
    with pytest.raises(QuantFormatError, match=r"L: group_size must be one of \(32, 64, 128\), got 16"):
        from_gptq(**gptq, bits=4, group_size=16, sym=False, name="L")
    with pytest.raises(QuantFormatError, match=r"L.scales: expected shape \[2, 40\], got \[2, 39\]"):
        from_gptq(**{**gptq, "scales": gptq["scales"][:, :39]}, bits=4, group_size=32, sym=False, name="L")
    with pytest.raises(QuantFormatError, match=r"L.g_idx: group indices must lie in \[0, 2\)"):
        from_gptq(**{**gptq, "g_idx": g_idx + 1}, bits=4, group_size=32, sym=False, name="L")
    with pytest.raises(QuantFormatError, match=r"checkpoint_format must be one of \('gptq', 'gptq_v2'\)"):
        from_gptq(**gptq, bits=4, group_size=32, sym=False, name="L", checkpoint_format="marlin")
    awq = hand_awq(codes, zeros, scales)
    with pytest.raises(QuantFormatError, match=r"L: AWQ \(GEMM\) checkpoints support bits \(4,\), got 3"):
        from_awq(**awq, bits=3, group_size=32, name="L")
    qw = from_gptq(**gptq, bits=4, group_size=32, sym=False)
    with pytest.raises(QuantFormatError, match="expects one matrix"):
        to_gptq(type(qw)(qw.qdata[None], qw.scales[None], qw.zeros[None], 4, 32, False, qw.shape))
    ct = hand_compressed_tensors(codes, zeros, scales, 4)
    with pytest.raises(QuantFormatError, match=r"L.weight_scale: expected shape \[40, 2\]"):
        from_compressed_tensors(**{**ct, "weight_scale": ct["weight_scale"].T}, bits=4, group_size=32,
                                symmetric=False, name="L")


def test_folder_config_keeps_all_but_the_experts_full_precision_for_gptqmodel():
    """The `dynamic` rule GPTQModel reads (first match, start-anchored, `-:` = not quantized)
    excludes every module of the four architectures except the routed experts' projections."""
    modules = [f"mlp.experts.{e}.{p}" for e in range(128) for p in ("gate_proj", "up_proj", "down_proj")]
    rule = {r"-:^(?!(?:.*\.)?mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj)$).*": {}}
    assert only_experts_dynamic(modules) == rule
    for fmt in ("gptq", "awq"):
        assert quantization_config(FolderScheme(fmt, 4, 32, False), modules, {})["dynamic"] == rule
    (pattern,) = rule
    skip = re.compile(pattern[2:])
    quantized = ["model.layers.0.mlp.experts.0.gate_proj", "model.layers.11.mlp.experts.127.down_proj",
                 "model.layers.3.mlp.experts.7.up_proj"]
    full = ["lm_head", "model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj",
            "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert.gate_proj",  # qwen2_moe shared expert
            "model.layers.0.mlp.shared_expert_gate", "model.layers.1.mlp.down_proj",  # and a dense MLP layer
            "model.layers.0.block_sparse_moe.experts.0.w1", "model.layers.0.mlp.experts.0.gate_proj.lora"]
    assert [n for n in quantized if skip.match(n)] == [] and [n for n in full if not skip.match(n)] == []
    assert only_experts_dynamic(["a.0.x", "b.1.y",
                                 "a.2.z"]) == {r"-:^(?!(?:.*\.)?(?:a\.\d+\.(?:x|z)|b\.\d+\.(?:y))$).*": {}}


@pytest.mark.parametrize("sym, want", [(False, "gptq_v2"), (True, "gptq")])
def test_asymmetric_gptq_folders_are_written_as_gptq_v2(sym, want):
    scheme = folder_scheme(QuantizeOptions("gptq", 4, 32, symmetric=sym), "gptq")
    assert scheme.checkpoint_format == want
    qc = quantization_config(scheme, ["mlp.experts.0.up_proj"], {})
    assert qc["checkpoint_format"] == want and read_scheme(qc, "t") == scheme
    assert folder_scheme(QuantizeOptions("gptq", 4, 32, symmetric=sym),
                         "compressed-tensors").checkpoint_format == "gptq"

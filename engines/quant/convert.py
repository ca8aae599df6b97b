"""Conversions between QuantizedWeight and the checkpoint formats users have, one matrix at a time.

GPTQ (AutoGPTQ / GPTQModel, v1 and v2 zero points, act-order g_idx), AutoAWQ GEMM (4-bit,
interleaved nibbles) and compressed-tensors pack-quantized (llm-compressor). `from_*` takes the
tensors of one linear layer and checks every shape and dtype; `to_*` returns them under the
names the format uses. Reading config.json and tensor names is the loader's job, not this one's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engines.quant.qweight import (
    SCALE_DTYPES,
    QuantFormatError,
    QuantizedWeight,
    check_bits,
    check_scheme,
    expect_tensor,
    group_index,
    pack,
    pack_bits,
    packed_words,
    resolve_group,
    unpack,
    unpack_bits,
)

INT_DTYPES = (torch.int32, torch.int64, torch.int16)
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
# AutoAWQ's GEMM layout puts column order[i] of each 8-column block in nibble i, so the CUDA
# kernel's shift-and-mask yields columns in the order its fp16 conversion wants.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_BITS = (4,)


def _single(qw: QuantizedWeight, fmt: str) -> None:
    if qw.lead:
        raise QuantFormatError(f"to_{fmt}: expects one matrix, got a stack {list(qw.lead)}; use qw.expert(e)")


def _in_features(words: int, bits: int, name: str) -> int:
    if words * 32 % bits:
        raise QuantFormatError(f"{name}: {words} packed rows do not hold a whole number of {bits}-bit values")
    return words * 32 // bits


def _g_idx_or_none(g_idx: Tensor | None, inp: int, group_size: int, name: str) -> Tensor | None:
    """Validate g_idx; None when it is the plain k // group_size order (no act-order)."""
    if g_idx is None:
        return None
    expect_tensor(g_idx, (inp,), name, INT_DTYPES)
    groups = inp // group_size
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise QuantFormatError(f"{name}: group indices must lie in [0, {groups}), got [{int(g_idx.min())}, "
                               f"{int(g_idx.max())}]")
    if torch.equal(g_idx.long(), torch.arange(inp, device=g_idx.device) // group_size):
        return None
    return g_idx.to(torch.int32)


def _zeros_or_none(zeros: Tensor, bits: int, symmetric: bool, name: str) -> Tensor | None:
    """zero codes [out, G]; None for a symmetric layer after checking they are all 2^(bits-1)."""
    if not symmetric:
        return zeros
    mid = 1 << (bits - 1)
    if not bool((zeros == mid).all()):
        raise QuantFormatError(f"{name}: the layer is declared symmetric but its zero points are not all {mid}")
    return None


# --- GPTQ -------------------------------------------------------------------------------------


def from_gptq(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor | None = None, *,
              bits: int, group_size: int, sym: bool, name: str = "gptq",
              checkpoint_format: str = "gptq") -> QuantizedWeight:
    """GPTQ tensors of one linear layer -> record.

    qweight int32 [in*bits/32, out]  codes packed along `in` (dense: 3-bit spans 3 words per 32)
    qzeros  int32 [in/gs, ceil(out*bits/32)]  zero codes packed along `out`; v1 ("gptq")
            stores zero - 1 (read back modulo 2^bits), v2 ("gptq_v2") stores zero
    scales  float [in/gs, out];  g_idx  int [in] (act-order), optional
    `sym` is the config's `sym`: a symmetric layer must have every zero point at 2^(bits-1).
    """
    if checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
        raise QuantFormatError(f"{name}: checkpoint_format must be one of {GPTQ_CHECKPOINT_FORMATS}, "
                               f"got {checkpoint_format!r}")
    if qweight.dim() != 2:
        raise QuantFormatError(f"{name}.qweight: expected 2 dims [in*bits/32, out], got {list(qweight.shape)}")
    out = qweight.shape[1]
    check_bits(bits, name)
    inp = _in_features(qweight.shape[0], bits, f"{name}.qweight")
    check_scheme(bits, group_size, inp, name)
    group_size = resolve_group(group_size, inp)
    groups = inp // group_size
    expect_tensor(qweight, (inp * bits // 32, out), f"{name}.qweight", (torch.int32,))
    expect_tensor(qzeros, (groups, packed_words(out, bits)), f"{name}.qzeros", (torch.int32,))
    expect_tensor(scales, (groups, out), f"{name}.scales", SCALE_DTYPES)
    zeros = unpack_bits(qzeros, bits, out).T.to(torch.int32)
    if checkpoint_format == "gptq":
        zeros = (zeros + 1) & ((1 << bits) - 1)
    zeros = _zeros_or_none(zeros, bits, sym, f"{name}.qzeros")
    g = _g_idx_or_none(g_idx, inp, group_size, f"{name}.g_idx")
    # GPTQ's qweight is our qdata transposed: both are each output's dense bit stream along `in`.
    return QuantizedWeight(qweight.T.contiguous(), scales.T.contiguous(),
                           None if zeros is None else pack_bits(zeros, bits), bits, group_size,
                           zeros is None, (out, inp), g)


def to_gptq(qw: QuantizedWeight, *, checkpoint_format: str = "gptq",
            scale_dtype: torch.dtype = torch.float16) -> dict[str, Tensor]:
    """record -> {"qweight", "qzeros", "scales", "g_idx"} as GPTQModel writes them (see from_gptq)."""
    _single(qw, "gptq")
    if checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
        raise QuantFormatError(f"to_gptq: checkpoint_format must be one of {GPTQ_CHECKPOINT_FORMATS}, "
                               f"got {checkpoint_format!r}")
    _, zeros = unpack(qw)
    zeros = zeros.to(torch.int32)
    if checkpoint_format == "gptq":
        # v1 cannot hold zero point 0: it wraps to 2^bits - 1, which from_gptq reads back as 0
        # (AutoGPTQ-era v1 kernels would read 2^bits; symmetric weights never hit this).
        zeros = (zeros - 1) & ((1 << qw.bits) - 1)
    return {
        "qweight": qw.qdata.T.contiguous(),
        "qzeros": pack_bits(zeros.T, qw.bits),
        "scales": qw.scales.T.to(scale_dtype).contiguous(),
        "g_idx": group_index(qw).to(torch.int32).contiguous(),
    }


# --- AWQ --------------------------------------------------------------------------------------


def _awq_unpack(packed: Tensor, cols: int) -> Tensor:
    slots = unpack_bits(packed, 4, cols).reshape(*packed.shape[:-1], -1, 8)
    inverse = torch.tensor([AWQ_ORDER.index(c) for c in range(8)], device=packed.device)
    return slots[..., inverse].reshape(*packed.shape[:-1], cols)


def _awq_pack(values: Tensor) -> Tensor:
    slots = values.reshape(*values.shape[:-1], -1, 8)[..., list(AWQ_ORDER)]
    return pack_bits(slots.reshape(values.shape), 4)


def from_awq(qweight: Tensor, qzeros: Tensor, scales: Tensor, *, bits: int, group_size: int,
             name: str = "awq") -> QuantizedWeight:
    """AutoAWQ GEMM tensors of one linear layer -> record (always asymmetric, no act-order).

    qweight int32 [in, out/8], qzeros int32 [in/gs, out/8]: 4-bit codes packed along `out`,
    nibble i of each word holding column 8*j + AWQ_ORDER[i]; scales float [in/gs, out].
    """
    if bits not in AWQ_BITS:
        raise QuantFormatError(f"{name}: AWQ (GEMM) checkpoints support bits {AWQ_BITS}, got {bits}")
    if qweight.dim() != 2:
        raise QuantFormatError(f"{name}.qweight: expected 2 dims [in, out/8], got {list(qweight.shape)}")
    inp, out = qweight.shape[0], qweight.shape[1] * 8
    check_scheme(bits, group_size, inp, name)
    groups = inp // group_size
    expect_tensor(qweight, (inp, out // 8), f"{name}.qweight", (torch.int32,))
    expect_tensor(qzeros, (groups, out // 8), f"{name}.qzeros", (torch.int32,))
    expect_tensor(scales, (groups, out), f"{name}.scales", SCALE_DTYPES)
    codes = _awq_unpack(qweight, out).T
    zeros = _awq_unpack(qzeros, out).T
    return pack(codes, scales.T.contiguous(), zeros, bits, group_size)


def to_awq(qw: QuantizedWeight, *, scale_dtype: torch.dtype = torch.float16) -> dict[str, Tensor]:
    """record -> {"qweight", "qzeros", "scales"} in AutoAWQ's GEMM layout (see from_awq)."""
    _single(qw, "awq")
    if qw.bits not in AWQ_BITS:
        raise QuantFormatError(f"to_awq: AWQ (GEMM) checkpoints support bits {AWQ_BITS}, got {qw.bits}")
    if qw.g_idx is not None:
        raise QuantFormatError("to_awq: AWQ has no act-order g_idx; export this weight as GPTQ or compressed-tensors")
    if qw.shape[0] % 8:
        raise QuantFormatError(f"to_awq: AWQ packs 8 output columns per word; out={qw.shape[0]} is not a multiple of 8")
    codes, zeros = unpack(qw)
    return {"qweight": _awq_pack(codes.T), "qzeros": _awq_pack(zeros.T),
            "scales": qw.scales.T.to(scale_dtype).contiguous()}


# --- compressed-tensors pack-quantized --------------------------------------------------------


def _ct_word_aligned(weight_packed: Tensor, bits: int, inp: int, name: str) -> bool:
    """True for the older packer (32 // bits values per word; 3-bit: 10, two bits unused), False
    for the dense one; they coincide for 2/4/8 bits. `in` is a multiple of 32, so the dense and
    the word-aligned widths of a 3-bit row always differ (zero-point columns may not)."""
    width = weight_packed.shape[-1]
    if width == packed_words(inp, bits):
        return False
    if width == -(-inp // (32 // bits)):
        return True
    raise QuantFormatError(f"{name}.weight_packed: expected int32 [out, {packed_words(inp, bits)}] for "
                           f"in={inp} at {bits} bits, got {list(weight_packed.shape)}")


def _ct_unpack(packed: Tensor, bits: int, n: int, word_aligned: bool) -> Tensor:
    if not word_aligned:
        return unpack_bits(packed, bits, n)
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int32) * bits
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)


def from_compressed_tensors(weight_packed: Tensor, weight_scale: Tensor, weight_shape: Tensor,
                            weight_zero_point: Tensor | None = None, weight_g_idx: Tensor | None = None, *,
                            bits: int, group_size: int, symmetric: bool,
                            name: str = "compressed-tensors") -> QuantizedWeight:
    """compressed-tensors pack-quantized tensors (strategy "group") of one linear layer -> record.

    weight_packed int32 [out, ceil(in*bits/32)]  codes along `in`, stored as signed q + 2^(bits-1)
    weight_scale float [out, in/gs];  weight_shape int [2] = (out, in)
    weight_zero_point int32 [ceil(out*bits/32), in/gs]  (asymmetric only) packed along `out`
    weight_g_idx int [in], optional.  3-bit tensors from the older 10-per-word packer also load.
    """
    expect_tensor(weight_shape, (2,), f"{name}.weight_shape", INT_DTYPES)
    out, inp = (int(v) for v in weight_shape.tolist())
    check_scheme(bits, group_size, inp, name)
    group_size = resolve_group(group_size, inp)
    groups = inp // group_size
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2 or weight_packed.shape[0] != out:
        raise QuantFormatError(f"{name}.weight_packed: expected int32 [{out}, {packed_words(inp, bits)}], "
                               f"got {weight_packed.dtype} {list(weight_packed.shape)}")
    expect_tensor(weight_scale, (out, groups), f"{name}.weight_scale", SCALE_DTYPES)
    word_aligned = _ct_word_aligned(weight_packed, bits, inp, name)
    codes = _ct_unpack(weight_packed, bits, inp, word_aligned)
    zeros = None
    if weight_zero_point is not None:
        if symmetric:
            raise QuantFormatError(f"{name}.weight_zero_point: present, but the scheme is symmetric")
        zp_words = -(-out // (32 // bits)) if word_aligned else packed_words(out, bits)
        expect_tensor(weight_zero_point, (zp_words, groups), f"{name}.weight_zero_point", (torch.int32,))
        zeros = _ct_unpack(weight_zero_point.T, bits, out, word_aligned).T
    if zeros is None and not symmetric:
        raise QuantFormatError(f"{name}.weight_zero_point: missing; an asymmetric scheme needs it")
    g = _g_idx_or_none(weight_g_idx, inp, group_size, f"{name}.weight_g_idx")
    return pack(codes, weight_scale.contiguous(), zeros, bits, group_size, g)


def to_compressed_tensors(qw: QuantizedWeight) -> dict[str, Tensor]:
    """record -> {"weight_packed", "weight_scale", "weight_shape"[, "weight_zero_point",
    "weight_g_idx"]} as llm-compressor's dense pack-quantized writer lays them out."""
    _single(qw, "compressed_tensors")
    out = {
        "weight_packed": qw.qdata.contiguous(),
        "weight_scale": qw.scales.contiguous(),
        "weight_shape": torch.tensor(qw.shape, dtype=torch.int64),
    }
    if not qw.symmetric:
        _, zeros = unpack(qw)
        out["weight_zero_point"] = pack_bits(zeros.T, qw.bits).T.contiguous()
    if qw.g_idx is not None:
        out["weight_g_idx"] = qw.g_idx.contiguous()
    return out

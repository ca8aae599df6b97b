"""pwbench's packed weight format: group-wise 2/3/4/8-bit weights, and E experts stacked per layer.

W [out, in] (nn.Linear order) is cut into groups of `group_size` along `in`; each value is an
unsigned code q in [0, 2^bits) meaning (q - zero) * scale (symmetric: no zeros, zero = 2^(bits-1)).
Codes are packed densely per output row: value i at bits [i*bits, i*bits + bits) of the row's
little-endian stream of int32 words, so 3-bit codes straddle words and nothing is wasted.
Leading dims (experts) index whole matrices. Kernels live in ops.py, not here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.base import ModelLoadError
from engines.runtime.weights import DenseExperts

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
# group_size PER_ROW (GPTQ's -1): one group spanning each row, for widths no supported size divides.
PER_ROW = -1
# A group whose weights are all equal has max - min = 0; keep its scale finite (as rtn.py does).
MIN_SCALE = 1e-10
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- dense bit packing ------------------------------------------------------------------------
# This is GPTQ's qweight order (along its input axis) and current compressed-tensors' order;
# AWQ's interleaved order is handled in convert.py.

WORD_BITS = 32


def packed_words(n: int, bits: int) -> int:
    """Words needed for n values of `bits` bits: ceil(n * bits / 32)."""
    return -(-n * bits // WORD_BITS)


def _positions(bits: int):
    """(value index, word, bit offset, bits that spill into the next word) for one 32-value block."""
    for i in range(WORD_BITS):
        word, offset = divmod(i * bits, WORD_BITS)
        yield i, word, offset, max(0, offset + bits - WORD_BITS)


def pack_bits(values: Tensor, bits: int) -> Tensor:
    """values [..., n] integers in [0, 2^bits) -> int32 words [..., ceil(n*bits/32)].

    Works 32 values at a time (32 values span exactly `bits` words) in int32: left shifts
    wrap into the sign bit, which is the two's-complement view of the unsigned word.
    """
    n = values.shape[-1]
    pad = -n % WORD_BITS
    v = F.pad(values.to(torch.int32), (0, pad)).reshape(*values.shape[:-1], -1, WORD_BITS)
    out = torch.zeros(*v.shape[:-1], bits, dtype=torch.int32, device=values.device)
    for i, word, offset, spill in _positions(bits):
        out[..., word] |= v[..., i] << offset
        if spill:
            out[..., word + 1] |= v[..., i] >> (bits - spill)
    return out.reshape(*values.shape[:-1], -1)[..., : packed_words(n, bits)]


def unpack_bits(words: Tensor, bits: int, n: int) -> Tensor:
    """int32 words [..., w] -> the first n values [..., n] as uint8 (inverse of pack_bits)."""
    if words.dtype != torch.int32:
        raise TypeError(f"packed words must be int32, got {words.dtype}")
    need = packed_words(n, bits)
    if words.shape[-1] < need:
        raise ValueError(f"{words.shape[-1]} words hold fewer than {n} values of {bits} bits")
    mask = (1 << bits) - 1
    if WORD_BITS % bits == 0:  # whole values per word (2, 4, 8 bits): every shift in one broadcast
        shifts = torch.arange(0, WORD_BITS, bits, dtype=torch.int32, device=words.device)
        # `>>` is arithmetic on int32: the mask drops the copied sign bits
        values = (words[..., :need].unsqueeze(-1) >> shifts) & mask
        return values.reshape(*words.shape[:-1], -1)[..., :n].to(torch.uint8)
    pad = -words.shape[-1] % bits
    w = F.pad(words, (0, pad)).reshape(*words.shape[:-1], -1, bits)
    out = torch.empty(*w.shape[:-1], WORD_BITS, dtype=torch.int32, device=words.device)
    for i, word, offset, spill in _positions(bits):
        # `>>` is arithmetic on int32, so mask off the copied sign bits before adding the spill.
        low = (w[..., word] >> offset) & ((1 << (bits - spill)) - 1)
        if spill:
            low |= (w[..., word + 1] & ((1 << spill) - 1)) << (bits - spill)
        out[..., i] = low & mask
    return out.reshape(*words.shape[:-1], -1)[..., :n].to(torch.uint8)


# --- the record -------------------------------------------------------------------------------


class QuantFormatError(ModelLoadError):
    """Quantized tensors that do not fit a format: names the tensor and the supported values."""


def check_bits(bits: int, name: str) -> None:
    if bits not in SUPPORTED_BITS:
        raise QuantFormatError(f"{name}: bits must be one of {SUPPORTED_BITS}, got {bits}")


def resolve_group(group_size: int, in_features: int) -> int:
    """The inputs per group of a matrix `in_features` wide (PER_ROW: all of them)."""
    return in_features if group_size == PER_ROW else group_size


def check_scheme(bits: int, group_size: int, in_features: int, name: str) -> None:
    """Raise QuantFormatError unless (bits, group_size) is supported and divides `in_features`
    (a group as wide as the row, or PER_ROW, is always allowed where the codes fill whole words)."""
    check_bits(bits, name)
    group_size = resolve_group(group_size, in_features)
    if group_size == in_features and in_features * bits % 32 == 0:
        return
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise QuantFormatError(f"{name}: group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise QuantFormatError(
            f"{name}: group_size {group_size} must divide the input dimension {in_features}"
        )


def expect_tensor(t: Tensor, shape: tuple[int, ...], what: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise QuantFormatError naming `what` unless t has exactly this shape and one of these dtypes."""
    if tuple(t.shape) != shape:
        raise QuantFormatError(f"{what}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise QuantFormatError(f"{what}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """One weight matrix [out, in], or a stack of them [..., out, in], quantized group-wise.

    qdata   int32 [..., out, in*bits/32]          codes, packed along `in` (see above)
    scales  float [..., out, in/group_size]       one scale per group (its dtype is the record's)
    zeros   int32 [..., out, ceil(G*bits/32)]     zero codes of the G groups, packed the same way;
            None when symmetric (zero = 2^(bits-1))
    g_idx   int32 [..., in] or None               group of each input column (GPTQ act-order);
            None means column k is in group k // group_size
    """

    qdata: Tensor
    scales: Tensor
    zeros: Tensor | None
    bits: int
    group_size: int
    symmetric: bool
    shape: tuple[int, int]  # (out, in) of one matrix
    g_idx: Tensor | None = None

    def __post_init__(self) -> None:
        out, inp = self.shape
        check_scheme(self.bits, self.group_size, inp, "QuantizedWeight")
        lead = tuple(self.qdata.shape[:-2])
        expect_tensor(self.qdata, (*lead, out, inp * self.bits // 32), "QuantizedWeight.qdata", (torch.int32,))
        expect_tensor(self.scales, (*lead, out, self.num_groups), "QuantizedWeight.scales", SCALE_DTYPES)
        if self.symmetric != (self.zeros is None):
            raise QuantFormatError("QuantizedWeight.zeros: must be None exactly when symmetric is True")
        if self.zeros is not None:
            zshape = (*lead, out, packed_words(self.num_groups, self.bits))
            expect_tensor(self.zeros, zshape, "QuantizedWeight.zeros", (torch.int32,))
        if self.g_idx is not None:
            expect_tensor(self.g_idx, (*lead, inp), "QuantizedWeight.g_idx", (torch.int32,))

    @property
    def num_groups(self) -> int:
        return self.shape[1] // self.group_size

    @property
    def lead(self) -> tuple[int, ...]:
        """Leading (stack) dims, () for a single matrix, (E,) for stacked experts."""
        return tuple(self.qdata.shape[:-2])

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.qdata.device

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(t for t in (self.qdata, self.scales, self.zeros, self.g_idx) if t is not None)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> QuantizedWeight:
        """The same weight with `fn` applied to each of its tensors (index, move, add a dim)."""
        def opt(t: Tensor | None) -> Tensor | None:
            return None if t is None else fn(t)

        return replace(self, qdata=fn(self.qdata), scales=fn(self.scales), zeros=opt(self.zeros), g_idx=opt(self.g_idx))

    def expert(self, index: int) -> QuantizedWeight:
        """Matrix `index` of a stacked weight (views, no copy)."""
        return self.map_tensors(lambda t: t[index])

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return self.map_tensors(lambda t: t.to(device))


def pack(codes: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, group_size: int,
         g_idx: Tensor | None = None) -> QuantizedWeight:
    """codes [..., out, in] in [0, 2^bits), zeros [..., out, in/gs] (None: symmetric) -> record."""
    out, inp = codes.shape[-2:]
    check_scheme(bits, group_size, inp, "pack")
    packed_zeros = None if zeros is None else pack_bits(zeros, bits)
    return QuantizedWeight(pack_bits(codes, bits), scales, packed_zeros, bits, group_size,
                           zeros is None, (out, inp), None if g_idx is None else g_idx.to(torch.int32))


def unpack(qw: QuantizedWeight) -> tuple[Tensor, Tensor]:
    """record -> (codes uint8 [..., out, in], zero codes uint8 [..., out, in/gs]).

    For a symmetric record the zeros are the implied 2^(bits-1), materialized.
    """
    out, inp = qw.shape
    codes = unpack_bits(qw.qdata, qw.bits, inp)
    if qw.zeros is None:
        zeros = torch.full((*qw.lead, out, qw.num_groups), 1 << (qw.bits - 1), dtype=torch.uint8, device=qw.device)
    else:
        zeros = unpack_bits(qw.zeros, qw.bits, qw.num_groups)
    return codes, zeros


def group_index(qw: QuantizedWeight) -> Tensor:
    """int64 [..., in]: the group of each input column (g_idx, or k // group_size)."""
    if qw.g_idx is not None:
        return qw.g_idx.long()
    cols = torch.arange(qw.shape[1], device=qw.device) // qw.group_size
    return cols.expand(*qw.lead, qw.shape[1])


def dequantize(qw: QuantizedWeight, dtype: torch.dtype | None = None) -> Tensor:
    """record -> W [..., out, in] in `dtype` (default: the scales' dtype); math in float32."""
    codes, zeros = unpack(qw)
    if qw.g_idx is None:
        def per_col(t: Tensor) -> Tensor:
            return t.repeat_interleave(qw.group_size, dim=-1)
    else:
        index = qw.g_idx.long().unsqueeze(-2).expand(*qw.lead, *qw.shape)

        def per_col(t: Tensor) -> Tensor:
            return t.gather(-1, index)
    w = (codes.float() - per_col(zeros).float()) * per_col(qw.scales.float())
    return w.to(dtype or qw.dtype)


def quantize_rtn(w: Tensor, bits: int, group_size: int, symmetric: bool = False,
                 scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Round-to-nearest: w [..., out, in] -> record; scales in `scale_dtype` (default w's dtype).

    Same rounding as engines.quant.rtn.rtn_fake_quantize, except that an asymmetric group's range
    is widened to include 0 (as GPTQ does) so its zero point is a code in [0, 2^bits): the two
    agree on every group that holds both signs, which is all but degenerate groups in practice.
    """
    check_scheme(bits, group_size, w.shape[-1], "quantize_rtn")
    group_size = resolve_group(group_size, w.shape[-1])
    g = w.float().reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = (g.abs().amax(-1, keepdim=True) / qmax).clamp(min=MIN_SCALE)
        codes = torch.clamp(torch.round(g / scale), -qmax - 1, qmax) + (qmax + 1)
        zeros = None
    else:
        qmax = 2**bits - 1
        lo = g.amin(-1, keepdim=True).clamp(max=0)
        hi = g.amax(-1, keepdim=True).clamp(min=0)
        scale = ((hi - lo) / qmax).clamp(min=MIN_SCALE)
        zero = torch.round(-lo / scale).clamp(0, qmax)
        codes = torch.clamp(torch.round(g / scale) + zero, 0, qmax)
        zeros = zero.squeeze(-1).to(torch.int32)
    scales = scale.squeeze(-1).to(scale_dtype or w.dtype)
    return pack(codes.reshape(w.shape).to(torch.int32), scales, zeros, bits, group_size)


def _same_scheme(parts: Sequence[QuantizedWeight], what: str) -> QuantizedWeight:
    if not parts:
        raise QuantFormatError(f"{what}: no weights given")
    first = parts[0]
    for i, p in enumerate(parts[1:], 1):
        if (p.bits, p.group_size, p.symmetric, p.shape[1], p.dtype) != (
            first.bits, first.group_size, first.symmetric, first.shape[1], first.dtype
        ):
            raise QuantFormatError(
                f"{what}: part {i} has bits={p.bits} group_size={p.group_size} symmetric={p.symmetric} "
                f"in={p.shape[1]} {p.dtype}, part 0 has bits={first.bits} group_size={first.group_size} "
                f"symmetric={first.symmetric} in={first.shape[1]} {first.dtype}"
            )
    return first


def concat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Stack matrices along `out` (gate then up -> gate_up). They must share g_idx, if any."""
    first = _same_scheme(parts, "concat_rows")
    if any(p.lead for p in parts):
        raise QuantFormatError("concat_rows: expects single matrices, not stacks")
    g_idx = first.g_idx
    if any((p.g_idx is None) != (g_idx is None) or (g_idx is not None and not torch.equal(p.g_idx, g_idx))
           for p in parts):
        # One g_idx serves every row of the fused matrix. GPTQ act-order derives it from the
        # layer input's Hessian, which gate and up share, so real checkpoints agree.
        raise QuantFormatError("concat_rows: parts have different g_idx (act-order); cannot fuse them")

    def cat(ts: list[Tensor | None]) -> Tensor | None:
        return None if ts[0] is None else torch.cat(ts, dim=-2)

    return replace(first, qdata=cat([p.qdata for p in parts]), scales=cat([p.scales for p in parts]),
                   zeros=cat([p.zeros for p in parts]), shape=(sum(p.shape[0] for p in parts), first.shape[1]))


def stack(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Same-shape weights -> one record with a new leading dim (experts of a layer)."""
    first = _same_scheme(parts, "stack")
    if any(p.shape != first.shape for p in parts):
        raise QuantFormatError(f"stack: shapes differ: {sorted({p.shape for p in parts})}")
    has_g_idx = any(p.g_idx is not None for p in parts)
    g_idx = torch.stack([group_index(p).to(torch.int32) for p in parts]) if has_g_idx else None
    zeros = None if first.zeros is None else torch.stack([p.zeros for p in parts])
    return replace(first, qdata=torch.stack([p.qdata for p in parts]),
                   scales=torch.stack([p.scales for p in parts]), zeros=zeros, g_idx=g_idx)


@dataclass(frozen=True, eq=False)
class QuantizedExperts:
    """All routed experts of one MoE layer, quantized: the fused-MoE kernel's weight input.

    gate_up [E, 2I, D] (gate rows first, as DenseExperts) and down [E, D, I]. gpt-oss experts
    also have biases, kept at full precision, and a clamped SwiGLU (see DenseExperts).
    """

    gate_up: QuantizedWeight
    down: QuantizedWeight
    gate_up_bias: Tensor | None = None  # [E, 2I]
    down_bias: Tensor | None = None  # [E, D]
    clamp: tuple[float, float] | None = None  # (limit, alpha); None: plain SwiGLU

    def __post_init__(self) -> None:
        gu, dn = self.gate_up, self.down
        if len(gu.lead) != 1 or gu.lead != dn.lead:
            raise QuantFormatError(
                f"QuantizedExperts: gate_up and down must be stacks over the same experts, got leading "
                f"dims {list(gu.lead)} and {list(dn.lead)}"
            )
        two_i, d = gu.shape
        if two_i % 2 or dn.shape != (d, two_i // 2):
            raise QuantFormatError(
                f"QuantizedExperts: gate_up [E, 2I, D] = {list(gu.shape)} does not fit down [E, D, I] = "
                f"{list(dn.shape)}"
            )

    @property
    def num_experts(self) -> int:
        return self.gate_up.lead[0]

    def nbytes(self) -> int:
        biases = sum(t.numel() * t.element_size() for t in (self.gate_up_bias, self.down_bias) if t is not None)
        return self.gate_up.nbytes() + self.down.nbytes() + biases

    def expert_nbytes(self, expert: int) -> int:
        """One expert's share: every expert of a stack has the same scheme and shape."""
        return self.nbytes() // self.num_experts


def quantize_experts(experts: DenseExperts, bits: int, group_size: int, symmetric: bool = False,
                     scale_dtype: torch.dtype | None = None) -> QuantizedExperts:
    """RTN-quantize a layer's dense experts (both matrices with the same scheme; biases and clamp
    carried over as they are)."""
    return QuantizedExperts(
        quantize_rtn(experts.gate_up, bits, group_size, symmetric, scale_dtype),
        quantize_rtn(experts.down, bits, group_size, symmetric, scale_dtype),
        experts.gate_up_bias, experts.down_bias, experts.clamp,
    )

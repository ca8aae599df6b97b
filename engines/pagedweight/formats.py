"""One routed expert's versions at several bit widths, as named parts: the PagedWeight host tier.

A store holds one expert (gate_up [2I, D], gate rows first, and down [D, I]) and, for each
offered width b in {16, 8, 4, 3, 2}, the *parts* a device copy at b bits is made of. A part's
name means the same bytes in every version that has it, so a move from version A to B copies
exactly the parts of B that A lacks and frees the parts of A that B lacks (`transfer_bytes`,
`freed_bytes`). Two representations, chosen by name (`make_store`):

- `requantize`: an independent asymmetric RTN copy per width (engines.quant.qweight's packed
  codes, scales, zeros). Versions share no part, so any change, a demotion included, copies
  the whole new version host->device. Re-quantizing on the device from the master instead would
  need the master on the device, and from a higher version would not give RTN-from-master codes.
- `bitplanes` (the idea of Any-Precision LLM, Park et al. 2024; written here): one 8-bit
  asymmetric RTN copy, cut into 8 bit planes, most significant first, plus its 8-bit scales and
  zeros, shared by every width. The top n planes are the n-bit weights: a demotion m -> n frees
  planes n+1..m and copies nothing; a promotion copies planes n+1..m only. An n-bit code names
  a bucket of 2^k 8-bit codes (k = 8 - n) and dequantizes at the bucket's midpoint:
      w = (code_n * 2^k + (2^k - 1) / 2 - zero_8) * scale_8,   code_n = code_8 >> k,
  which for n = 8 is (code_8 - zero_8) * scale_8, the 8-bit RTN dequantization bit for bit.
  2 bits is fine here (Any-Precision's kernels stop at 3; these dequantize in torch).

16 bits is the full-precision master in either representation (parts `gate_up`, `down`): it
shares no weight part with the quantized versions, so moving to or from 16 copies a whole
version's weights. Experts with biases (gpt-oss) keep them at full precision in every version
as the shared parts `gate_up_bias` and `down_bias`: a width change never copies them, and
every version computes the model's SwiGLU (the clamped one, with its (limit, alpha), for
gpt-oss) on its weights plus the exact biases.

Group sizes: `fit_group_size` picks the largest supported group size that divides every
expert input width when the asked one does not; when none does, each row's last group is
padded by repeating the row's last weight (the group's range, hence its codes, stay those of
its real weights; padded inputs meet zeros at compute). Bit planes pack 8 inputs per byte,
so their rows are padded to a multiple of 8 as well. Compute: `forward` (one expert) and
`group_forward` (experts at one width in one call, each row's output kept separate: the caller
combines with routing weights). Not here: which width an expert gets (arbiter.py), the device
buffers and copies (backend.py).

MXFP4 checkpoints (gpt-oss as released; `Mxfp4Store`): the top width is the checkpoint's own
MXFP4 (`MXFP4`, 4.25 bits per weight: 4-bit codes plus one E8M0 scale byte per 32 values),
parts `{gate_up,down}_{blocks,scales}` as stored; the lower widths are quantized, in either
representation, from its dequantized values, which are the master (the checkpoint holds no
more). A 16-bit version is offered only when asked for: dequantized MXFP4 adds bytes, not
quality. Every store names its exact widths (`exact_bits`: those equal to the master).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.quant.ops import dequant_matmul, fused_moe
from engines.quant.qweight import (
    SUPPORTED_GROUP_SIZES,
    QuantFormatError,
    QuantizedExperts,
    QuantizedWeight,
    check_scheme,
    dequantize,
    quantize_rtn,
    stack,
    unpack,
)
from engines.runtime.experts import Dispatch, swiglu
from engines.runtime.mxfp4 import Mxfp4Expert, mxfp4_expert_forward
from engines.runtime.weights import MLPWeights

PAGED_BITS = (16, 8, 4, 3, 2)
FULL = 16  # the master's "width", whatever dtype the model runs in
# An MXFP4 checkpoint's own width: its id among the widths is 4 (4-bit codes; it orders between
# 8 and 3), its name "mxfp4", and it counts 4.25 bits per weight (the scale byte per 32 values).
MXFP4 = 4
MXFP4_NAME = "mxfp4"
MXFP4_WEIGHT_BITS = 4.25
MXFP4_PARTS = ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales")
REPRESENTATIONS = ("bitplanes", "requantize")
PLANES = 8  # bit planes of the one stored copy
MATRICES = ("gate_up", "down")
BIASES = ("gate_up_bias", "down_bias")  # shared full-precision parts of experts with biases

Parts = Mapping[str, Tensor]
HostFn = Callable[[Tensor], Tensor]


def _nbytes(parts: Parts) -> int:
    return sum(t.numel() * t.element_size() for t in parts.values())


class MetaPart:
    """A simulated run's device part (--simulate): its shape, dtype and bytes and no data, like a
    meta tensor, at a fraction of a tensor's cost to make (a simulated Mixtral step makes ~100).
    Nothing computes on it; the backend's ledger and the copy counts read `nbytes`."""

    __slots__ = ("shape", "dtype", "nbytes")
    is_meta = True
    device = torch.device("meta")

    def __init__(self, shape: torch.Size, dtype: torch.dtype, nbytes: int) -> None:
        self.shape, self.dtype, self.nbytes = shape, dtype, nbytes

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize


# --- bit planes -------------------------------------------------------------------------------
# Plane j (1 = most significant) holds bit 8 - j of every code, 8 consecutive inputs per byte,
# input k at bit k % 8: a plane of an [out, in] matrix is out * in / 8 bytes, uint8 [out, in/8].


def split_planes(codes: Tensor) -> list[Tensor]:
    """8-bit codes [..., out, in] (in % 8 == 0) -> the 8 planes [..., out, in/8] uint8, MSB first."""
    c = codes.to(torch.int32)
    weight = 1 << torch.arange(8, dtype=torch.int32, device=codes.device)
    out = []
    for j in range(1, PLANES + 1):
        bit = ((c >> (PLANES - j)) & 1).reshape(*c.shape[:-1], c.shape[-1] // 8, 8)
        out.append((bit * weight).sum(-1).to(torch.uint8))
    return out


_SPREAD: dict[torch.device, Tensor] = {}


def _spread(device: torch.device) -> Tensor:
    """int64 [256]: byte p -> bit b of p moved to bit 8 * b (one byte lane per input of the byte)."""
    table = _SPREAD.get(device)
    if table is None:
        p, b = torch.arange(256, dtype=torch.int64)[:, None], torch.arange(8, dtype=torch.int64)
        table = _SPREAD[device] = (((p >> b) & 1) << (8 * b)).sum(-1).to(device)
    return table


def top_codes_u8(planes: Sequence[Tensor]) -> Tensor:
    """`top_codes` as uint8: each plane byte looked up as 8 one-bit byte lanes of an int64 and the
    planes shifted into them (an n-bit code never carries into the next lane), then the lanes
    read as bytes: input k of a byte is lane k (little-endian). A few byte-wide passes per plane
    where unpacking every bit into int32 took a dozen word-wide ones (the CPU reference path)."""
    if sys.byteorder != "little":
        return top_codes(planes).to(torch.uint8)
    spread = _spread(planes[0].device)
    code = None
    for p in planes:
        lanes = spread[p.long()]
        code = lanes if code is None else (code << 1) | lanes
    assert code is not None
    return code.view(torch.uint8)


def top_codes(planes: Sequence[Tensor]) -> Tensor:
    """The top n planes [..., out, in/8] -> the n-bit codes code_8 >> (8 - n), int32 [..., out, in]."""
    shifts = torch.arange(8, dtype=torch.int32, device=planes[0].device)
    code = None
    for p in planes:
        bit = ((p.to(torch.int32).unsqueeze(-1) >> shifts) & 1).flatten(-2)
        code = bit if code is None else (code << 1) | bit
    assert code is not None
    return code


def dequantize_planes(planes: Sequence[Tensor], scales: Tensor, zeros: Tensor, group_size: int,
                      dtype: torch.dtype) -> Tensor:
    """The top n = len(planes) planes with the 8-bit scales/zeros [..., out, G] -> W [..., out, in].

    Math in float32: code_n * 2^k and (2^k - 1) / 2 are exact, so at n = 8 the level is code_8
    exactly and the result equals qweight.dequantize of the 8-bit record bit for bit."""
    if not 1 <= len(planes) <= PLANES:
        raise QuantFormatError(f"dequantize_planes: needs 1..{PLANES} planes, got {len(planes)}")
    k = PLANES - len(planes)
    level = top_codes_u8(planes).float() * float(1 << k) + ((1 << k) - 1) / 2
    zero = zeros.float().repeat_interleave(group_size, dim=-1)
    scale = scales.float().repeat_interleave(group_size, dim=-1)
    return ((level - zero) * scale).to(dtype)


# --- group sizes ------------------------------------------------------------------------------


def padded_width(width: int, group_size: int, representation: str) -> int:
    """A row of `width` inputs as stored: whole groups (and whole bytes of planes)."""
    step = math.lcm(group_size, PLANES) if representation == "bitplanes" else group_size
    return -(-width // step) * step


def fit_group_size(requested: int, widths: Sequence[int], representation: str = "bitplanes") -> tuple[int, str | None]:
    """The group size to quantize experts whose input widths (D and I) are `widths` with, and a
    note when it is not simply `requested`: the largest supported size dividing every width, or,
    when none does, the one that pads rows least (the last group of each row padded)."""
    sizes = sorted(SUPPORTED_GROUP_SIZES, reverse=True)
    if requested not in sizes:
        raise QuantFormatError(f"group_size must be one of {', '.join(map(str, sizes))}, got {requested}")
    widths = sorted(set(widths))
    odd = [w for w in widths if w % requested]
    if not odd:
        return requested, None
    what = f"group_size {requested} does not divide expert width {'/'.join(map(str, odd))}"
    fits = [g for g in sizes if all(w % g == 0 for w in widths)]
    if fits:
        return fits[0], f"{what}: experts quantized with group_size {fits[0]}"
    # Least padding; on a tie the asked size, then the larger (fewer scales).
    g = min(sizes, key=lambda g: (sum(padded_width(w, g, representation) for w in widths), g != requested, -g))
    pads = ", ".join(f"{w} -> {padded_width(w, g, representation)}" for w in widths
                     if padded_width(w, g, representation) != w)
    return g, (f"{what}, nor does any supported group size ({', '.join(map(str, sizes))}): experts quantized "
               f"with group_size {g}, each row's last group padded (inputs {pads})")


# --- versions ---------------------------------------------------------------------------------


def _pad(x: Tensor, width: int) -> Tensor:
    """x [..., n] -> [..., width], zeros after (padded inputs add 0 to every output)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _glu(h: Tensor, clamp: tuple[float, float] | None) -> Tensor:
    """gate_up's output [n, 2I] -> the activation [n, I], as engines.runtime.experts.swiglu."""
    gate, up = h.chunk(2, dim=-1)
    if clamp is None:
        return F.silu(gate) * up
    limit, alpha = clamp
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _as(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if t is None else t.to(dtype)


@dataclass(frozen=True, eq=False)
class ExpertVersion:
    """One expert at one width, wherever its parts are (host tier or device buffers)."""

    representation: str
    bits: int
    parts: Parts  # name -> tensor; read-only once built (a committed version is never written)
    shape: tuple[int, int]  # (I, D)
    group_size: int
    clamp: tuple[float, float] | None = None  # the clamped SwiGLU's (limit, alpha); None: plain SwiGLU
    padded: tuple[int, int] | None = None  # (I, D) as the quantized rows store them; None: `shape`

    def nbytes(self) -> int:
        return _nbytes(self.parts)

    @property
    def stored(self) -> tuple[int, int]:
        return self.padded or self.shape

    def biases(self) -> tuple[Tensor | None, Tensor | None]:
        """(gate_up_bias [2I], down_bias [D]) at full precision, or None each."""
        return self.parts.get("gate_up_bias"), self.parts.get("down_bias")

    def weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(gate_up [2I, D], down [D, I]) dequantized to `dtype` (the master's tensors at 16)."""
        if self.bits == FULL:
            return self.parts["gate_up"].to(dtype), self.parts["down"].to(dtype)
        inter, hidden = self.shape
        if self.representation == "bitplanes":
            gate_up, down = (_plane_weight(self.parts, m, self.bits, self.group_size, dtype) for m in MATRICES)
        else:
            gate_up, down = (dequantize(_record(self.parts, m, self.bits, self.group_size, self.shape, self.stored),
                                        dtype) for m in MATRICES)
        return gate_up[:, :hidden], down[:, :inter]

    def dense_forward(self, x: Tensor) -> Tensor:
        """The SwiGLU of the dequantized weights in x's dtype, exact biases, the model's clamp."""
        return swiglu(x, *self.weights(x.dtype), *(_as(b, x.dtype) for b in self.biases()), self.clamp)

    def forward(self, x: Tensor) -> Tensor:
        """x [n, D] -> down(act(gate_up(x) + gate_up_bias)) + down_bias [n, D], in x's dtype."""
        if self.bits == FULL:  # the master itself: exactly the resident backend's computation
            return swiglu(x, self.parts["gate_up"], self.parts["down"], *self.biases(), self.clamp)
        if self.representation == "requantize":  # the serving op (Triton on CUDA)
            inter, hidden = self.stored
            gate_up, down = (_record(self.parts, m, self.bits, self.group_size, self.shape, self.stored)
                             for m in MATRICES)
            gu_bias, down_bias = self.biases()
            h = dequant_matmul(_pad(x, hidden), gate_up)
            y = dequant_matmul(_pad(_glu(h if gu_bias is None else h + gu_bias, self.clamp), inter), down)
            return y if down_bias is None else y + down_bias
        return self.dense_forward(x)


def _record(parts: Parts, m: str, bits: int, group_size: int, shape: tuple[int, int],
            stored: tuple[int, int] | None = None) -> QuantizedWeight:
    inter, hidden = shape
    stored_inter, stored_hidden = stored or shape
    out_in = (2 * inter, stored_hidden) if m == "gate_up" else (hidden, stored_inter)
    return QuantizedWeight(parts[f"{m}.qdata@{bits}"], parts[f"{m}.scales@{bits}"], parts[f"{m}.zeros@{bits}"],
                           bits, group_size, False, out_in)


def _plane_weight(parts: Parts, m: str, bits: int, group_size: int, dtype: torch.dtype) -> Tensor:
    planes = [parts[f"{m}.plane{j}"] for j in range(1, bits + 1)]
    return dequantize_planes(planes, parts[f"{m}.scales"], parts[f"{m}.zeros"], group_size, dtype)


def _pad_rows(w: Tensor, width: int) -> Tensor:
    """w [out, in] -> [out, width], each row's last weight repeated: the last group's range, and
    so its scale, zero and real codes, are those of its real weights."""
    n = w.shape[-1]
    return w if n == width else torch.cat((w, w[..., -1:].expand(*w.shape[:-1], width - n)), dim=-1)


# --- stores -----------------------------------------------------------------------------------


class ExpertStore:
    """One expert's master and quantized versions in the host tier (see the module docstring).

    `host` places each stored tensor in the host tier (CopyEngine.host: pinned on CUDA); the
    quantization itself runs where the master is (the device at load, so it is fast). Biases
    (gate_up_bias [2I], down_bias [D]) and `clamp` are gpt-oss's; None for plain SwiGLU."""

    representation: str
    exact_bits: frozenset[int] = frozenset({FULL})  # widths whose output is the master's exactly

    def __init__(self, gate_up: Tensor, down: Tensor, bits: Sequence[int], group_size: int = 32,
                 host: HostFn | None = None, *, gate_up_bias: Tensor | None = None,
                 down_bias: Tensor | None = None, clamp: tuple[float, float] | None = None) -> None:
        if gate_up.dim() != 2 or down.dim() != 2 or gate_up.shape[0] % 2 or \
                tuple(down.shape) != (gate_up.shape[1], gate_up.shape[0] // 2):
            raise QuantFormatError(f"expert: gate_up must be [2I, D] and down [D, I], got {list(gate_up.shape)} "
                                   f"and {list(down.shape)}")
        for name, b, n in (("gate_up_bias", gate_up_bias, gate_up.shape[0]), ("down_bias", down_bias, down.shape[0])):
            if b is not None and tuple(b.shape) != (n,):
                raise QuantFormatError(f"expert: {name} must be [{n}], got {list(b.shape)}")
        widths = tuple(sorted(set(bits), reverse=True))
        bad = [b for b in widths if b not in PAGED_BITS]
        if not widths or bad or len(widths) != len(bits):
            raise QuantFormatError(f"expert store: bits must be distinct values among {PAGED_BITS}, got {list(bits)}")
        self.bits = widths
        self.group_size = group_size
        self.clamp = clamp
        self.shape = (down.shape[1], down.shape[0])  # (I, D)
        self.padded = self.shape
        quantized = [b for b in widths if b < FULL]
        if quantized:
            self.padded = tuple(padded_width(n, group_size, self.representation) for n in self.shape)  # type: ignore[assignment]
            check_scheme(8, group_size, self.padded[1], "expert gate_up (D)")
            check_scheme(8, group_size, self.padded[0], "expert down (I)")
        self._host = host or (lambda t: t.detach().contiguous())
        self.master = MLPWeights(self._host(gate_up), self._host(down))
        self.bias = {name: self._host(b) for name, b in zip(BIASES, (gate_up_bias, down_bias)) if b is not None}
        self._parts: dict[int, dict[str, Tensor]] = {}
        if FULL in widths:
            self._parts[FULL] = {"gate_up": self.master.gate_up, "down": self.master.down, **self.bias}
        if quantized:
            inter, hidden = self.padded
            self._build(_pad_rows(gate_up, hidden), _pad_rows(down, inter), quantized)
            for b in quantized:
                self._parts[b].update(self.bias)

    def _build(self, gate_up: Tensor, down: Tensor, bits: list[int]) -> None:
        """The quantized versions' weight parts from the master's rows padded to whole groups."""
        raise NotImplementedError

    # -- what a version is made of -----------------------------------------------------------------
    def parts(self, bits: int) -> dict[str, Tensor]:
        """The host-tier parts of the version at `bits` (name -> tensor; do not write them)."""
        if bits not in self._parts:
            raise QuantFormatError(f"expert store: no version at {bits} bits; offered: {list(self.bits)}")
        return self._parts[bits]

    def version(self, bits: int, parts: Parts | None = None) -> ExpertVersion:
        """The version at `bits`, over `parts` (device buffers) or the host tier's."""
        return ExpertVersion(self.representation, bits, self.parts(bits) if parts is None else parts,
                             self.shape, self.group_size, self.clamp,
                             None if self.padded == self.shape else self.padded)

    def versions(self) -> dict[int, ExpertVersion]:
        return {b: self.version(b) for b in self.bits}

    def reference(self, x: Tensor) -> Tensor:
        """The host master's output on x [n, D] (the quality feedback's reference)."""
        return swiglu(x, self.master.gate_up, self.master.down, self.bias.get("gate_up_bias"),
                      self.bias.get("down_bias"), self.clamp)

    def _sized(self, key: tuple[Any, ...], size: Callable[[], int]) -> int:
        """`size()` once per key: a store's parts never change after it is built, and the arbiter
        asks every width's and move's bytes of every expert at every step."""
        memo = self.__dict__.setdefault("_size_memo", {})
        got = memo.get(key)
        if got is None:
            got = memo[key] = size()
        return got

    def nbytes(self, bits: int) -> int:
        """Device bytes of the version at `bits`, biases included (0: not resident)."""
        return 0 if bits == 0 else self._sized(("n", bits), lambda: _nbytes(self.parts(bits)))

    def host_bytes(self) -> int:
        """The host tier's bytes for this expert (each part once, the master included)."""
        seen = {name: t for b in self.bits for name, t in self._parts[b].items()}
        return _nbytes(seen) + (0 if FULL in self.bits else _nbytes({"gate_up": self.master.gate_up,
                                                                      "down": self.master.down}))

    def transfer_bytes(self, from_bits: int, to_bits: int) -> int:
        """Bytes that cross host->device to go from the version at `from_bits` (0: nothing held)
        to the one at `to_bits` (0: drop it): the parts of the target the held one lacks."""
        if to_bits == 0:
            return 0
        def size() -> int:
            have = self.parts(from_bits) if from_bits else {}
            return sum(t.numel() * t.element_size() for name, t in self.parts(to_bits).items() if name not in have)
        return self._sized(("t", from_bits, to_bits), size)

    def freed_bytes(self, from_bits: int, to_bits: int) -> int:
        """Device bytes released by that move: the held parts the target does not use."""
        if from_bits == 0:
            return 0
        keep = self.parts(to_bits) if to_bits else {}
        return self._sized(("f", from_bits, to_bits), lambda: sum(
            t.numel() * t.element_size() for name, t in self.parts(from_bits).items() if name not in keep))

    def device_tensors(self, bits: int, device: torch.device | str,
                       held: Parts | None = None) -> tuple[dict[str, Tensor], list[tuple[Tensor, Tensor]]]:
        """Parts of the version at `bits` on `device`: those in `held` (this expert's current
        device parts) reused, the others new empty buffers; and the (dst, src) host->device
        copies that fill them, for CopyEngine.h2d. Sum of the pairs' src bytes = transfer_bytes."""
        have = held or {}
        parts, pairs = {}, []
        if torch.device(device).type == "meta":  # --simulate: parts that hold shapes (MetaPart)
            for name, src, spec in self._meta_specs(bits):
                if name in have:
                    parts[name] = have[name]
                else:
                    parts[name] = part = MetaPart(*spec)
                    pairs.append((part, src))
            return parts, pairs
        for name, src in self.parts(bits).items():
            if name in have:
                parts[name] = have[name]
            else:
                parts[name] = torch.empty(src.shape, dtype=src.dtype, device=device)
                pairs.append((parts[name], src))
        return parts, pairs

    def _meta_specs(self, bits: int) -> list[tuple[str, Tensor, tuple]]:
        """(name, host part, (shape, dtype, bytes)) of the version at `bits`, once per width."""
        memo = self.__dict__.setdefault("_meta_memo", {})
        specs = memo.get(bits)
        if specs is None:
            specs = memo[bits] = [(name, src, (src.shape, src.dtype, src.nbytes))
                                  for name, src in self.parts(bits).items()]
        return specs

    # -- compute -----------------------------------------------------------------------------------
    def forward(self, parts: Parts, bits: int, x: Tensor) -> Tensor:
        """This expert at `bits` over `parts` (as device_tensors built them): x [n, D] -> [n, D]."""
        return self.version(bits, parts).forward(x)

    def group_forward(self, parts_list: Sequence[Parts], bits: int, xs: Sequence[Tensor]) -> list[Tensor]:
        """Several experts of this shape and representation, all at `bits`, in one call: expert
        g's rows xs[g] [n_g, D] -> its outputs [n_g, D] (not combined across experts)."""
        if len(parts_list) != len(xs):
            raise QuantFormatError(f"group_forward: {len(parts_list)} experts but {len(xs)} row blocks")
        if not xs:
            return []
        if bits in self.exact_bits:
            return [self.version(bits, p).forward(x) for p, x in zip(parts_list, xs)]
        return self._group(parts_list, bits, xs)

    def _group(self, parts_list: Sequence[Parts], bits: int, xs: Sequence[Tensor]) -> list[Tensor]:
        raise NotImplementedError


class RequantizeStore(ExpertStore):
    """An independent RTN copy per width: parts `{gate_up,down}.{qdata,scales,zeros}@{bits}`."""

    representation = "requantize"

    def _build(self, gate_up: Tensor, down: Tensor, bits: list[int]) -> None:
        for b in bits:
            parts = {}
            for m, w in zip(MATRICES, (gate_up, down)):
                qw = quantize_rtn(w, b, self.group_size)
                parts.update({f"{m}.qdata@{b}": self._host(qw.qdata), f"{m}.scales@{b}": self._host(qw.scales),
                              f"{m}.zeros@{b}": self._host(qw.zeros)})  # type: ignore[arg-type]
            self._parts[b] = parts

    def _group(self, parts_list: Sequence[Parts], bits: int, xs: Sequence[Tensor]) -> list[Tensor]:
        """The fused-MoE op over the group stacked as one layer, with a dispatch whose
        assignments are the rows themselves (token_index = arange, weights 1): its combine then
        returns each row's own output, since 1 * y added to 0 is y exactly. Stacking copies the
        group's (small, packed) parts once per call: the price of one launch for the group.
        Biases and the clamp go to the fused op as they are; padded rows (a group size that
        does not divide the widths) run expert by expert (`forward`), the op knowing none."""
        if self.padded != self.shape:
            return [self.version(bits, p).forward(x) for p, x in zip(parts_list, xs)]
        weights = (stack([_record(p, m, bits, self.group_size, self.shape) for p in parts_list]) for m in MATRICES)
        biases = (torch.stack([p[name] for p in parts_list]) if name in self.bias else None for name in BIASES)
        experts = QuantizedExperts(*weights, *biases, self.clamp)
        x = torch.cat(list(xs))
        n = x.shape[0]
        d = Dispatch(torch.arange(n, device=x.device), torch.ones(n, dtype=x.dtype, device=x.device),
                     [t.shape[0] for t in xs])
        return list(fused_moe(x, d, experts).split(d.counts))


class BitPlaneStore(ExpertStore):
    """One 8-bit copy in planes: parts `{m}.plane1..{m}.plane{max bits}` (MSB first) and the
    8-bit `{m}.scales` (the master's dtype) and `{m}.zeros` (uint8 [out, G]), shared by every
    width. Only as many planes as the widest quantized version offered are kept."""

    representation = "bitplanes"

    def _build(self, gate_up: Tensor, down: Tensor, bits: list[int]) -> None:
        shared: dict[str, Tensor] = {}
        planes: dict[str, list[Tensor]] = {}
        for m, w in zip(MATRICES, (gate_up, down)):
            qw = quantize_rtn(w, 8, self.group_size)
            codes, zeros = unpack(qw)
            shared[f"{m}.scales"], shared[f"{m}.zeros"] = self._host(qw.scales), self._host(zeros)
            planes[m] = [self._host(p) for p in split_planes(codes)[: max(bits)]]
        for b in bits:
            self._parts[b] = {**{f"{m}.plane{j}": planes[m][j - 1] for m in MATRICES for j in range(1, b + 1)},
                              **shared}

    def group_weights(self, parts_list: Sequence[Parts], bits: int, dtype: torch.dtype) -> dict[str, Tensor]:
        """The group's matrices at `bits`, one stacked dequantize per matrix: {m: [G, out, in]}
        (padded widths kept). Its temporaries grow with the group (on a CPU they leave the caches:
        `pwbench hw` measures its rate by group size for the simulator's cost model)."""
        w = {}
        for m in MATRICES:
            planes = [torch.stack([p[f"{m}.plane{j}"] for p in parts_list]) for j in range(1, bits + 1)]
            scales = torch.stack([p[f"{m}.scales"] for p in parts_list])
            zeros = torch.stack([p[f"{m}.zeros"] for p in parts_list])
            w[m] = dequantize_planes(planes, scales, zeros, self.group_size, dtype)
        return w

    def _group(self, parts_list: Sequence[Parts], bits: int, xs: Sequence[Tensor]) -> list[Tensor]:
        """One stacked dequantize of the group's planes per matrix, then each expert's SwiGLU
        on its own rows (the same elementwise math as `forward`, so the same results)."""
        dtype = xs[0].dtype
        inter, hidden = self.shape
        w = self.group_weights(parts_list, bits, dtype)
        out = []
        for g, (p, x) in enumerate(zip(parts_list, xs)):
            biases = (_as(p.get(name), dtype) for name in BIASES)
            out.append(swiglu(x, w["gate_up"][g][:, :hidden], w["down"][g][:, :inter], *biases, self.clamp))
        return out


_STORES: dict[str, type[ExpertStore]] = {"bitplanes": BitPlaneStore, "requantize": RequantizeStore}


# --- MXFP4 checkpoints ------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Mxfp4Version(ExpertVersion):
    """An expert at the checkpoint's own MXFP4 width: its stored blocks and scales (and the
    exact biases), computed by engines.runtime.mxfp4's torch reference."""

    def _expert(self) -> Mxfp4Expert:
        return Mxfp4Expert.from_tensors(dict(self.parts), self.clamp)

    def weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        e = self._expert()
        return e.gate_up.dequantize(dtype), e.down.dequantize(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return mxfp4_expert_forward(x, self._expert())


class Mxfp4Store(ExpertStore):
    """One expert of an MXFP4 checkpoint (see the module docstring): the version at `MXFP4` is
    the stored parts; the others (3, 2, and 16 or 8 only when asked) come from an inner store
    of `representation` built on the dequantized weights, their biases the shared ones here.
    The host tier holds no dequantized master: the reference dequantizes the stored parts."""

    def __init__(self, expert: Mxfp4Expert, bits: Sequence[int], representation: str, group_size: int = 32,
                 host: HostFn | None = None, dtype: torch.dtype = torch.float32) -> None:
        widths = tuple(sorted(set(bits), reverse=True))
        if MXFP4 not in widths or any(b not in PAGED_BITS for b in widths) or len(widths) != len(bits):
            raise QuantFormatError(f"MXFP4 expert store: bits must be distinct values among {PAGED_BITS} and "
                                   f"include {MXFP4} (the checkpoint's MXFP4), got {list(bits)}")
        self.representation = representation
        self.bits, self.clamp = widths, expert.clamp
        self.exact_bits = frozenset(b for b in widths if b in (MXFP4, FULL))
        self._host = host or (lambda t: t.detach().contiguous())
        stored = {name: self._host(t) for name, t in expert.tensors().items()}
        self.bias = {name: stored[name] for name in BIASES if name in stored}
        packed = {name: stored[name] for name in MXFP4_PARTS}
        gate_up, down = expert.gate_up.dequantize(dtype), expert.down.dequantize(dtype)
        self.shape = (down.shape[1], down.shape[0])  # (I, D)
        others = [b for b in widths if b != MXFP4]
        self.inner = None
        if others:
            biases = {name: expert.tensors().get(name) for name in BIASES}
            self.inner = make_store(representation, gate_up, down, others, group_size, self._host,
                                    gate_up_bias=biases["gate_up_bias"], down_bias=biases["down_bias"],
                                    clamp=self.clamp)
            if FULL not in others:
                # The inner store's master copy is the dequantized MXFP4: the host tier need not keep it.
                self.inner.master = MLPWeights(gate_up.new_empty(0), down.new_empty(0))
        self.group_size = self.inner.group_size if self.inner is not None else group_size
        self.padded = self.inner.padded if self.inner is not None else self.shape
        self._parts = {MXFP4: {**packed, **self.bias}}
        for b in others:
            assert self.inner is not None
            self._parts[b] = {**{k: v for k, v in self.inner.parts(b).items() if k not in BIASES}, **self.bias}

    def version(self, bits: int, parts: Parts | None = None) -> ExpertVersion:
        if bits != MXFP4:
            return super().version(bits, parts)
        return Mxfp4Version(self.representation, bits, self.parts(bits) if parts is None else parts, self.shape,
                            self.group_size, self.clamp)

    def master_expert(self) -> Mxfp4Expert:
        """The host tier's MXFP4 parts as an Mxfp4Expert (the master, packed)."""
        return Mxfp4Expert.from_tensors(self._parts[MXFP4], self.clamp)

    def reference(self, x: Tensor) -> Tensor:
        """The master's output on x [n, D]: the stored MXFP4 dequantized to x's dtype."""
        return mxfp4_expert_forward(x, self.master_expert())

    def host_bytes(self) -> int:
        """Each part once: the stored MXFP4, the lower widths' parts, the biases (no dense master)."""
        return _nbytes({name: t for b in self.bits for name, t in self._parts[b].items()})

    def _group(self, parts_list: Sequence[Parts], bits: int, xs: Sequence[Tensor]) -> list[Tensor]:
        assert self.inner is not None
        return self.inner._group(parts_list, bits, xs)


def weight_bits(bits: int, mxfp4: bool) -> float:
    """Bits per weight of width `bits` as a report counts it: MXFP4's 4.25 on an MXFP4 checkpoint,
    else the width itself (0: not resident)."""
    return MXFP4_WEIGHT_BITS if mxfp4 and bits == MXFP4 else bits


def width_name(bits: int, mxfp4: bool) -> str:
    """How a width is named in options and logs: "mxfp4" for an MXFP4 checkpoint's own."""
    return MXFP4_NAME if mxfp4 and bits == MXFP4 else str(bits)


def make_store(representation: str, gate_up: Tensor, down: Tensor, bits: Sequence[int], group_size: int = 32,
               host: HostFn | None = None, *, gate_up_bias: Tensor | None = None, down_bias: Tensor | None = None,
               clamp: tuple[float, float] | None = None) -> ExpertStore:
    """The store of one expert in `representation` ("bitplanes" or "requantize"), with its
    biases and SwiGLU clamp when the model's experts have them."""
    cls = _STORES.get(representation)
    if cls is None:
        raise QuantFormatError(f"representation must be one of {', '.join(REPRESENTATIONS)}, got {representation!r}")
    return cls(gate_up, down, bits, group_size, host, gate_up_bias=gate_up_bias, down_bias=down_bias, clamp=clamp)

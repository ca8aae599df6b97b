"""gpt-oss routed experts as stored: full precision, or MXFP4 (the released checkpoints), either
dequantized into one DenseExperts record or kept packed in an `Mxfp4Experts` record.

MXFP4 (OCP Microscaling v1.0): each run of 32 values along a row shares one E8M0 scale byte
(2^(s - 127)); each value is FP4 E2M1, two per uint8, the low nibble first. gpt-oss folders
hold `{name}_blocks [E, rows, cols/32, 16]` and `{name}_scales [E, rows, cols/32]`; rows of
gate_up alternate gate and up. Packed records hold the same bytes with gate rows moved first
(a row permutation: dequantizing them gives exactly the dense load's values). Per-expert
parts (`Mxfp4Experts.expert`) and `mxfp4_expert_forward` serve engines that move one expert at
a time; `mxfp4_moe_reference` is the torch reference of the kernel in engines/quant/ops.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from engines.base import ModelLoadError
from engines.runtime.config import ModelConfig
from engines.runtime.experts import Dispatch, grouped_swiglu, swiglu
from engines.runtime.weights import DenseExperts

if TYPE_CHECKING:
    from engines.runtime.checkpoint import TensorReader

# FP4 E2M1: sign bit, 2 exponent bits (bias 1), 1 mantissa bit; codes 0-7 positive, 8-15 negative.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32
QUANT_METHOD = "mxfp4"


def is_mxfp4(cfg: ModelConfig) -> bool:
    """True for a gpt-oss folder whose config.json declares MXFP4 experts."""
    return cfg.architecture == "gpt_oss" and (cfg.quantization or {}).get("quant_method") == QUANT_METHOD


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> values [..., G * 32] in `dtype`."""
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)


# --- packed records ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Mxfp4Weight:
    """One matrix [out, in], or a stack [..., out, in], in MXFP4.

    blocks uint8 [..., out, in/32, 16]  two FP4 codes per byte, low nibble first
    scales uint8 [..., out, in/32]      E8M0 exponent of each run of 32 inputs
    """

    blocks: Tensor
    scales: Tensor

    def __post_init__(self) -> None:
        b, s = self.blocks, self.scales
        if b.dtype != torch.uint8 or s.dtype != torch.uint8 or b.dim() < 3 or b.shape[-1] != 16 \
                or tuple(b.shape[:-1]) != tuple(s.shape):
            raise ModelLoadError(f"MXFP4 weight: blocks must be uint8 [..., out, in/32, 16] and scales uint8 "
                                 f"[..., out, in/32]; got {b.dtype} {list(b.shape)} and {s.dtype} {list(s.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in) of one matrix."""
        return self.scales.shape[-2], self.scales.shape[-1] * GROUP

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.scales.shape[:-2])

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> Mxfp4Weight:
        return Mxfp4Weight(fn(self.blocks), fn(self.scales))

    def expert(self, index: int) -> Mxfp4Weight:
        """Matrix `index` of a stack (views, no copy)."""
        return self.map_tensors(lambda t: t[index])

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        return dequantize_mxfp4(self.blocks, self.scales, dtype)


def _nbytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(frozen=True, eq=False)
class Mxfp4Expert:
    """One expert's parts, as an engine that moves experts one by one copies them."""

    gate_up: Mxfp4Weight  # [2I, D], gate rows first
    down: Mxfp4Weight  # [D, I]
    gate_up_bias: Tensor | None  # [2I]
    down_bias: Tensor | None  # [D]
    clamp: tuple[float, float] | None

    def tensors(self) -> dict[str, Tensor]:
        """The part tensors by name (what a host tier stores and copies)."""
        named = {"gate_up_blocks": self.gate_up.blocks, "gate_up_scales": self.gate_up.scales,
                 "down_blocks": self.down.blocks, "down_scales": self.down.scales,
                 "gate_up_bias": self.gate_up_bias, "down_bias": self.down_bias}
        return {k: v for k, v in named.items() if v is not None}

    @classmethod
    def from_tensors(cls, parts: dict[str, Tensor], clamp: tuple[float, float] | None) -> Mxfp4Expert:
        """Inverse of `tensors` (e.g. after copying each part to the device)."""
        return cls(Mxfp4Weight(parts["gate_up_blocks"], parts["gate_up_scales"]),
                   Mxfp4Weight(parts["down_blocks"], parts["down_scales"]),
                   parts.get("gate_up_bias"), parts.get("down_bias"), clamp)

    def nbytes(self) -> int:
        return self.gate_up.nbytes() + self.down.nbytes() + _nbytes(self.gate_up_bias, self.down_bias)


@dataclass(frozen=True, eq=False)
class Mxfp4Experts:
    """All routed experts of one layer kept in MXFP4 (biases at the model dtype): the record a
    ResidentBackend holds and engines.quant.ops.fused_moe runs. nbytes counts the 4-bit blocks,
    the scale bytes and the biases."""

    gate_up: Mxfp4Weight  # [E, 2I, D], gate rows first
    down: Mxfp4Weight  # [E, D, I]
    gate_up_bias: Tensor | None = None  # [E, 2I]
    down_bias: Tensor | None = None  # [E, D]
    clamp: tuple[float, float] | None = None  # clamped SwiGLU (limit, alpha)

    def __post_init__(self) -> None:
        gu, dn = self.gate_up, self.down
        two_i, d = gu.shape
        if len(gu.lead) != 1 or gu.lead != dn.lead or two_i % 2 or dn.shape != (d, two_i // 2):
            raise ModelLoadError(f"Mxfp4Experts: gate_up {[*gu.lead, *gu.shape]} and down {[*dn.lead, *dn.shape]} "
                                 "are not [E, 2I, D] and [E, D, I]")

    @property
    def num_experts(self) -> int:
        return self.gate_up.lead[0]

    def nbytes(self) -> int:
        return self.gate_up.nbytes() + self.down.nbytes() + _nbytes(self.gate_up_bias, self.down_bias)

    def expert_nbytes(self, expert: int) -> int:
        return self.nbytes() // self.num_experts

    def expert(self, e: int) -> Mxfp4Expert:
        """Expert e's parts (views into the stacks)."""
        return Mxfp4Expert(self.gate_up.expert(e), self.down.expert(e),
                           None if self.gate_up_bias is None else self.gate_up_bias[e],
                           None if self.down_bias is None else self.down_bias[e], self.clamp)

    def dequantize(self, dtype: torch.dtype) -> DenseExperts:
        """Every expert at `dtype`: exactly the values the dense MXFP4 load produces."""
        return DenseExperts(self.gate_up.dequantize(dtype), self.down.dequantize(dtype), self.gate_up_bias,
                            self.down_bias, self.clamp)


# --- compute: torch reference -----------------------------------------------------------------


def mxfp4_expert_forward(x: Tensor, expert: Mxfp4Expert) -> Tensor:
    """One expert's output for rows x [n, D] -> [n, D] (not yet routing-weighted): its weights
    dequantized to x's dtype, then the runtime's SwiGLU (biases and clamp included)."""
    return swiglu(x, expert.gate_up.dequantize(x.dtype), expert.down.dequantize(x.dtype),
                  expert.gate_up_bias, expert.down_bias, expert.clamp)


class _DequantizedStack:
    """Expert e of a packed stack, dequantized when indexed (grouped_swiglu indexes only the
    experts that have tokens)."""

    def __init__(self, w: Mxfp4Weight, dtype: torch.dtype) -> None:
        self._w, self._dtype = w, dtype

    def __getitem__(self, e: int) -> Tensor:
        return self._w.expert(e).dequantize(self._dtype)


def mxfp4_moe_reference(x: Tensor, d: Dispatch, experts: Mxfp4Experts) -> Tensor:
    """x [T, D] -> sum over each token's experts of weight * expert(x): grouped_swiglu over the
    dequantized experts, so the same float results as the dense MXFP4 load."""
    stand_in: Any = DenseExperts(_DequantizedStack(experts.gate_up, x.dtype), _DequantizedStack(experts.down, x.dtype),
                                 experts.gate_up_bias, experts.down_bias, experts.clamp)
    return grouped_swiglu(x, d, stand_in)


# --- loading ----------------------------------------------------------------------------------


def _raw_mxfp4(reader: TensorReader, name: str, shape: tuple[int, int, int]) -> tuple[Tensor, Tensor] | None:
    """`{name}_blocks` and `{name}_scales` as stored, shape-checked; None if one is missing."""
    E, rows, cols = shape
    if cols % GROUP:
        raise ModelLoadError(f"{name}_blocks: MXFP4 needs the input size ({cols}) to be a multiple of {GROUP}")
    blocks, scales = reader.raw(name + "_blocks"), reader.raw(name + "_scales")
    if blocks is None or scales is None:
        return None
    for tensor, want, key in ((blocks, (E, rows, cols // GROUP, 16), "_blocks"),
                              (scales, (E, rows, cols // GROUP), "_scales")):
        if tuple(tensor.shape) != want or tensor.dtype != torch.uint8:
            raise ModelLoadError(
                f"tensor {name}{key} is {tensor.dtype} {list(tensor.shape)}, but MXFP4 of this config.json is "
                f"uint8 {list(want)}"
            )
    return blocks, scales


def _mxfp4(reader: TensorReader, name: str, shape: tuple[int, int, int]) -> Tensor | None:
    raw = _raw_mxfp4(reader, name, shape)
    return None if raw is None else dequantize_mxfp4(*raw, reader.dtype)


def _gate_first(t: Tensor) -> Tensor:
    """[E, 2I, ...] with gate and up rows alternating -> gate rows, then up rows."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1).contiguous()


def _biases(reader: TensorReader, cfg: ModelConfig, prefix: str) -> tuple[Tensor | None, Tensor | None]:
    E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    return reader.get(prefix + "gate_up_proj_bias", (E, 2 * I)), reader.get(prefix + "down_proj_bias", (E, D))


def gpt_oss_experts(reader: TensorReader, cfg: ModelConfig, prefix: str) -> DenseExperts | None:
    """A gpt-oss layer's experts ("...mlp.experts."): transformers' fused [E, D, 2I] with gate and
    up interleaved (or MXFP4 blocks of the [E, 2I, D] rows) -> our [E, 2I, D], gate rows first."""
    E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gu_bias, down_bias = _biases(reader, cfg, prefix)
    if reader.has(prefix + "gate_up_proj_blocks"):
        rows = _mxfp4(reader, prefix + "gate_up_proj", (E, 2 * I, D))
        down = _mxfp4(reader, prefix + "down_proj", (E, D, I))
    else:
        fused = reader.get(prefix + "gate_up_proj", (E, D, 2 * I))
        rows = None if fused is None else fused.transpose(1, 2)
        stored = reader.get(prefix + "down_proj", (E, I, D))
        down = None if stored is None else stored.transpose(1, 2).contiguous()
    if rows is None or down is None or gu_bias is None or down_bias is None:
        return None
    return DenseExperts(_gate_first(rows), down, _gate_first(gu_bias), down_bias, cfg.swiglu_clamp)


def mxfp4_experts(reader: TensorReader, cfg: ModelConfig, prefix: str) -> Mxfp4Experts | None:
    """A gpt-oss layer's MXFP4 experts kept packed (the bytes as stored, gate rows moved first)."""
    E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if not reader.has(prefix + "gate_up_proj_blocks"):
        raise ModelLoadError(f"{reader.ckpt.path}: {prefix}gate_up_proj_blocks is missing; expert_format mxfp4 "
                             "serves gpt-oss folders whose experts are stored in MXFP4 (use expert_format dense)")
    gu_bias, down_bias = _biases(reader, cfg, prefix)
    gate_up = _raw_mxfp4(reader, prefix + "gate_up_proj", (E, 2 * I, D))
    down = _raw_mxfp4(reader, prefix + "down_proj", (E, D, I))
    if gate_up is None or down is None or gu_bias is None or down_bias is None:
        return None
    return Mxfp4Experts(Mxfp4Weight(*map(_gate_first, gate_up)), Mxfp4Weight(*down), _gate_first(gu_bias),
                        down_bias, cfg.swiglu_clamp)

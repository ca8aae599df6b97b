"""gpt-oss routed experts as stored: full precision, or MXFP4 (the released checkpoints), both
into one DenseExperts record (gate rows first, biases, the clamped SwiGLU's limit and alpha).

MXFP4 (OCP Microscaling v1.0): each run of 32 values along a row shares one E8M0 scale byte
(2^(s - 127)); each value is FP4 E2M1, two per uint8, the low nibble first. gpt-oss folders
hold `{name}_blocks [E, rows, cols/32, 16]` and `{name}_scales [E, rows, cols/32]`; rows of
gate_up alternate gate and up. This module dequantizes at load (the packed form behind an
expert backend is a later kernel's job), so a user's gpt-oss folder loads as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engines.base import ModelLoadError
from engines.runtime.config import ModelConfig
from engines.runtime.weights import DenseExperts

if TYPE_CHECKING:
    from engines.runtime.checkpoint import TensorReader

# FP4 E2M1: sign bit, 2 exponent bits (bias 1), 1 mantissa bit; codes 0-7 positive, 8-15 negative.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> values [..., G * 32] in `dtype`."""
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)


def _mxfp4(reader: TensorReader, name: str, shape: tuple[int, int, int]) -> Tensor | None:
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
    return dequantize_mxfp4(blocks, scales, reader.dtype)


def gpt_oss_experts(reader: TensorReader, cfg: ModelConfig, prefix: str) -> DenseExperts | None:
    """A gpt-oss layer's experts ("...mlp.experts."): transformers' fused [E, D, 2I] with gate and
    up interleaved (or MXFP4 blocks of the [E, 2I, D] rows) -> our [E, 2I, D], gate rows first."""
    E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gu_bias = reader.get(prefix + "gate_up_proj_bias", (E, 2 * I))
    down_bias = reader.get(prefix + "down_proj_bias", (E, D))
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
    gate_up = torch.cat((rows[:, 0::2], rows[:, 1::2]), dim=1).contiguous()
    bias = torch.cat((gu_bias[:, 0::2], gu_bias[:, 1::2]), dim=1).contiguous()
    return DenseExperts(gate_up, down, bias, down_bias, cfg.swiglu_clamp)

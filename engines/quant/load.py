"""Load a quantized Hugging Face folder (GPTQ, AutoAWQ, compressed-tensors) into the runtime.

Plugs the runtime's generic reader (engines/runtime/checkpoint.py): routed experts stay packed
as stored (one QuantizedExperts per layer, gate and up fused row-wise; gpt-oss's per-expert
biases, see export.py, at the model dtype), any other linear layer stored quantized (attention,
shared expert) is dequantized to the model dtype at load. The scheme comes from config.json's
`quantization_config` (hf_format.read_scheme). A gpt-oss MXFP4 folder loads with its experts
kept in MXFP4 (`load_mxfp4_folder`), run by the same fused_moe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engines.base import ModelLoadError
from engines.quant.hf_format import MXFP4_SCHEME, REQUIRED, FolderScheme, read_linear, read_scheme
from engines.quant.ops import fused_moe
from engines.quant.qweight import QuantizedExperts, QuantizedWeight, concat_rows, dequantize, stack
from engines.runtime.checkpoint import (
    EXPERT_NAMES,
    Checkpoint,
    TensorReader,
    expert_names,
    load_model,
    load_mxfp4_weights,
)
from engines.runtime.config import ModelConfig
from engines.runtime.experts import ResidentBackend
from engines.runtime.mxfp4 import Mxfp4Experts
from engines.runtime.transfer import TransferLedger
from engines.runtime.weights import ModelWeights


@dataclass(frozen=True)
class QuantizedLoad:
    """What load_quantized_weights returns."""

    weights: ModelWeights
    experts: dict[int, QuantizedExperts] | dict[int, Mxfp4Experts]  # MoE layer -> its routed experts, packed
    scheme: FolderScheme
    dequantized: tuple[str, ...]  # other linear layers stored quantized, dequantized at load


class QuantizedLinears:
    """The runtime reader's LinearFormat for a quantized folder; records what it dequantized."""

    def __init__(self, scheme: FolderScheme) -> None:
        self.scheme = scheme
        self.dequantized: list[str] = []

    def stored(self, reader: TensorReader, prefix: str) -> bool:
        return any(reader.has(f"{prefix}.{suffix}") for suffix in self.scheme.tensor_names)

    def quantized(self, reader: TensorReader, prefix: str, shape: tuple[int, int]) -> QuantizedWeight | None:
        """Linear layer `prefix` as stored; None if a tensor is missing (the reader records it)."""
        scheme = self.scheme

        def get(suffix: str) -> Tensor | None:
            key = f"{prefix}.{suffix}"
            if reader.has(key) or suffix in REQUIRED[scheme.fmt]:
                return reader.raw(key)
            return None

        qw = read_linear(get, scheme, prefix)
        if qw is not None and qw.shape != shape:
            raise ModelLoadError(f"{reader.ckpt.path}: quantized layer {prefix} holds a {list(qw.shape)} weight, "
                                 f"but config.json implies {list(shape)}")
        return qw

    def dense(self, reader: TensorReader, prefix: str, shape: tuple[int, int]) -> Tensor | None:
        qw = self.quantized(reader, prefix, shape)
        if qw is None:
            return None
        self.dequantized.append(prefix)
        return dequantize(qw, reader.dtype)

    def experts(self, reader: TensorReader, cfg: ModelConfig, prefix: str) -> QuantizedExperts | None:
        """A layer's routed experts from per-expert quantized layers, gate and up fused row-wise."""
        E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        fp = [prefix + "gate_up_proj", *(f"{prefix}0.{n[0]}.weight" for n in EXPERT_NAMES)]
        if any(reader.has(key) for key in fp):
            raise ModelLoadError(f"{reader.ckpt.path}: the routed experts under {prefix} are full precision in a "
                                 f"{self.scheme.fmt} folder; pwbench's static engines need every routed "
                                 "expert quantized")
        names = expert_names(reader, prefix, REQUIRED[self.scheme.fmt][0])
        gate_up, down, gu_bias, down_bias = [], [], [], []
        for e in range(E):
            g = self.quantized(reader, f"{prefix}{e}.{names[0]}", (I, D))
            u = self.quantized(reader, f"{prefix}{e}.{names[1]}", (I, D))
            d = self.quantized(reader, f"{prefix}{e}.{names[2]}", (D, I))
            if g is not None and u is not None and d is not None:
                gate_up.append(concat_rows([g, u]))
                down.append(d)
            if cfg.expert_bias:
                gu_bias += [reader.get(f"{prefix}{e}.{n}.bias", (I,)) for n in names[:2]]
                down_bias.append(reader.get(f"{prefix}{e}.{names[2]}.bias", (D,)))
        if len(down) < E or any(b is None for b in gu_bias + down_bias):
            return None
        if not cfg.expert_bias:
            return QuantizedExperts(stack(gate_up), stack(down))
        gate, up = torch.stack(gu_bias[0::2]), torch.stack(gu_bias[1::2])
        return QuantizedExperts(stack(gate_up), stack(down), torch.cat([gate, up], dim=1), torch.stack(down_bias),
                                cfg.swiglu_clamp)


def load_quantized_weights(
    ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, ledger: TransferLedger
) -> QuantizedLoad:
    """A quantized folder: dense weights (quantized non-expert layers dequantized to `dtype`) and
    each MoE layer's routed experts packed as stored (scales keep their stored dtype)."""
    if not ckpt.config.quantization:
        raise ModelLoadError(f"{ckpt.path} has no quantization_config in config.json; it is a full-precision folder")
    fmt = QuantizedLinears(read_scheme(ckpt.config.quantization, str(ckpt.path / "config.json")))
    weights, experts = load_model(ckpt, device, dtype, ledger, fmt.experts, fmt)
    return QuantizedLoad(weights, experts, fmt.scheme, tuple(fmt.dequantized))


def load_mxfp4_folder(
    ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, ledger: TransferLedger
) -> QuantizedLoad:
    """A gpt-oss MXFP4 folder served as stored: experts in MXFP4, every other weight as stored."""
    weights, experts = load_mxfp4_weights(ckpt, device, dtype, ledger)
    return QuantizedLoad(weights, experts, MXFP4_SCHEME, ())


def quantized_backend(experts: dict[int, QuantizedExperts] | dict[int, Mxfp4Experts]) -> ResidentBackend:
    """Packed experts resident on the device, run by the fused dequantize-and-matmul kernel."""
    return ResidentBackend(experts, fused_moe)

"""A gpt-oss MXFP4 folder loaded for the engines that move experts one at a time (offload's host
tier, pagedweight's and full's stores): the dense weights on the device and each MoE layer's
routed experts kept packed as stored (`Mxfp4Experts`), plus, where an engine needs them (the
calibration pass, the quantized lower widths), the same experts dequantized, which are exactly
the values the dense load gives. The format itself and its compute are engines/runtime/mxfp4.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.base import EngineError
from engines.runtime.checkpoint import Checkpoint, load_mxfp4_weights
from engines.runtime.engine import Loaded, Opened
from engines.runtime.mxfp4 import Mxfp4Experts, is_mxfp4

EXPERT_FORMATS = ("dense", "mxfp4")


@dataclass
class Mxfp4Loaded(Loaded):
    """`Loaded` with each MoE layer's experts as the folder stores them (`packed`); `experts`
    holds their dequantized stacks when the engine asked for them, else nothing."""

    packed: dict[int, Mxfp4Experts] = field(default_factory=dict)

    @property
    def packed_bytes_per_expert(self) -> int:
        """One expert as stored: its 4-bit blocks, scale bytes and biases."""
        return next(iter(self.packed.values())).expert_nbytes(0) if self.packed else 0


def resolve_expert_format(value: str | None, checkpoint: Checkpoint, engine: str) -> str:
    """`expert_format` as the engine serves it: None is mxfp4 on an MXFP4 folder, else dense."""
    if value is None:
        return "mxfp4" if is_mxfp4(checkpoint.config) else "dense"
    if value not in EXPERT_FORMATS:
        raise EngineError(f"engine {engine}: expert_format must be one of {', '.join(EXPERT_FORMATS)}, got {value!r}")
    if value == "mxfp4" and not is_mxfp4(checkpoint.config):
        raise EngineError(f"engine {engine}: expert_format=mxfp4 serves gpt-oss folders with MXFP4 experts; "
                          f"{checkpoint.path} has none: use expert_format=dense")
    return value


def load_mxfp4(opened: Opened, dequantized: bool) -> Mxfp4Loaded:
    """An opened MXFP4 gpt-oss folder's dense weights and packed experts; with `dequantized`,
    also each layer's experts at the model dtype (Mxfp4Experts.dequantize: the dense load's
    values, bit for bit)."""
    checkpoint, device, dtype, ledger = opened
    weights, packed = load_mxfp4_weights(checkpoint, device, dtype, ledger)
    dense = {i: w.dequantize(dtype) for i, w in packed.items()} if dequantized else {}
    return Mxfp4Loaded(checkpoint, weights, device, dtype, ledger, dense, packed=packed)

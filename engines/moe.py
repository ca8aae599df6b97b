"""Engine `moe`: pwbench's own MoE runtime at full precision, every routed expert resident on the
device (the quality reference). A recipe of the runtime's parts (engines/runtime/engine.py); with
`expert_bits` the experts are RTN-rounded at start (fake quantization, for `pwbench demo eval`).
With `expert_format=mxfp4` a gpt-oss MXFP4 folder keeps its experts in MXFP4 on the device (run
by engines/quant/ops.py's fused_moe); by default they are dequantized at load, the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.base import EngineError
from engines.common.device import resolve_device, resolve_dtype
from engines.runtime.checkpoint import load_mxfp4_weights, open_checkpoint
from engines.runtime.engine import EngineParts, Loaded, RuntimeConfig, RuntimeEngine, resident_parts
from engines.runtime.experts import ResidentBackend
from engines.runtime.mxfp4 import is_mxfp4
from engines.runtime.transfer import TransferLedger

EXPERT_FORMATS = ("dense", "mxfp4")


@dataclass(frozen=True)
class MoEEngineConfig(RuntimeConfig):
    """Engine moe's options: the runtime's, and how routed experts are held.

    expert_format: "dense" (experts at the model dtype; an MXFP4 folder is dequantized at load)
    or "mxfp4" (an MXFP4 gpt-oss folder's experts stay in MXFP4: 4.25 bits per weight on the
    device, the same values, computed by the MXFP4 kernel)."""

    expert_format: str = "dense"


class MoEEngine(RuntimeEngine):
    name = "moe"
    config_cls = MoEEngineConfig
    prompt_logits = True
    float32_reference = True

    def load(self, cfg: MoEEngineConfig) -> Loaded:
        if cfg.expert_format not in EXPERT_FORMATS:
            raise EngineError(f"expert_format must be one of {', '.join(EXPERT_FORMATS)}, got {cfg.expert_format!r}")
        if cfg.expert_format == "dense":
            return super().load(cfg)
        from engines.quant.load import quantized_backend  # noqa: PLC0415  (quantized kernels only when asked)

        if cfg.expert_bits is not None:
            raise EngineError("expert_bits fake-quantizes dense experts; drop it with expert_format=mxfp4")
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        ledger = TransferLedger(device)
        checkpoint = open_checkpoint(cfg.model)
        if not is_mxfp4(checkpoint.config):
            raise EngineError(f"expert_format=mxfp4 serves gpt-oss folders with MXFP4 experts; {checkpoint.path} "
                              "has none: use expert_format=dense")
        self.check_model(checkpoint.config)
        weights, experts = load_mxfp4_weights(checkpoint, device, dtype, ledger)
        return Loaded(checkpoint, weights, device, dtype, ledger, backend=quantized_backend(experts))

    def build(self, cfg: MoEEngineConfig, loaded: Loaded) -> EngineParts:
        if loaded.backend is not None:
            return resident_parts(cfg, loaded, loaded.backend)
        experts = loaded.experts
        if cfg.expert_bits is not None and cfg.expert_bits < 16:
            from engines.quant.rtn import fake_quantized  # noqa: PLC0415  (quantization only when asked)

            experts = fake_quantized(experts, cfg.expert_bits, cfg.expert_group)
        return resident_parts(cfg, loaded, ResidentBackend(experts))

"""Engine `moe`: pwbench's own MoE runtime at full precision, every routed expert resident on the
device (the quality reference). A recipe of the runtime's parts (engines/runtime/engine.py); with
`expert_bits` the experts are RTN-rounded at start (fake quantization, for `pwbench demo eval`).
With `expert_format=mxfp4` a gpt-oss MXFP4 folder keeps its experts in MXFP4 on the device (run
by engines/quant/ops.py's fused_moe); by default they are dequantized at load, the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.base import EngineError
from engines.runtime.engine import EngineParts, Loaded, RuntimeConfig, RuntimeEngine, load_dense, resident_parts
from engines.runtime.experts import ResidentBackend
from engines.runtime.mxfp4_parts import load_mxfp4, resolve_expert_format


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
    simulates = True

    def load(self, cfg: MoEEngineConfig) -> Loaded:
        opened = self.open(cfg)
        if resolve_expert_format(cfg.expert_format, opened.checkpoint, self.name) == "dense":
            return load_dense(opened)
        from engines.quant.load import quantized_backend  # noqa: PLC0415  (quantized kernels only when asked)

        if cfg.expert_bits is not None:
            raise EngineError("expert_bits fake-quantizes dense experts; drop it with expert_format=mxfp4")
        loaded = load_mxfp4(opened, dequantized=False)
        loaded.backend = quantized_backend(loaded.packed)
        return loaded

    def build(self, cfg: MoEEngineConfig, loaded: Loaded) -> EngineParts:
        if loaded.backend is not None:
            return resident_parts(cfg, loaded, loaded.backend)
        experts = loaded.experts
        if cfg.expert_bits is not None and cfg.expert_bits < 16:
            from engines.quant.rtn import fake_quantized  # noqa: PLC0415  (quantization only when asked)

            experts = fake_quantized(experts, cfg.expert_bits, cfg.expert_group)
        return resident_parts(cfg, loaded, ResidentBackend(experts))

"""Engine `moe`: pwbench's own MoE runtime at full precision, every routed expert resident on the
device (the quality reference). A recipe of the runtime's parts (engines/runtime/engine.py); with
`expert_bits` the experts are RTN-rounded at start (fake quantization, for `pwbench demo eval`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.runtime.engine import EngineParts, Loaded, RuntimeConfig, RuntimeEngine, resident_parts
from engines.runtime.experts import ResidentBackend


@dataclass(frozen=True)
class MoEEngineConfig(RuntimeConfig):
    """Engine moe's options: the runtime's, nothing more."""


class MoEEngine(RuntimeEngine):
    name = "moe"
    config_cls = MoEEngineConfig
    prompt_logits = True
    float32_reference = True

    def build(self, cfg: MoEEngineConfig, loaded: Loaded) -> EngineParts:
        experts = loaded.experts
        if cfg.expert_bits is not None and cfg.expert_bits < 16:
            from engines.quant.rtn import fake_quantized  # noqa: PLC0415  (quantization only when asked)

            experts = fake_quantized(experts, cfg.expert_bits, cfg.expert_group)
        return resident_parts(cfg, loaded, ResidentBackend(experts))

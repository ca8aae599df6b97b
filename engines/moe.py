"""Engine `moe`: pwbench's own MoE runtime at full precision, every routed expert resident on the
device (the quality reference). A recipe of the runtime's parts (engines/runtime/engine.py); with
`expert_bits` the experts are RTN-rounded at start (fake quantization, for `pwbench demo eval`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.runtime.budget import OFFLOAD_FIX, Claim
from engines.runtime.engine import EngineParts, KVPool, Loaded, RuntimeConfig, RuntimeEngine
from engines.runtime.experts import ExpertBackend, ResidentBackend
from engines.runtime.kv_cache import PagedKVCache


@dataclass(frozen=True)
class MoEEngineConfig(RuntimeConfig):
    """Engine moe's options: the runtime's, nothing more."""


def resident_parts(cfg: RuntimeConfig, loaded: Loaded, experts: ExpertBackend) -> EngineParts:
    """Every expert resident beside the dense weights, the KV pool on the device in what they
    leave: the parts of engine moe and of the static-quantization engines."""
    block = PagedKVCache.model_block_bytes(loaded.checkpoint.config, cfg.block_size, loaded.dtype)
    dense, held = loaded.dense_bytes, experts.device_bytes()
    claims = [Claim("dense weights", dense), Claim("every routed expert", held, fix=OFFLOAD_FIX),
              Claim("one KV block", block)]
    return EngineParts(experts, claims, KVPool(on_device=True, weights_beside=dense + held))


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

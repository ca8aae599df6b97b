"""Engine `offload`: the expert-offloading baseline (DeepSpeed-MoE / FlexGen / MoE-Infinity /
SGLang-style paged experts) as a recipe of runtime parts and the expert cache in cache.py.

Every routed expert lives in the host tier; the device keeps dense weights, `K` expert slots
per MoE layer and the KV blocks, all inside `--budget`, K sized as SGLang sizes its expert
cache: clamp((budget - dense - kv_reserve) / (MoE layers x bytes per expert), 1, experts).
Batching stays model-based. Design and measurements: docs/offload.md.

On a gpt-oss MXFP4 folder the host tier, the slots and the copies hold the experts as stored
(4-bit blocks, scale bytes, biases; `expert_format`, mxfp4 there by default), so K and the
budget count MXFP4 expert bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engines.base import EngineError
from engines.common.sizes import format_size
from engines.offload.cache import POLICIES, OffloadBackend, next_layer_router
from engines.runtime.budget import Claim
from engines.runtime.copies import CopyEngine
from engines.runtime.engine import EngineParts, KVPool, Loaded, RuntimeConfig, RuntimeEngine, load_dense
from engines.runtime.mxfp4_parts import Mxfp4Loaded, load_mxfp4, resolve_expert_format
from engines.runtime.weights import MoEWeights

# Share of (budget - dense weights) kept for KV blocks when kv_reserve_bytes is not given.
DEFAULT_KV_RESERVE = 0.2


@dataclass(frozen=True)
class OffloadConfig(RuntimeConfig):
    """Engine offload's options. expert_format (as engine moe's): "dense" holds the experts at
    the model dtype (an MXFP4 folder dequantized at load), "mxfp4" keeps a gpt-oss MXFP4
    folder's experts as stored in the host tier and the slots. None (the default) is mxfp4 on
    an MXFP4 folder, else dense: offload is the baseline a team would deploy, and deployments
    serve gpt-oss in its own format (vLLM runs its MXFP4 experts as stored); the values are the
    same (dequantization is exact), while every miss copies, and every slot holds, 4.25 bits per
    weight instead of 16, so the same budget caches about 3.7x the experts."""

    policy: str = "lru"  # expert cache eviction: lru or lfu
    prefetch: bool = False  # copy the next layer's predicted experts while this layer computes
    kv_reserve_bytes: int | None = None  # None: 20% of (budget - dense weights)
    experts_per_layer: int | None = None  # K slots per MoE layer; None: from the budget
    # CPU only: model the host->device link at this many GB/s (copies take bytes / bandwidth
    # on a background thread); None: copies are plain memcpys. On CUDA the real link is used.
    link_gbps: float | None = None
    expert_format: str | None = None  # dense | mxfp4; None: mxfp4 on an MXFP4 folder, else dense


def expert_slots(cfg: OffloadConfig, num_experts: int, dense: int, per_layer: int, kv_block: int) -> int:
    """K, the expert slots per MoE layer, from experts_per_layer or the budget (`per_layer`: one
    expert in every MoE layer, in bytes)."""
    if cfg.budget_bytes is None and cfg.experts_per_layer is None:
        raise EngineError("engine offload needs a device budget (--budget SIZE) or --set experts_per_layer=K")
    if cfg.experts_per_layer is not None:
        if not 1 <= cfg.experts_per_layer <= num_experts:
            raise EngineError(f"engine offload: experts_per_layer must be within [1, {num_experts}], "
                              f"got {cfg.experts_per_layer}")
        return cfg.experts_per_layer
    reserve = cfg.kv_reserve_bytes
    if reserve is None:
        reserve = int(DEFAULT_KV_RESERVE * (cfg.budget_bytes - dense))
    reserve = max(reserve, kv_block)
    k = (cfg.budget_bytes - dense - reserve) // per_layer if per_layer else num_experts
    return int(min(max(k, 1), num_experts))


def offload_parts(cfg: OffloadConfig, loaded: Loaded) -> EngineParts:
    """Experts in the host tier behind a device cache of K slots per MoE layer, KV on the device."""
    if cfg.policy not in POLICIES:
        raise EngineError(f"engine offload: policy must be one of {', '.join(POLICIES)}, got {cfg.policy!r}")
    if cfg.link_gbps is not None and (cfg.link_gbps <= 0 or loaded.device.type != "cpu"):
        raise EngineError("engine offload: link_gbps must be > 0 and models the link on the CPU only "
                          "(on CUDA copies take the real link's time)")
    mc, dense, per_expert = loaded.checkpoint.config, loaded.dense_bytes, loaded.bytes_per_expert
    experts = loaded.experts
    if isinstance(loaded, Mxfp4Loaded):  # served as stored: the slots, copies and claims count MXFP4 bytes
        experts, per_expert = loaded.packed, loaded.packed_bytes_per_expert
    num_moe = len(experts)
    block = loaded.kv_block_bytes(cfg.block_size)
    claims = [Claim("dense weights", dense),
              Claim(f"one expert per MoE layer ({num_moe} x {format_size(per_expert)})", num_moe * per_expert),
              Claim("one KV block", block)]
    slots = expert_slots(cfg, mc.num_experts, dense, num_moe * per_expert, block)
    copies = CopyEngine(loaded.ledger, loaded.device, cfg.link_gbps)
    predictor = None
    if cfg.prefetch:
        routers = {i: layer.mlp.router for i, layer in enumerate(loaded.weights.layers)
                   if isinstance(layer.mlp, MoEWeights)}
        predictor = next_layer_router(routers, mc.top_k)
    backend = OffloadBackend(experts, slots, copies, loaded.device, cfg.policy, predictor)

    def stats() -> dict[str, float]:
        layers = backend.layers()
        return {"bytes_per_expert": per_expert, "expert_slots_per_layer": backend.slots(layers[0]) if layers else 0,
                **({"link_peak_bytes_per_s": cfg.link_gbps * 1e9} if cfg.link_gbps is not None else {})}

    kv = KVPool(on_device=True, weights_beside=dense + backend.device_bytes())
    notes = (["routed experts served in MXFP4 as the folder stores them (4-bit blocks, scale bytes, biases): "
              "host tier, slots and copies"] if isinstance(loaded, Mxfp4Loaded) else [])
    served = dataclasses.replace(cfg, expert_format="mxfp4" if isinstance(loaded, Mxfp4Loaded) else "dense")
    return EngineParts(backend, claims, kv, copies=copies, stats=stats, notes=notes, config=served)


class OffloadEngine(RuntimeEngine):
    name = "offload"
    simulates = True
    sim_overhead_keys = ("offload",)
    config_cls = OffloadConfig

    def load(self, cfg: OffloadConfig) -> Loaded:
        opened = self.open(cfg)
        if resolve_expert_format(cfg.expert_format, opened.checkpoint, self.name) == "mxfp4":
            return load_mxfp4(opened, dequantized=False)
        return load_dense(opened)

    def build(self, cfg: OffloadConfig, loaded: Loaded) -> EngineParts:
        return offload_parts(cfg, loaded)

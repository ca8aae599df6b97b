"""Engine `offload`: the expert-offloading baseline (DeepSpeed-MoE / FlexGen / MoE-Infinity /
SGLang-style paged experts) on the `moe` runtime.

Every routed expert lives in the host tier at full precision; the device keeps dense weights,
a cache of `K` expert slots per MoE layer and the KV cache, all inside `--budget`. K comes
from the budget as SGLang sizes its expert cache: K = clamp((budget - dense - kv_reserve) /
(MoE layers x bytes per expert), 1, experts per layer); whatever the slots leave goes to KV
blocks. A missing expert is copied in before its layer's expert compute (engines/runtime/
offload.py); `policy` picks victims (lru, lfu); `prefetch` runs the next MoE layer's router on
the current layer's hidden states and copies the experts it predicts while this layer
computes. Batching stays model-based: each step runs one batch through all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.base import EngineError
from engines.moe import MoEEngine, MoEEngineConfig
from engines.runtime.copies import CopyEngine
from engines.runtime.experts import ExpertBackend
from engines.runtime.offload import POLICIES, OffloadBackend, next_layer_router
from engines.runtime.weights import DenseExperts, MoEWeights
from engines.sizes import format_size

# Share of (budget - dense weights) kept for KV blocks when kv_reserve_bytes is not given.
DEFAULT_KV_RESERVE = 0.2


@dataclass(frozen=True)
class OffloadConfig(MoEEngineConfig):
    policy: str = "lru"  # expert cache eviction: lru or lfu
    prefetch: bool = False  # copy the next layer's predicted experts while this layer computes
    kv_reserve_bytes: int | None = None  # None: 20% of (budget - dense weights)
    experts_per_layer: int | None = None  # K slots per MoE layer; None: from the budget
    # CPU only: model the host->device link at this many GB/s (copies take bytes / bandwidth
    # on a background thread); None: copies are plain memcpys. On CUDA the real link is used.
    link_gbps: float | None = None


class OffloadEngine(MoEEngine):
    name = "offload"
    plain_experts_only = True  # its host tier and device slots hold gate_up/down only
    config_cls = OffloadConfig
    float32_reference = False

    def build_experts(self, dense: dict[int, DenseExperts]) -> ExpertBackend:
        cfg: OffloadConfig = self.config  # type: ignore[assignment]
        if cfg.policy not in POLICIES:
            raise EngineError(f"engine offload: policy must be one of {', '.join(POLICIES)}, got {cfg.policy!r}")
        if cfg.link_gbps is not None and (cfg.link_gbps <= 0 or self.device.type != "cpu"):
            raise EngineError("engine offload: link_gbps must be > 0 and models the link on the CPU only "
                              "(on CUDA copies take the real link's time)")
        self._per_expert = next(iter(dense.values())).expert_nbytes(0) if dense else 0
        self._num_moe = len(dense)
        self.copies = CopyEngine(self.ledger, self.device, cfg.link_gbps)
        predictor = None
        if cfg.prefetch:
            routers = {i: layer.mlp.router for i, layer in enumerate(self.weights.layers) if isinstance(layer.mlp, MoEWeights)}
            predictor = next_layer_router(routers, self.checkpoint.config.top_k)
        return OffloadBackend(dense, self._slots(), self.copies, self.device, cfg.policy, predictor)

    def _slots(self) -> int:
        """K, the expert slots per MoE layer, from experts_per_layer or the budget."""
        cfg: OffloadConfig = self.config  # type: ignore[assignment]
        num_experts = self.checkpoint.config.num_experts
        if cfg.budget_bytes is None and cfg.experts_per_layer is None:
            raise EngineError("engine offload needs a device budget (--budget SIZE) or --set experts_per_layer=K")
        if cfg.experts_per_layer is not None:
            if not 1 <= cfg.experts_per_layer <= num_experts:
                raise EngineError(f"engine offload: experts_per_layer must be within [1, {num_experts}], "
                                  f"got {cfg.experts_per_layer}")
            return cfg.experts_per_layer
        self._check_budget(self._minimum_bytes())
        dense = self._dense_device_bytes()
        reserve = cfg.kv_reserve_bytes
        if reserve is None:
            reserve = int(DEFAULT_KV_RESERVE * (cfg.budget_bytes - dense))
        reserve = max(reserve, self._kv_block_bytes())
        per_layer = self._num_moe * self._per_expert
        k = (cfg.budget_bytes - dense - reserve) // per_layer if per_layer else num_experts
        return int(min(max(k, 1), num_experts))

    def _minimum_bytes(self) -> int:
        return sum(n for _, n in self.budget_minimum())

    def budget_minimum(self) -> list[tuple[str, int]]:
        return [("dense weights", self._dense_device_bytes()),
                (f"one expert per MoE layer ({self._num_moe} x {format_size(self._per_expert)})",
                 self._num_moe * self._per_expert),
                ("one KV block", self._kv_block_bytes())]

    def _model_stats(self) -> dict[str, float]:
        stats = super()._model_stats()
        backend: OffloadBackend = self.experts  # type: ignore[assignment]
        layers = backend.layers()
        stats["bytes_per_expert"] = self._per_expert
        stats["expert_slots_per_layer"] = backend.slots(layers[0]) if layers else 0
        cfg: OffloadConfig = self.config  # type: ignore[assignment]
        if cfg.link_gbps is not None:
            stats["link_peak_bytes_per_s"] = cfg.link_gbps * 1e9
        return stats

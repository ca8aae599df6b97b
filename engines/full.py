"""Engine `full`, the default: PagedWeight's quality-aware expert widths under MoE-Gen's
module-based batching, a recipe of both techniques' parts. The plan (KV placement, micro-batch,
ring) is moegen's, made for experts at their quality floors; the pages, arbiter and feedback are
pagedweight's, in what the plan leaves. By default (`floor_bits` 0) an expert the budget cannot
hold leaves the device and is fetched at its quality floor when routed. A gpt-oss MXFP4 folder
is served from its own format, as pagedweight serves it (engines/pagedweight/engine.py).
Design: docs/full.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engines.base import EngineError
from engines.common.device import resolve_device, resolve_dtype
from engines.moegen.engine import PlanPredictor, layer_major, plan_stats
from engines.moegen.plan import MoEGenConfig, held_plan, loaded_shape, make_plan, placement_claims, plan_hardware
from engines.pagedweight.controller import PageBudget, PagedController
from engines.pagedweight.engine import (
    PagedWeightConfig,
    bits_text,
    paged_claims,
    paged_experts,
    paged_load,
    paged_stats,
)
from engines.runtime.budget import DeviceBudget
from engines.runtime.checkpoint import open_checkpoint
from engines.runtime.engine import EngineParts, KVPool, Loaded, RuntimeEngine
from engines.runtime.kv_cache import PagedKVCache
from engines.runtime.memory import KVSizing, kv_cache_blocks
from engines.runtime.shape import model_shape


@dataclass(frozen=True)
class FullConfig(PagedWeightConfig, MoEGenConfig):
    max_num_batched_tokens: int = 8192  # large per-module batches (moegen's default)
    floor_bits: int = 0  # experts may leave the device; they come back at their quality floor


def whole_device_budget(cfg: FullConfig) -> int:
    """No --budget: every weight at full precision plus the KV pool `moe` would size (CUDA: what
    gpu_memory_utilization leaves of the free memory)."""
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * cfg.gpu_memory_utilization)
    dtype, mc = resolve_dtype(cfg.dtype, device), open_checkpoint(cfg.model).config
    shape, block = model_shape(mc, dtype.itemsize), PagedKVCache.model_block_bytes(mc, cfg.block_size, dtype)
    sizing = KVSizing(cfg.block_size, cfg.kv_cache_gb, cfg.kv_blocks, cfg.gpu_memory_utilization,
                      cfg.max_num_seqs, cfg.max_model_len or mc.max_position_embeddings)
    return shape.dense_bytes + shape.total_experts * shape.expert_bytes + kv_cache_blocks(sizing, block, device) * block


class FullEngine(RuntimeEngine):
    name = "full"
    config_cls = FullConfig
    needs_calibration = True

    def start(self) -> None:
        if self.config.budget_bytes is None and self.config.model is not None:  # info().config shows it
            self.config = dataclasses.replace(self.config, budget_bytes=whole_device_budget(self.config),
                                              kv_cache_gb=None, kv_blocks=None)
        super().start()

    def load(self, cfg: FullConfig) -> Loaded:
        return paged_load(self, cfg)

    def build(self, cfg: FullConfig, loaded: Loaded) -> EngineParts:
        if cfg.expert_bits is not None:
            raise EngineError("engine full pages its own expert precisions; expert_bits is engine moe's fake "
                              "quantization (drop it, or use --engine moe)")
        mc, dense = loaded.checkpoint.config, loaded.dense_bytes
        # A group size that does not divide the experts' widths is replaced (or rows padded) there, with a note.
        self.paged = paged = paged_experts(cfg, loaded, self.name)
        notes = list(paged.notes)
        cfg = dataclasses.replace(cfg, group_size=paged.group_size, bits=bits_text(paged.bit_widths, paged.mxfp4))
        backend, block, per_expert = paged.backend, loaded.kv_block_bytes(cfg.block_size), loaded.bytes_per_expert
        shape, hw = loaded_shape(loaded, per_expert, self.name), plan_hardware(cfg, loaded.device)

        def claims(placement: str, staging: int) -> list:  # pagedweight's, and the KV's for a placement
            kv = placement_claims(cfg, placement, staging, block, mc.num_layers, mc.max_position_embeddings)
            return [*paged_claims(cfg, paged, dense), *kv]

        # Checked in full's own terms before the plan's; the plan is made for experts at their floors.
        DeviceBudget(self.name, cfg.budget_bytes, claims(cfg.kv_placement, 0)).check()
        at_floor = dataclasses.replace(shape, expert_bytes=max(s.nbytes(paged.quality[k])
                                                               for k, s in backend.stores.items()))
        self.plan = plan = make_plan(dataclasses.replace(cfg, expert_slots=backend.fetch_slots), at_floor, hw,
                                     mc.max_position_embeddings, self.name)
        on_device = plan.kv_placement == "device"
        room = PageBudget(cfg.budget_bytes, dense, block, on_device, plan.staging_bytes, cfg.kv_reserve_bytes)

        def held() -> tuple:  # at start, once the arbiter placed the experts: the plan for what it holds
            new_shape, self.plan = held_plan(cfg, plan, shape, hw, [backend.expert_bytes(*k) for k in backend.stores],
                                             backend.fetch_slots)
            return new_shape, self.plan

        return EngineParts(
            backend, claims(plan.kv_placement, plan.staging_bytes),
            KVPool(on_device, dense + paged.floor_bytes(), 1.0 if cfg.host_kv_gb is None else cfg.host_kv_gb),
            copies=backend.copies,
            executor=layer_major(plan, backend.copies),
            controllers=[PagedController(cfg, paged, room), PlanPredictor(shape, hw, plan, refresh=held)],
            stats=lambda: {**plan_stats(cfg, self.plan, per_expert), **paged_stats(paged), "plan_expert_bytes_at_floor":
                           max(store.nbytes(paged.quality[k]) for k, store in backend.stores.items())},
            notes=notes, config=cfg)

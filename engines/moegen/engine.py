"""Engine `moegen`: module-based batching (MoE-Gen), planned by a cost model, as a recipe.

Tokens of many sequences accumulate (KV in the host tier, so the batch is not bounded by
device memory); each step runs layer-major (executor.py): attention in micro-batches, then
every routed expert once over all tokens routed to it. Experts not kept resident stream
through a ring of device slots (streaming.py). The plan (plan.py) picks the KV placement, the
ring, the residents and the micro-batch; every step reports its predicted time. Design and
measurements: docs/moegen.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from engines.base import EngineError
from engines.common.device import dtype_name
from engines.moegen.cost import STREAMED, BatchPlan, Hardware, step_cost
from engines.moegen.executor import HostAttention, LayerMajorExecutor, StreamAttention
from engines.moegen.plan import MoEGenConfig, loaded_shape, make_plan, plan_claims, plan_hardware
from engines.moegen.streaming import StreamingBackend
from engines.runtime.batch import StepBatch
from engines.runtime.copies import CopyEngine
from engines.runtime.engine import Controller, EngineParts, ExecutorFactory, KVPool, Loaded, RuntimeEngine
from engines.runtime.executor import Executor
from engines.runtime.kv_cache import PagedKVCache
from engines.runtime.model import MoEModel
from engines.runtime.scheduler import Scheduler
from engines.runtime.shape import ModelShape
from engines.runtime.transfer import TransferLedger


def layer_major(plan: BatchPlan, copies: CopyEngine) -> ExecutorFactory:
    """The executor part of a plan: layer-major over micro-batches, attention beside the KV
    (device, host) or over blocks streamed into a device staging buffer (stream, split)."""

    def build(model: MoEModel, kv: PagedKVCache, ledger: TransferLedger) -> Executor:
        host = plan.kv_placement == "host"
        attend = HostAttention(kv, copies) if host else None
        if plan.kv_placement in STREAMED:
            half = plan.staging_bytes // (2 * (kv.block_bytes // model.config.num_layers))
            attend = StreamAttention(kv, copies, ledger, half, plan.host_share)
        return LayerMajorExecutor(model, ledger, plan.micro_batch, attend, host_layout=host)

    return build


class PlanPredictor(Controller):
    """Each step's time as the cost model predicts it for the plan (`predicted_step_s`).
    `refresh`, when given, redoes the shape and plan at start, after the parts before it
    placed their weights (engine full: the widths its arbiter holds)."""

    def __init__(self, shape: ModelShape, hw: Hardware, plan: BatchPlan,
                 refresh: Callable[[], tuple[ModelShape, BatchPlan]] | None = None) -> None:
        self.shape, self.hw, self.plan, self.refresh = shape, hw, plan, refresh

    def start(self, kv: PagedKVCache, scheduler: Scheduler) -> None:
        if self.refresh is not None:
            self.shape, self.plan = self.refresh()

    def after_step(self, batch: StepBatch | None) -> Mapping[str, float]:
        if batch is None:
            return {}
        decodes = batch.chunks[: batch.num_decode]
        prefills = batch.chunks[batch.num_decode :]
        cost = step_cost(self.shape, self.hw, self.plan, len(decodes), sum(c.length for c in prefills),
                         sum(c.start + 1 for c in decodes),
                         sum(c.length * c.start + c.length * (c.length + 1) // 2 for c in prefills), len(prefills))
        return {"predicted_step_s": cost.total_s}


def plan_stats(cfg: MoEGenConfig, plan: BatchPlan, per_expert: int) -> dict[str, Any]:
    """The plan in the engine info's model_stats (plan_*), beside the expert size it streams."""
    p = plan
    stats: dict[str, Any] = {
        "bytes_per_expert": per_expert, "plan_kv_on_host": int(p.kv_placement != "device"),
        "plan_kv_streamed": int(p.kv_placement in STREAMED),
        "plan_host_share": p.host_share if p.kv_placement == "split" else float(p.kv_placement == "host"),
        "plan_staging_bytes": p.staging_bytes, "plan_batch_seqs": p.batch_seqs, "plan_micro_batch": p.micro_batch,
        "plan_expert_slots": p.expert_slots, "plan_resident_experts": p.resident_experts,
        "plan_context": cfg.plan_context}
    if p.predicted is not None:
        stats.update(plan_predicted_decode_step_s=p.predicted.total_s, plan_predicted_tokens_per_s=p.tokens_per_s,
                     plan_predicted_h2d_bytes_per_step=p.predicted.h2d_bytes)
    if cfg.link_gbps is not None:
        stats["link_peak_bytes_per_s"] = cfg.link_gbps * 1e9
    return stats


def plan_copies(loaded: Loaded, cfg: MoEGenConfig, name: str) -> CopyEngine:
    try:
        return CopyEngine(loaded.ledger, loaded.device, cfg.link_gbps)
    except ValueError as exc:  # link_gbps <= 0, or a link model asked for on CUDA
        raise EngineError(f"engine {name}: {exc}") from None


def simulated_layer_major(cfg: MoEGenConfig, plan: BatchPlan, shape: ModelShape,
                          hw: Hardware) -> Callable[..., Executor]:
    """The executor part of a simulated run (--simulate): the plan's control path on the meta
    device, priced by this cost model (engines/moegen/simulate.py)."""

    def build(simulation, model: MoEModel, kv: PagedKVCache, ledger: TransferLedger, experts, dense_bytes_read: int):
        from engines.moegen.simulate import MoEGenSimExecutor  # noqa: PLC0415  (simulated runs only: engines.sim)

        return MoEGenSimExecutor(simulation, cfg, model, kv, ledger, experts, dense_bytes_read, plan, shape, hw)

    return build


def machine(engine: RuntimeEngine, cfg: MoEGenConfig, loaded: Loaded, shape: ModelShape) -> tuple[Hardware, float]:
    """The plan's machine and the host-tier KV pool's GiB: measured (peaks, host_kv_gb or 1 GiB),
    or on --simulate the hardware profile's (its host memory sizes the pool unless host_kv_gb is given)."""
    if engine.simulation is None:
        return plan_hardware(cfg, loaded.device), 1.0 if cfg.host_kv_gb is None else cfg.host_kv_gb
    from engines.moegen.simulate import host_kv_gb, sim_hardware  # noqa: PLC0415  (simulated runs only: engines.sim)

    sim = engine.simulation
    hw = sim_hardware(sim.profile, dtype_name(loaded.dtype), shape, sim.shared_processor, cfg.plan_context)
    if cfg.host_kv_gb is not None or sim.shared_processor:  # the cpu profile: 1 GiB, as a measured CPU run
        return hw, 1.0 if cfg.host_kv_gb is None else cfg.host_kv_gb
    gb = host_kv_gb(sim.profile, shape, cfg.gpu_memory_utilization)
    if cfg.kv_placement != "device":
        sim.notes.append(f"host-tier KV pool {gb:.1f} GiB: {sim.profile.name}'s host memory less the routed "
                         f"experts, x gpu_memory_utilization {cfg.gpu_memory_utilization} (set host_kv_gb to change)")
    return hw, gb


class MoEGenEngine(RuntimeEngine):
    name = "moegen"
    config_cls = MoEGenConfig
    plannable = True
    simulates = True
    sim_overhead_keys = ("layer_major",)

    def build(self, cfg: MoEGenConfig, loaded: Loaded) -> EngineParts:
        if cfg.expert_bits is not None:
            raise EngineError("engine moegen streams full-precision experts; expert_bits is engine moe's fake "
                              "quantization (drop it, or use --engine moe)")
        dense, mc = loaded.experts, loaded.checkpoint.config
        per_expert = loaded.bytes_per_expert
        shape = loaded_shape(loaded, per_expert, self.name)
        hw, host_gb = machine(self, cfg, loaded, shape)
        self.plan = plan = make_plan(cfg, shape, hw, mc.max_position_embeddings, self.name)
        copies = plan_copies(loaded, cfg, self.name)
        pairs = [(i, e) for i in sorted(dense) for e in range(dense[i].num_experts)]
        backend = StreamingBackend(dense, plan.expert_slots, set(pairs[: plan.resident_experts]), copies,
                                   loaded.device)
        block = loaded.kv_block_bytes(cfg.block_size)
        claims = plan_claims(cfg, loaded.dense_bytes, per_expert, block, mc.num_layers, mc.max_position_embeddings)
        on_device = plan.kv_placement == "device"
        kv = KVPool(on_device, loaded.dense_bytes + backend.device_bytes(), host_gb)
        return EngineParts(backend, claims, kv, copies=copies, executor=layer_major(plan, copies),
                           controllers=[PlanPredictor(shape, hw, plan)],
                           stats=lambda: plan_stats(cfg, plan, per_expert),
                           sim_executor=simulated_layer_major(cfg, plan, shape, hw))

"""Engine `moegen`: module-based batching (MoE-Gen) on the `moe` runtime, planned by a cost model.

Tokens of many sequences accumulate (KV in the host tier, so the batch is not bounded by
device memory); each step runs layer-major (engines/modbatch/executor.py): attention in
micro-batches, then every routed expert once over all tokens routed to it. Attention runs next
to the KV (device or host placement), or on the device over KV blocks streamed from the host
tier per micro-batch (stream), or split between the two (split). Experts not kept
resident stream through a ring of device slots, the next layer's copies overlapping this
layer's compute (engines/modbatch/streaming.py). The KV placement, the ring, the resident
experts and the micro-batch size come from the cost model (engines/modbatch/cost.py) unless
set; the plan is in the engine info and every step reports its predicted time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engines.base import EngineError, StepOutput
from engines.modbatch.cost import (
    PLACEMENTS,
    STREAMED,
    Hardware,
    ModelShape,
    Plan,
    Workload,
    choose_plan,
    decode_cost,
    staging_bytes,
    step_cost,
)
from engines.modbatch.executor import HostAttention, LayerMajorExecutor, StreamAttention
from engines.modbatch.hardware import device_name, hardware, model_shape
from engines.modbatch.streaming import StreamingBackend
from engines.moe import MoEEngine, MoEEngineConfig, budget_error
from engines.runtime.copies import CopyEngine
from engines.runtime.experts import ExpertBackend
from engines.runtime.kv_cache import PagedKVCache
from engines.runtime.memory import KVSizing, kv_cache_blocks
from engines.runtime.weights import DenseExperts
from engines.sizes import format_size


@dataclass(frozen=True)
class MoEGenConfig(MoEEngineConfig):
    max_num_batched_tokens: int = 8192  # large per-module batches are the point
    # auto (the plan chooses) | device (KV blocks in --budget) | host (KV in the host tier, attention on
    # the host) | stream (KV in the host tier, each micro-batch's blocks copied into a device staging
    # buffer inside --budget, attention on the device) | split (each decode micro-batch: host_share of
    # its sequences as host, the rest as stream)
    kv_placement: str = "auto"
    host_share: float | None = None  # split: share of each decode micro-batch attended on the host; None: the plan
    expert_slots: int | None = None  # ring slots streaming non-resident experts; None: the plan
    resident_experts: int | None = None  # experts kept on the device; None: the plan
    micro_batch: int | None = None  # sequences per decode-attention micro-batch; None: the plan
    plan_context: int = 1024  # mean tokens per sequence the plan assumes for its decode batch
    host_kv_gb: float = 1.0  # host-tier KV pool (host placement)
    host_scratch_mb: int = 256  # host memory one attention micro-batch may gather KV into
    # CPU only: model the host<->device link at this many GB/s (see engines/runtime/copies.py).
    link_gbps: float | None = None
    # Peaks for the cost model; None: `pwbench hw`'s measurement of this machine, else assumed.
    peak_memory_gbps: float | None = None
    peak_gflops: float | None = None
    op_overhead_us: float | None = None  # dispatch cost of one torch call; None: `pwbench hw`'s, else 0


def seq_blocks(cfg: MoEGenConfig, max_len: int | None = None) -> int:
    """KV blocks of one sequence of the longest length (max_model_len, at most the model's
    `max_len`): what a staging half must hold at least."""
    longest = min(cfg.max_model_len or max_len, max_len) if max_len else (cfg.max_model_len or cfg.plan_context)
    return -(-longest // cfg.block_size)


def minimum_parts(cfg: MoEGenConfig, dense: int, expert: int, kv_block: int, layers: int = 1,
                  max_len: int | None = None) -> list[tuple[str, int]]:
    """What the smallest budget holds: dense weights, one ring slot, and a KV block when KV
    must be on the device, or (stream, split) a staging buffer of two halves that each hold
    one layer's blocks of one sequence of the longest length."""
    parts = [("dense weights", dense), ("one expert ring slot", expert)]
    if cfg.kv_placement in STREAMED:
        parts.append(staging_minimum(cfg, kv_block, layers, max_len))
    return parts + ([("one KV block", kv_block)] if cfg.kv_placement == "device" else [])


def staging_minimum(cfg: MoEGenConfig, kv_block: int, layers: int = 1, max_len: int | None = None) -> tuple[str, int]:
    """The smallest KV staging buffer (stream, split): two halves that each hold one layer's
    blocks of one sequence of the longest length."""
    blocks = seq_blocks(cfg, max_len)
    return f"the KV staging buffer (2 x {blocks} blocks of one layer)", 2 * blocks * (kv_block // layers)


def plan_workload(cfg: MoEGenConfig) -> Workload:
    """What the plan optimises for: max_num_seqs sequences of plan_context tokens (at most
    max_model_len)."""
    return Workload(cfg.max_num_seqs, min(cfg.plan_context, cfg.max_model_len or cfg.plan_context))


def make_plan(cfg: MoEGenConfig, shape: ModelShape, hw: Hardware, max_len: int | None = None,
              name: str = "moegen") -> Plan:
    """The cost model's plan for `cfg` (its budget, batch and placement options), with the
    options that fix a part of it (expert_slots, resident_experts, micro_batch, host_share)
    applied and the prediction redone; an impossible combination is an EngineError naming the
    options. `max_len`: the model's longest sequence (None: max_model_len, else plan_context)."""
    if cfg.kv_placement not in ("auto", *PLACEMENTS):
        raise EngineError(f"engine {name}: kv_placement must be one of auto, {', '.join(PLACEMENTS)}, "
                          f"got {cfg.kv_placement!r}")
    if cfg.host_share is not None and not 0 <= cfg.host_share <= 1:
        raise EngineError(f"engine {name}: host_share must be within [0, 1] (the share of each decode micro-batch "
                          f"attended on the host), got {cfg.host_share}")
    if cfg.host_share is not None and cfg.kv_placement not in ("split", "auto"):
        raise EngineError(f"engine {name}: host_share applies to kv_placement=split, not {cfg.kv_placement!r}")
    if cfg.budget_bytes is None:
        raise EngineError(f"engine {name} needs a device budget (--budget SIZE): its plan streams what the "
                          "budget cannot hold")
    kv_block = cfg.block_size * shape.kv_bytes_per_token
    parts = minimum_parts(cfg, shape.dense_bytes, shape.expert_bytes, kv_block, shape.layers, max_len)
    if cfg.budget_bytes < sum(n for _, n in parts):
        err = budget_error(name, cfg.budget_bytes, parts)
        if cfg.kv_placement in STREAMED:  # name the other fix too
            err = EngineError(f"{err}; or use --set kv_placement=host (no staging buffer) or a smaller max_model_len")
        raise err
    work = plan_workload(cfg)
    placements = PLACEMENTS if cfg.kv_placement == "auto" else (cfg.kv_placement,)
    min_blocks = seq_blocks(cfg, max_len)
    try:
        plan = choose_plan(shape, hw, cfg.budget_bytes, work, kv_block, cfg.host_scratch_mb << 20, placements,
                           min_blocks, cfg.host_share)
    except ValueError as exc:
        raise EngineError(f"engine {name}: {exc}; raise --budget or use --set kv_placement=host") from None
    fixed = {k: getattr(cfg, k) for k in ("expert_slots", "resident_experts", "micro_batch") if getattr(cfg, k) is not None}
    if not fixed:
        return plan
    total = shape.total_experts
    resident = fixed.get("resident_experts", plan.resident_experts)
    if not 0 <= resident <= total:
        raise EngineError(f"engine {name}: resident_experts must be within [0, {total}], got {resident}")
    if fixed.get("expert_slots", 1) < 1 or fixed.get("micro_batch", 1) < 1:
        raise EngineError(f"engine {name}: expert_slots and micro_batch must be >= 1")
    micro = fixed.get("micro_batch", plan.micro_batch)
    staged = (staging_bytes(shape, kv_block, micro, work.context, min_blocks) if plan.kv_placement in STREAMED
              else 0)
    if "expert_slots" in fixed and "resident_experts" not in fixed:  # the ring as fixed; residents in what is left
        left = cfg.budget_bytes - shape.dense_bytes - staged - (kv_block if plan.kv_placement == "device" else 0)
        resident = max(0, min(resident, left // shape.expert_bytes - fixed["expert_slots"]))
    slots = fixed.get("expert_slots", plan.expert_slots or 1) if resident < total else 0
    weights = shape.dense_bytes + (slots + resident) * shape.expert_bytes
    if weights + staged + (kv_block if plan.kv_placement == "device" else 0) > cfg.budget_bytes:
        beside = f"the dense weights and the KV staging buffer ({format_size(staged)})" if staged else "the dense weights"
        raise EngineError(f"engine {name}: {slots} ring slots + {resident} resident experts "
                          f"({format_size((slots + resident) * shape.expert_bytes)}) do not fit --budget "
                          f"{format_size(cfg.budget_bytes)} beside {beside}")
    plan = dataclasses.replace(plan, resident_experts=resident, expert_slots=slots, micro_batch=micro,
                               staging_bytes=staged)
    return dataclasses.replace(plan, predicted=decode_cost(shape, hw, plan, plan.batch_seqs, work.context))


class MoEGenEngine(MoEEngine):
    name = "moegen"
    config_cls = MoEGenConfig
    float32_reference = False
    plain_experts_only = True  # the streaming ring computes bias-free SwiGLU experts

    def check_experts(self, mc) -> None:
        """Also refuse attention its micro-batched (and host) attention does not compute."""
        super().check_experts(mc)
        what = ("multi-head latent attention" if mc.mla is not None else "attention sinks" if mc.attention_sinks
                else "a non-default softmax scale" if mc.attn_scale is not None else None)
        if what:
            raise EngineError(f"engine {self.name} runs grouped-query attention only; {mc.architecture} uses {what}: "
                              "use engine moe or offload for this model")

    def build_experts(self, dense: dict[int, DenseExperts]) -> ExpertBackend:
        cfg: MoEGenConfig = self.config  # type: ignore[assignment]
        if cfg.expert_bits is not None:
            raise EngineError("engine moegen streams full-precision experts; expert_bits is engine moe's fake "
                              "quantization (drop it, or use --engine moe)")
        self._per_expert = next(iter(dense.values())).expert_nbytes(0) if dense else 0
        self.plan = self._plan()
        try:
            self.copies = CopyEngine(self.ledger, self.device, cfg.link_gbps)
        except ValueError as exc:  # link_gbps <= 0, or a link model asked for on CUDA
            raise EngineError(f"engine moegen: {exc}") from None
        layers = sorted(dense)
        pairs = [(i, e) for i in layers for e in range(dense[i].num_experts)]
        resident = set(pairs[: self.plan.resident_experts])
        return StreamingBackend(dense, self.plan.expert_slots, resident, self.copies, self.device)

    # -- the plan ------------------------------------------------------------------------------------
    def _plan(self) -> Plan:
        self.shape, self.hardware = self._shape(), self._hardware()
        return make_plan(self.config, self.shape, self.hardware, self.checkpoint.config.max_position_embeddings,  # type: ignore[arg-type]
                         self.name)

    def _shape(self) -> ModelShape:
        shape = model_shape(self.checkpoint.config, self.weights.embed.element_size())
        if (shape.dense_bytes, shape.expert_bytes) != (self._dense_device_bytes(), self._per_expert):
            raise EngineError(f"engine moegen: the cost model's sizes ({shape.dense_bytes} dense, {shape.expert_bytes} "
                              f"per expert) differ from the loaded weights ({self._dense_device_bytes()}, "
                              f"{self._per_expert}); this architecture needs its shape in engines/modbatch/hardware.py")
        return shape

    def _hardware(self) -> Hardware:
        cfg: MoEGenConfig = self.config  # type: ignore[assignment]
        peaks = None
        if cfg.peak_memory_gbps is not None and cfg.peak_gflops is not None:
            peaks = {"memory_bandwidth_bytes_per_s": cfg.peak_memory_gbps * 1e9, "matmul_flops_per_s": cfg.peak_gflops * 1e9}
        link = cfg.link_gbps * 1e9 if cfg.link_gbps is not None else None
        return hardware(device_name(self.device), self.device.type == "cpu", link, peaks,
                        op_overhead_s=cfg.op_overhead_us * 1e-6 if cfg.op_overhead_us is not None else None)

    def budget_minimum(self) -> list[tuple[str, int]]:
        mc = self.checkpoint.config
        return minimum_parts(self.config, self._dense_device_bytes(), self._per_expert, self._kv_block_bytes(),  # type: ignore[arg-type]
                             mc.num_layers, mc.max_position_embeddings)

    # -- KV and execution ----------------------------------------------------------------------------
    def _build_kv_cache(self) -> PagedKVCache:
        if self.plan.kv_placement == "device":
            return super()._build_kv_cache()
        cfg, mc = self.config, self.checkpoint.config
        sizing = KVSizing(cfg.block_size, cfg.host_kv_gb, None, cfg.gpu_memory_utilization,
                          cfg.max_num_seqs, cfg.max_model_len or mc.max_position_embeddings)
        host = torch.device("cpu")  # the host tier
        blocks = kv_cache_blocks(sizing, self._kv_block_bytes(), host)
        return PagedKVCache(mc.num_layers, blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim, self.dtype, host)

    def start(self) -> None:
        super().start()
        p, windows = self.plan, self.checkpoint.config.sliding_windows
        host = p.kv_placement == "host"
        attend = HostAttention(self.kv, self.copies, windows) if host else None
        self.staging = None
        if p.kv_placement in STREAMED:
            half = p.staging_bytes // (2 * (self._kv_block_bytes() // self.checkpoint.config.num_layers))
            self.staging = attend = StreamAttention(self.kv, self.copies, windows, self.ledger, half, p.host_share)
        self.executor = LayerMajorExecutor(self.model, self.ledger, p.micro_batch, attend, host_layout=host)
        self.copies.take_step()  # resident and loading copies are not part of any step

    def _step_output(self, plan, batch, result, outputs, started) -> StepOutput:
        out = super()._step_output(plan, batch, result, outputs, started)
        extras = dict(out.extras)
        if batch is not None:
            decodes = batch.chunks[: batch.num_decode]
            prefills = batch.chunks[batch.num_decode :]
            cost = step_cost(self.shape, self.hardware, self.plan, len(decodes), sum(c.length for c in prefills),
                             sum(c.start + 1 for c in decodes),
                             sum(c.length * c.start + c.length * (c.length + 1) // 2 for c in prefills), len(prefills))
            extras["predicted_step_s"] = cost.total_s
        # The KV pool is on the device (device), in the host tier (host), or there with a device
        # staging buffer (stream, split): that buffer is the device's KV bytes.
        kv = (out.device_kv_bytes if self.plan.kv_placement == "device"
              else self.staging.nbytes() if getattr(self, "staging", None) is not None else 0)
        return dataclasses.replace(out, device_kv_bytes=kv, extras=extras)

    def _model_stats(self) -> dict[str, float]:
        stats = super()._model_stats()
        p = self.plan
        stats["bytes_per_expert"] = self._per_expert
        stats.update(plan_kv_on_host=int(p.kv_placement != "device"), plan_kv_streamed=int(p.kv_placement in STREAMED),
                     plan_host_share=p.host_share if p.kv_placement == "split" else float(p.kv_placement == "host"),
                     plan_staging_bytes=p.staging_bytes, plan_batch_seqs=p.batch_seqs,
                     plan_micro_batch=p.micro_batch, plan_expert_slots=p.expert_slots,
                     plan_resident_experts=p.resident_experts, plan_context=self.config.plan_context)
        if p.predicted is not None:
            stats.update(plan_predicted_decode_step_s=p.predicted.total_s, plan_predicted_tokens_per_s=p.tokens_per_s,
                         plan_predicted_h2d_bytes_per_step=p.predicted.h2d_bytes)
        if self.config.link_gbps is not None:
            stats["link_peak_bytes_per_s"] = self.config.link_gbps * 1e9
        return stats

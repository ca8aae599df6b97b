"""The moegen plan: KV placement, decode batch, micro-batch, expert ring and residents, chosen by
the cost model (cost.py) for a budget on a machine (hardware.py), with the options that fix a
part of it applied. Engines moegen and full run it; `pwbench plan` prints it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engines.base import EngineError
from engines.common.sizes import format_size
from engines.moegen.cost import (
    PLACEMENTS,
    STREAMED,
    BatchPlan,
    Hardware,
    ModelShape,
    Workload,
    choose_plan,
    decode_cost,
    staging_bytes,
)
from engines.moegen.hardware import device_name, hardware
from engines.runtime.budget import Claim, budget_error
from engines.runtime.engine import Loaded, RuntimeConfig
from engines.runtime.shape import model_shape


@dataclass(frozen=True)
class MoEGenConfig(RuntimeConfig):
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
    # host-tier KV pool (host, stream, split); None: 1 GiB, or on --simulate the profile's host memory less
    # the routed experts x gpu_memory_utilization
    host_kv_gb: float | None = None
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


def plan_claims(cfg: MoEGenConfig, dense: int, expert: int, kv_block: int, layers: int = 1,
                max_len: int | None = None) -> list[Claim]:
    """What the smallest budget holds: dense weights, one ring slot, and a KV block when KV
    must be on the device, or (stream, split) a staging buffer of two halves that each hold
    one layer's blocks of one sequence of the longest length."""
    claims = [Claim("dense weights", dense), Claim("one expert ring slot", expert)]
    if cfg.kv_placement in STREAMED:
        claims.append(staging_claim(cfg, kv_block, layers, max_len))
    return claims + ([Claim("one KV block", kv_block)] if cfg.kv_placement == "device" else [])


def staging_claim(cfg: MoEGenConfig, kv_block: int, layers: int = 1, max_len: int | None = None) -> Claim:
    """The smallest KV staging buffer (stream, split): two halves that each hold one layer's
    blocks of one sequence of the longest length."""
    blocks = seq_blocks(cfg, max_len)
    return Claim(f"the KV staging buffer (2 x {blocks} blocks of one layer)", 2 * blocks * (kv_block // layers))


def plan_workload(cfg: MoEGenConfig) -> Workload:
    """What the plan optimises for: max_num_seqs sequences of plan_context tokens (at most
    max_model_len)."""
    return Workload(cfg.max_num_seqs, min(cfg.plan_context, cfg.max_model_len or cfg.plan_context))


def make_plan(cfg: MoEGenConfig, shape: ModelShape, hw: Hardware, max_len: int | None = None,
              name: str = "moegen") -> BatchPlan:
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
    claims = plan_claims(cfg, shape.dense_bytes, shape.expert_bytes, kv_block, shape.layers, max_len)
    if cfg.budget_bytes < sum(c.nbytes for c in claims):
        err = budget_error(name, cfg.budget_bytes, claims)
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
    fixed = {k: getattr(cfg, k) for k in ("expert_slots", "resident_experts", "micro_batch")
             if getattr(cfg, k) is not None}
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
        beside = (f"the dense weights and the KV staging buffer ({format_size(staged)})" if staged
                  else "the dense weights")
        raise EngineError(f"engine {name}: {slots} ring slots + {resident} resident experts "
                          f"({format_size((slots + resident) * shape.expert_bytes)}) do not fit --budget "
                          f"{format_size(cfg.budget_bytes)} beside {beside}")
    plan = dataclasses.replace(plan, resident_experts=resident, expert_slots=slots, micro_batch=micro,
                               staging_bytes=staged)
    return dataclasses.replace(plan, predicted=decode_cost(shape, hw, plan, plan.batch_seqs, work.context))


def placement_claims(cfg: MoEGenConfig, placement: str, staging: int, kv_block: int, layers: int,
                     max_len: int) -> list[Claim]:
    """The KV's claims for a placement: a block on the device, or (stream, split) the plan's
    staging buffer, or before a plan exists the smallest one."""
    if staging:
        return [Claim("the KV staging buffer", staging)]
    if placement in STREAMED:
        return [staging_claim(cfg, kv_block, layers, max_len)]
    return [Claim("one KV block", kv_block)] if placement == "device" else []


def held_plan(cfg: MoEGenConfig, plan: BatchPlan, shape: ModelShape, hw: Hardware, held: list[int],
              ring: int) -> tuple[ModelShape, BatchPlan]:
    """The plan's decode prediction redone for experts held at `held` bytes each (0: off the
    device, fetched through a `ring` of slots): the mean held size becomes the shape's."""
    resident = sum(n > 0 for n in held)
    shape = dataclasses.replace(shape, expert_bytes=max(1, sum(held) // resident) if resident else shape.expert_bytes)
    plan = dataclasses.replace(plan, resident_experts=resident, expert_slots=ring if resident < len(held) else 0)
    return shape, dataclasses.replace(plan, predicted=decode_cost(shape, hw, plan, plan.batch_seqs,
                                                                  plan_workload(cfg).context))


def plan_hardware(cfg: MoEGenConfig, device) -> Hardware:
    """The cost model's machine: peaks given as options, else `pwbench hw`'s, else assumed."""
    peaks = None
    if cfg.peak_memory_gbps is not None and cfg.peak_gflops is not None:
        peaks = {"memory_bandwidth_bytes_per_s": cfg.peak_memory_gbps * 1e9,
                 "matmul_flops_per_s": cfg.peak_gflops * 1e9}
    link = cfg.link_gbps * 1e9 if cfg.link_gbps is not None else None
    return hardware(device_name(device), device.type == "cpu", link, peaks,
                    op_overhead_s=cfg.op_overhead_us * 1e-6 if cfg.op_overhead_us is not None else None)


def loaded_shape(loaded: Loaded, per_expert: int, name: str) -> ModelShape:
    """The cost model's shape of a loaded model, refused when its sizes differ from the weights."""
    shape = model_shape(loaded.checkpoint.config, loaded.weights.embed.element_size())
    dense = loaded.dense_bytes
    if (shape.dense_bytes, shape.expert_bytes) != (dense, per_expert):
        raise EngineError(f"engine {name}: the cost model's sizes ({shape.dense_bytes} dense, {shape.expert_bytes} "
                          f"per expert) differ from the loaded weights ({dense}, {per_expert}); this architecture "
                          "needs its shape in engines/moegen/hardware.py")
    return shape

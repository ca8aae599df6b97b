"""The cost model of module-based batching and the plan it chooses (no torch).

A step is predicted module by module from the model's shape and the machine's peaks, as
MoE-Lightning's hierarchical roofline does (arXiv 2411.11217): each module's time is
max(bytes / bandwidth, FLOPs / FLOP rate) on the processor it runs on; a layer's time is
max(its compute, its weights' link time), because the next layer's experts copy while this
layer computes (with fewer ring slots than a layer streams, only the slots' share overlaps).
Host attention is waited for, so a layer's host and device compute add up (on a CPU run they
are the same cores anyway); MoE-Gen's overlap of host attention with device work is not built.

Weights are read at the rate decode-shaped matmuls stream them (`pwbench hw` measures it; on
these CPUs far below the copy bandwidth). Two facts about this runtime's kernels enter as
such, not as fitted constants: decode
attention gathers each sequence's KV blocks into a contiguous copy before attending (the KV
is read, written and read again: 3x its bytes), and every torch call costs a dispatch
overhead (`Hardware.op_overhead_s`; ~30 calls per layer plus ~6 per expert that runs).

`choose_plan` enumerates KV placements (device when it fits the budget, else the host tier),
expert ring slots and resident experts within the budget, predicts a decode step of the
workload's batch for each and keeps the one with the highest predicted tokens/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

PLACEMENTS = ("device", "host")
KV_READS = 3  # decode attention: gather copy (read + write) and the attention's own read
OPS_PER_LAYER = 30  # torch calls of norms, projections, RoPE, routing, combine (counted in model.py)
OPS_PER_EXPERT = 6  # gather rows, two matmuls, activation, product, scatter


@dataclass(frozen=True)
class Hardware:
    device_bytes_per_s: float
    device_flops_per_s: float
    host_bytes_per_s: float
    host_flops_per_s: float
    link_bytes_per_s: float | None  # None: no modelled link (copies are memcpys at device bandwidth)
    # The rate weights stream through decode-shaped (few-row) matmuls, measured by `pwbench hw`;
    # None: the memory bandwidth.
    weight_bytes_per_s: float | None = None
    op_overhead_s: float = 0.0
    source: str = "given"


@dataclass(frozen=True)
class ModelShape:
    layers: int
    moe_layers: int
    experts: int  # per MoE layer
    top_k: int
    hidden: int
    q_size: int  # heads x head_dim
    kv_size: int  # KV heads x head_dim
    heads: int
    head_dim: int
    intermediate: int  # routed expert
    vocab: int
    dense_bytes: int  # every dense tensor on the device (embedding once)
    layer_dense_bytes: int  # dense bytes one layer reads (attention, norms, router, shared/dense MLP)
    head_bytes: int  # LM head (+ final norm)
    expert_bytes: int  # one routed expert
    kv_bytes_per_token: int  # all layers, K and V
    dtype_bytes: int

    @property
    def expert_flops_per_token(self) -> int:
        return 2 * 3 * self.hidden * self.intermediate

    @property
    def total_experts(self) -> int:
        return self.moe_layers * self.experts


@dataclass(frozen=True)
class Workload:
    """What the plan optimises for: sequences the engine may hold and their mean context."""

    seqs: int
    context: int  # mean tokens held (and attended) per sequence during decode


@dataclass(frozen=True)
class Plan:
    kv_placement: str  # device: KV blocks in the budget; host: KV in the host tier, attention on the host
    batch_seqs: int  # decode batch the plan is predicted for
    micro_batch: int  # sequences per decode-attention micro-batch
    expert_slots: int  # device ring slots that stream the non-resident experts
    resident_experts: int  # experts held on the device for the whole run
    device_kv_bytes: int  # budget left to KV blocks (device placement), else 0
    predicted: StepCost | None = None  # a decode step of batch_seqs at the workload's context

    @property
    def tokens_per_s(self) -> float:
        return self.batch_seqs / self.predicted.total_s if self.predicted else 0.0


@dataclass(frozen=True)
class StepCost:
    compute_s: float  # device compute (+ host compute on a shared processor)
    host_s: float  # host attention (0 with device placement)
    link_s: float  # the link busy: streamed experts and activations
    total_s: float
    h2d_bytes: int

    def as_dict(self) -> dict[str, float]:
        return {"compute_s": self.compute_s, "host_s": self.host_s, "link_s": self.link_s,
                "total_s": self.total_s, "h2d_bytes": self.h2d_bytes}


def roof(nbytes: float, flops: float, bw: float, rate: float) -> float:
    return max(nbytes / bw, flops / rate)


def step_cost(shape: ModelShape, hw: Hardware, plan: Plan, decode_seqs: int, prefill_tokens: int,
              decode_context: int, prefill_context: int, prefill_chunks: int = 0) -> StepCost:
    """One step: `decode_seqs` decode tokens attending `decode_context` keys in all (summed over
    sequences), `prefill_tokens` prompt tokens in `prefill_chunks` chunks attending
    `prefill_context` key-query pairs in all (causal), through every layer and the LM head."""
    s, T = shape, decode_seqs + prefill_tokens
    if T == 0:
        return StepCost(0.0, 0.0, 0.0, 0.0, 0)
    dev_bw, dev_f = hw.device_bytes_per_s, hw.device_flops_per_s
    w_bw = min(dev_bw, hw.weight_bytes_per_s or dev_bw)  # weights go through matmuls; KV through copies
    e = s.dtype_bytes
    kv_layer = s.kv_bytes_per_token // s.layers
    proj_flops = 2 * T * s.hidden * (2 * s.q_size + 2 * s.kv_size)
    dense_t = roof(s.layer_dense_bytes, proj_flops, w_bw, dev_f)
    att_bytes = KV_READS * decode_context * kv_layer + prefill_tokens * kv_layer
    att_flops = 4 * s.heads * s.head_dim * (decode_context + prefill_context)
    micro = max(1, math.ceil(decode_seqs / max(1, plan.micro_batch))) + prefill_chunks
    if plan.kv_placement == "host":
        att_t = roof(att_bytes, att_flops, hw.host_bytes_per_s, hw.host_flops_per_s)
        act_h2d = T * s.q_size * e  # attention output back to the device; q/k/v went d2h
        act_d2h = T * (s.q_size + 2 * s.kv_size) * e
    else:
        att_t = roof(att_bytes, att_flops, dev_bw, dev_f)
        act_h2d = act_d2h = 0
    active = min(s.experts, T * s.top_k)
    expert_t = roof(active * s.expert_bytes, T * s.top_k * s.expert_flops_per_token, w_bw, dev_f)
    streamed = s.total_experts - plan.resident_experts
    per_layer_streamed = streamed / s.moe_layers if s.moe_layers else 0
    link = hw.link_bytes_per_s or dev_bw
    expert_link = min(per_layer_streamed, active) * s.expert_bytes / link
    act_link = (act_h2d + act_d2h) / link
    overhead = hw.op_overhead_s * (OPS_PER_LAYER + 2 * micro + OPS_PER_EXPERT * active)
    layer_total = 0.0
    compute = host = link_busy = 0.0
    for layer in range(s.layers):
        moe = layer < s.moe_layers  # MoE layers first: only counts matter here
        c = dense_t + overhead + (expert_t if moe else 0.0) + (att_t if plan.kv_placement == "device" else 0.0)
        h = att_t if plan.kv_placement == "host" else 0.0
        lk = (expert_link if moe else 0.0) + act_link
        # The ring overlaps a share of the next layer's copies with this layer's compute.
        hidden = min(1.0, plan.expert_slots / per_layer_streamed) if per_layer_streamed else 1.0
        serial = (1 - hidden) * (expert_link if moe else 0.0)
        # Host attention is synchronous in this executor (the layer waits for it), so host and
        # device work add up; the copies of the next layer's experts run beside both.
        layer_total += max(c + h, lk - serial) + serial
        compute, host, link_busy = compute + c, host + h, link_busy + lk
    head = roof(s.head_bytes, 2 * (decode_seqs + prefill_chunks) * s.hidden * s.vocab, w_bw, dev_f)
    h2d = int(s.moe_layers * min(per_layer_streamed, active) * s.expert_bytes) + s.layers * act_h2d
    return StepCost(compute + head, host, link_busy, layer_total + head, h2d)


def decode_cost(shape: ModelShape, hw: Hardware, plan: Plan, seqs: int, context: int) -> StepCost:
    return step_cost(shape, hw, plan, seqs, 0, seqs * context, 0)


def choose_plan(shape: ModelShape, hw: Hardware, budget: int, work: Workload, kv_block_bytes: int,
                host_scratch_bytes: int = 256 << 20, placements: tuple[str, ...] = PLACEMENTS) -> Plan:
    """The plan with the highest predicted decode tokens/s within `budget` (see module doc);
    ties go to fewer bytes over the link, then to fewer ring slots."""
    plans = candidate_plans(shape, hw, budget, work, kv_block_bytes, host_scratch_bytes, placements)
    return max(plans, key=lambda p: (round(p.tokens_per_s, 6), -p.predicted.h2d_bytes, -p.expert_slots))


def candidate_plans(shape: ModelShape, hw: Hardware, budget: int, work: Workload, kv_block_bytes: int,
                    host_scratch_bytes: int = 256 << 20, placements: tuple[str, ...] = PLACEMENTS) -> list[Plan]:
    """Every plan choose_plan weighs, each with its predicted decode step."""
    free = budget - shape.dense_bytes
    if free < shape.expert_bytes:
        raise ValueError(f"budget {budget} holds no expert slot beside the dense weights ({shape.dense_bytes})")
    per_seq_kv = max(1, work.context) * shape.kv_bytes_per_token
    kv_layer = max(1, shape.kv_bytes_per_token // shape.layers)
    candidates: list[Plan] = []
    slot_options = sorted({1, max(1, shape.experts // 2), shape.experts, 2 * shape.experts})
    for placement in placements:
        for slots in slot_options:
            left = free - slots * shape.expert_bytes
            if left < 0:
                continue
            for share in (0.0, 0.25, 0.5, 0.75, 1.0):  # of what is left, to resident experts (device KV gets the rest)
                if placement == "host" and share < 1.0:
                    continue  # nothing else competes for the device: everything left goes to residents
                resident = min(shape.total_experts, int(left * share) // shape.expert_bytes)
                if resident == shape.total_experts:
                    slots_used = 0
                else:
                    slots_used = slots
                kv_bytes = free - (slots_used + resident) * shape.expert_bytes if placement == "device" else 0
                if placement == "device":
                    # Whole blocks, as the KV pool is allocated.
                    blocks_per_seq = math.ceil(max(1, work.context) * shape.kv_bytes_per_token / kv_block_bytes)
                    seqs = min(work.seqs, (kv_bytes // kv_block_bytes) // max(1, blocks_per_seq))
                    if seqs < 1:
                        continue
                    micro = seqs
                else:
                    seqs = work.seqs
                    micro = max(1, min(seqs, host_scratch_bytes // (max(1, work.context) * kv_layer)))
                plan = Plan(placement, seqs, micro, slots_used, resident, max(0, kv_bytes) if placement == "device" else 0)
                candidates.append(replace(plan, predicted=decode_cost(shape, hw, plan, seqs, work.context)))
    if not candidates:
        raise ValueError(f"no plan fits budget {budget}: KV for one sequence of {work.context} tokens "
                         f"({per_seq_kv} bytes) does not fit beside the weights")
    return candidates

"""The cost model of module-based batching and the plan it chooses (no torch).

A step is predicted module by module from the model's shape and the machine's peaks, as
MoE-Lightning's hierarchical roofline does (arXiv 2411.11217): each module's time is
max(bytes / bandwidth, FLOPs / FLOP rate) on the processor it runs on; a layer's time is
max(its compute, its weights' link time), because the next layer's experts copy while this
layer computes (with fewer ring slots than a layer streams, only the slots' share overlaps).
Host attention is waited for, so a layer's host and device compute add up (on a CPU run they
are the same cores anyway); MoE-Gen's overlap of host attention with device work is not built.
On a CPU run the link is modelled but every copy is still a memcpy on the same cores (twice
its bytes at the memory bandwidth), which adds to the layer's compute.

`stream` (KV in the host tier, decode attention on the device over blocks copied in per
micro-batch, two staging halves): the next micro-batch's KV copy runs while this one attends,
so a layer's attention phase takes max(device attention, KV link time), plus the first
micro-batch's copy once per step; the host gathers the blocks into its staging copy first (2x
their bytes at host bandwidth, on the calling thread). `split` attends a share of each decode
micro-batch on the host (as `host`) and streams the rest: on separate processors the host
part runs while the device part attends, max(host, max(device, link)); on one processor (a
CPU run) they add up.

Every rate is a `pwbench hw` measurement of this machine (or a datasheet's), none fitted to
the engine: weights are read at the rate decode-shaped matmuls stream them (on these CPUs far
below the copy bandwidth); a matmul's FLOP/s depend on its rows (few-row matmuls on weights
read from memory run below the peak); decode attention gets through the KV at the rate the
runtime's gather + SDPA does (without that measurement: the KV read, written and read again,
3x its bytes, at the bandwidth), causal prefill attention at its own FLOP rate; greedy
sampling's argmax reads the logits at its own rate; activations move through the elementwise
kernels at the rate measured for the step's size (a decode step's stay in cache, a prefill
step's stream through memory). Facts about this runtime's kernels enter as counts: the
elementwise kernels' activation elements per token and per expert assignment (ACT_*); every
torch call costs a dispatch overhead (`Hardware.op_overhead_s`; 180 calls per layer plus 8 per
expert that runs, counted). Left out: the Python between calls beyond that overhead and the
scheduler's per-sequence bookkeeping (on this CPU ~10% of a 256-sequence decode step).
For multi-head latent attention (DeepSeek-V3) weight and KV bytes are exact, but the attention
terms are approximate: ModelShape's q_size/kv_size/heads/head_dim stand for the absorbed form
(runtime/shape.py), so FLOPs per attended key, the projections' FLOPs and the activations
crossing to host attention are close to, not equal to, what the runtime computes and moves.

`choose_plan` enumerates KV placements (device when it fits the budget, host, stream and split
when the staging buffer fits), expert ring slots, resident experts and (stream, split) the
micro-batch that sizes the staging buffer, and (split) the host share, within the budget, predicts a decode step of the
workload's batch for each and keeps the one with the highest predicted tokens/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from engines.runtime.shape import ModelShape
from engines.sim.cost import OPS_PER_EXPERT, gemm_s

PLACEMENTS = ("device", "host", "stream", "split")
STREAMED = ("stream", "split")  # KV in the host tier, copied to the device per micro-batch
KV_READS = 3  # decode attention: gather copy (read + write) and the attention's own read
# Python-level torch calls per layer of a decode step (by attention kind) and per expert that
# runs, counted on moegen's decode steps of the Mixtral-shaped bench model, 1-256 sequences: ~182
# per layer + ~7.5 per expert (MLA: the simulator's earlier count, 300). The simulator's flat cost
# model counts decode attention groups apart (engines/sim/cost.py OPS_PER_DECODE_GROUP); this
# model's count is a mean over its steps' groups.
OPS_PER_LAYER = {"gqa": 180, "mla": 300}
# Activations read and written by the elementwise kernels of a layer (norms, RoPE, residual
# adds; per expert assignment: gathering its row, the activation and product over the gate and
# up halves, weighting and scattering its output), in elements, counted from model.py and
# experts.py: per token 14 x hidden + 6 x (q + kv) + q; per assignment 6 x hidden + 5 x intermediate.
ACT_PER_TOKEN_HIDDEN, ACT_PER_TOKEN_QKV, ACT_PER_ASSIGNMENT_HIDDEN, ACT_PER_ASSIGNMENT_INTERMEDIATE = 14, 6, 6, 5
OPS_PER_STAGED_PART = 8  # stream/split, per micro-batch: host gather, copy, staging writes, write-back


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
    # time per decode sequence and layer beyond the counted calls (a simulated run's profile; the
    # simulator's flat model prices it the same way: engines/sim/cost.py); 0 for measured runs' plans
    decode_sequence_overhead_s: float = 0.0
    source: str = "given"
    # Host and device are one processor (a CPU run): split's host and device parts add up.
    shared_processor: bool = False
    # Matmul FLOP/s at a few row counts ((rows, FLOP/s), `pwbench hw`'s `matmul_flops_at_rows`):
    # few-row matmuls run below the peak. Empty: every matmul at device_flops_per_s.
    flops_at_rows: tuple[tuple[int, float], ...] = ()
    # The rate greedy sampling (a row-wise argmax) reads logits, `pwbench hw`'s
    # `argmax_bytes_per_s` (on CPUs far below the copy bandwidth); None: not counted.
    sample_bytes_per_s: float | None = None
    # The rate the elementwise kernels move activations (`pwbench hw`'s `elementwise_bytes_per_s`:
    # an expert layer's gather, activation, product and scatter-add at decode-batch sizes);
    # None: activations not counted.
    elementwise_bytes_per_s: float | None = None
    # The same at a few step sizes ((tokens, bytes/s), `elementwise_bytes_per_s_at_tokens`):
    # a prefill step's activations stream through memory, slower than a decode step's cached
    # ones. Empty: every step at elementwise_bytes_per_s.
    elementwise_at_tokens: tuple[tuple[int, float], ...] = ()
    # The rate decode attention gets through KV (bytes of K and V attended, each once, per
    # second) as this runtime runs it (gather the blocks, then attend), on the device and on the
    # host, `pwbench hw`'s `decode_attention_bytes_per_s`; None: KV_READS x the KV bytes at the
    # memory bandwidth.
    attention_bytes_per_s: float | None = None
    host_attention_bytes_per_s: float | None = None
    # Causal prefill attention's FLOP/s over one chunk as the runtime calls it (`pwbench hw`'s
    # `prefill_attention_flops_per_s`; small chunks run far below the matmul peak); None: the
    # processor's FLOP rate.
    prefill_attention_flops_per_s: float | None = None
    host_prefill_attention_flops_per_s: float | None = None
    # This runtime's GEMMs as fractions of their roofline bound (max(bytes / device_bytes_per_s,
    # FLOPs / device_flops_per_s)) by rows ((rows, efficiency)), per module: the dense projections,
    # one expert (gate_up + down), the LM head; a simulated machine's profile curves chosen by
    # engines/sim/cost.py `module_curves` (measured on the model's own shapes where the profile has
    # them), priced by the same rule as that model's (`gemm_s`). Empty: weight_bytes_per_s and
    # flops_at_rows price that module.
    dense_efficiency: tuple[tuple[float, float], ...] = ()
    expert_efficiency: tuple[tuple[float, float], ...] = ()
    head_efficiency: tuple[tuple[float, float], ...] = ()

    def matmul_flops(self, rows: float) -> float:
        """The device's FLOP/s for a matmul of `rows` rows: interpolated in log(rows) between the
        measured points, flat beyond them."""
        return _log_interpolate(self.flops_at_rows, rows, self.device_flops_per_s)

    def elementwise_rate(self, tokens: float) -> float | None:
        """The elementwise kernels' bytes/s in a step of `tokens` tokens (None: not counted)."""
        return _log_interpolate(self.elementwise_at_tokens, tokens, self.elementwise_bytes_per_s)


def _log_interpolate(points: tuple[tuple[int, float], ...], x: float, default):
    """Measured (x, value) points interpolated in log(x), flat beyond them; `default` if none."""
    pts = sorted(points)
    if not pts:
        return default
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, v0), (x1, v1) in zip(pts, pts[1:]):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return v0 + w * (v1 - v0)
    return pts[-1][1]


@dataclass(frozen=True)
class Workload:
    """What the plan optimises for: sequences the engine may hold and their mean context."""

    seqs: int
    context: int  # mean tokens held (and attended) per sequence during decode


@dataclass(frozen=True)
class BatchPlan:
    # device: KV blocks in the budget; host: KV in the host tier, attention on the host; stream:
    # KV in the host tier, attention on the device over staged blocks; split: host_share of each
    # decode micro-batch as host, the rest as stream
    kv_placement: str
    batch_seqs: int  # decode batch the plan is predicted for
    micro_batch: int  # sequences per decode-attention micro-batch
    expert_slots: int  # device ring slots that stream the non-resident experts
    resident_experts: int  # experts held on the device for the whole run
    device_kv_bytes: int  # budget left to KV blocks (device placement), else 0
    predicted: StepCost | None = None  # a decode step of batch_seqs at the workload's context
    staging_bytes: int = 0  # stream/split: the device staging buffer (two halves), inside the budget
    host_share: float = 0.0  # split: share of each decode micro-batch's sequences attended on the host

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


def gemm_time(hw: Hardware, efficiency: tuple[tuple[float, float], ...], nbytes: float, flops: float,
              rows: float) -> float:
    """A GEMM module reading `nbytes` of weights for `flops` over `rows` rows: by its efficiency
    curve where `hw` has one (the simulator's rule, engines/sim/cost.py `gemm_s`), else weights at
    weight_bytes_per_s and FLOPs at the measured rate for its rows."""
    if efficiency:
        return gemm_s(nbytes, flops, hw.device_bytes_per_s, hw.device_flops_per_s,
                      _log_interpolate(efficiency, max(1.0, rows), 1.0))
    w_bw = min(hw.device_bytes_per_s, hw.weight_bytes_per_s or hw.device_bytes_per_s)
    return roof(nbytes, flops, w_bw, hw.matmul_flops(rows))


def attention_s(shape: ModelShape, hw: Hardware, on_host: bool, decode_keys: float, prefill_tokens: float = 0,
                prefill_keys: float = 0) -> float:
    """One layer's attention on the host or the device: decode queries over `decode_keys` keys
    in all (at the measured decode-attention rate, else KV_READS x their bytes at the
    bandwidth), prefill queries writing `prefill_tokens` keys and attending `prefill_keys`
    key-query pairs (at the measured causal-attention FLOP rate, else the processor's)."""
    kv_layer = shape.kv_bytes_per_token // shape.layers
    per_key = 4 * shape.heads * shape.head_dim  # FLOPs per attended key (scores and values)
    bw, rate = (hw.host_bytes_per_s, hw.host_flops_per_s) if on_host else (hw.device_bytes_per_s, hw.device_flops_per_s)
    measured = hw.host_attention_bytes_per_s if on_host else hw.attention_bytes_per_s
    causal = hw.host_prefill_attention_flops_per_s if on_host else hw.prefill_attention_flops_per_s
    if measured is None and causal is None:
        return roof(KV_READS * decode_keys * kv_layer + prefill_tokens * kv_layer,
                    per_key * (decode_keys + prefill_keys), bw, rate)
    prefill = roof(prefill_tokens * kv_layer, per_key * prefill_keys, bw, causal or rate) if prefill_tokens else 0.0
    decode = decode_keys * kv_layer / measured if measured else roof(KV_READS * decode_keys * kv_layer,
                                                                      per_key * decode_keys, bw, rate)
    return decode + prefill


def step_cost(shape: ModelShape, hw: Hardware, plan: BatchPlan, decode_seqs: int, prefill_tokens: int,
              decode_context: int, prefill_context: int, prefill_chunks: int = 0,
              active_experts: float | None = None, copied_experts: float | None = None) -> StepCost:
    """One step: `decode_seqs` decode tokens attending `decode_context` keys in all (summed over
    sequences), `prefill_tokens` prompt tokens in `prefill_chunks` chunks attending
    `prefill_context` key-query pairs in all (causal), through every layer and the LM head.
    `active_experts` / `copied_experts`: the experts that ran / crossed the link per MoE layer
    (mean over the layers) when known (a simulated step's routing and ring decisions); None:
    predicted (every expert runs once T x top_k covers them; the streamed ones cross)."""
    s, T = shape, decode_seqs + prefill_tokens
    if T == 0:
        return StepCost(0.0, 0.0, 0.0, 0.0, 0)
    dev_bw = hw.device_bytes_per_s
    e = s.dtype_bytes
    kv_layer = s.kv_bytes_per_token // s.layers
    # Every dense weight of a layer is one multiply-add per token (projections, router, shared experts,
    # dense MLPs), as the simulator's flat model counts them (engines/sim/cost.py); counting the
    # attention projections alone left DeepSeek-V3's dense MLP and shared expert out of prefill.
    proj_flops = 2 * T * s.layer_dense_bytes / e
    decode_parts = max(1, math.ceil(decode_seqs / max(1, plan.micro_batch)))
    # Attention micro-batches: the decode runs, then the prefill chunks, each its own where
    # their KV is staged per chunk (stream, split), else all together.
    micro = decode_parts + (prefill_chunks if plan.kv_placement in STREAMED else min(1, prefill_chunks))
    # Projections run per attention micro-batch; each expert over its share of the assignments.
    dense_t = gemm_time(hw, hw.dense_efficiency, s.layer_dense_bytes, proj_flops, T / micro)
    link = hw.link_bytes_per_s or dev_bw
    streamed_kv = plan.kv_placement in STREAMED
    kv_h2d = 0.0  # stream/split: KV bytes staged per layer
    host_gather = kv_link = first_copy = 0.0
    staged_ops = 0
    if streamed_kv:
        share = plan.host_share if plan.kv_placement == "split" else 0.0
        host_att = attention_s(s, hw, True, share * decode_context) if share > 0 else 0.0
        dev_att = attention_s(s, hw, False, (1 - share) * decode_context, prefill_tokens, prefill_context)
        kv_h2d = (1 - share) * decode_context * kv_layer
        kv_link = kv_h2d / link
        host_gather = 2 * kv_h2d / hw.host_bytes_per_s  # the host's gather into its staging copy
        first_copy = kv_link / decode_parts  # the step's first micro-batch: nothing to hide under
        # Double buffering: micro-batch j+1's copy runs while j attends.
        dev_part = max(dev_att, kv_link)
        att_phase = host_att + dev_part if hw.shared_processor else max(host_att, dev_part)
        host_rows = share * decode_seqs
        act_h2d = host_rows * s.q_size * e
        # Host rows' q/k/v down and output up are waited for; the device rows' new K/V go down
        # beside the step (written into the host pool at its end).
        act_wait = host_rows * (2 * s.q_size + 2 * s.kv_size) * e
        act_d2h = host_rows * (s.q_size + 2 * s.kv_size) * e + (T - host_rows) * 2 * s.kv_size * e
        staged_ops = OPS_PER_STAGED_PART * decode_parts
        if plan.kv_placement == "split":
            staged_ops += 2 * decode_parts  # each decode micro-batch is two attention calls
    elif plan.kv_placement == "host":
        att_t = attention_s(s, hw, True, decode_context, prefill_tokens, prefill_context)
        act_h2d = T * s.q_size * e  # attention output back to the device; q/k/v went d2h
        act_d2h = T * (s.q_size + 2 * s.kv_size) * e
        act_wait = act_h2d + act_d2h  # the layer waits for its attention's round trip
    else:
        att_t = attention_s(s, hw, False, decode_context, prefill_tokens, prefill_context)
        act_h2d = act_d2h = act_wait = 0
    active = min(s.experts, T * s.top_k) if active_experts is None else max(active_experts, 1e-9)
    # Per layer: activations through the elementwise kernels (every token; each expert assignment).
    ew = hw.elementwise_rate(T)
    per_s = 1 / ew if ew else 0.0
    per_token = ACT_PER_TOKEN_HIDDEN * s.hidden + ACT_PER_TOKEN_QKV * (s.q_size + s.kv_size) + s.q_size
    per_assignment = ACT_PER_ASSIGNMENT_HIDDEN * s.hidden + ACT_PER_ASSIGNMENT_INTERMEDIATE * s.intermediate
    act_t = T * per_token * e * per_s
    expert_act_t = T * s.top_k * per_assignment * e * per_s
    expert_t = gemm_time(hw, hw.expert_efficiency, active * s.expert_bytes, T * s.top_k * s.expert_flops_per_token,
                         T * s.top_k / active) + expert_act_t
    streamed = s.total_experts - plan.resident_experts
    per_layer_streamed = streamed / s.moe_layers if s.moe_layers else 0
    copied = min(per_layer_streamed, active) if copied_experts is None else copied_experts
    expert_link = copied * s.expert_bytes / link
    act_link = (act_h2d + act_d2h) / link
    per_layer_ops = OPS_PER_LAYER.get(s.attention, OPS_PER_LAYER["gqa"])
    overhead = (hw.op_overhead_s * (per_layer_ops + 2 * micro + staged_ops + OPS_PER_EXPERT * active) + act_t
                + hw.decode_sequence_overhead_s * decode_seqs)
    layer_total = 0.0
    compute = host = link_busy = 0.0
    for layer in range(s.layers):
        moe = layer < s.moe_layers  # MoE layers first: only counts matter here
        lk = (expert_link if moe else 0.0) + act_link + kv_link
        # The ring overlaps a share of the next layer's copies with this layer's compute.
        hidden = min(1.0, plan.expert_slots / per_layer_streamed) if per_layer_streamed else 1.0
        serial = (1 - hidden) * (expert_link if moe else 0.0) + act_wait / link
        # On one processor (a CPU run) every copy is also a memcpy on its cores (read + write
        # at the measured bandwidth), done by the link thread beside compute: it adds up.
        memcpy = 2 * lk * link / dev_bw if hw.shared_processor else 0.0
        if streamed_kv:
            c = dense_t + overhead + (expert_t if moe else 0.0) + host_gather + dev_att + memcpy
            h = host_att
            busy = dense_t + overhead + (expert_t if moe else 0.0) + host_gather + att_phase + memcpy
        else:
            c = (dense_t + overhead + (expert_t if moe else 0.0)
                 + (att_t if plan.kv_placement == "device" else 0.0) + memcpy)
            h = att_t if plan.kv_placement == "host" else 0.0
            # Host attention is synchronous in this executor (the layer waits for it), so host and
            # device work add up; the copies of the next layer's experts run beside both.
            busy = c + h
        layer_total += max(busy, lk - serial) + serial
        compute, host, link_busy = compute + c, host + h, link_busy + lk
    head_rows = decode_seqs + prefill_chunks
    head = gemm_time(hw, hw.head_efficiency, s.head_bytes, 2 * head_rows * s.hidden * s.vocab, head_rows)
    if hw.sample_bytes_per_s:  # the sampled rows' logits, read by the argmax
        head += head_rows * s.vocab * e / hw.sample_bytes_per_s
    h2d = int(s.moe_layers * copied * s.expert_bytes) + int(s.layers * (act_h2d + kv_h2d))
    return StepCost(compute + head, host, link_busy, layer_total + head + first_copy, h2d)


def decode_cost(shape: ModelShape, hw: Hardware, plan: BatchPlan, seqs: int, context: int) -> StepCost:
    return step_cost(shape, hw, plan, seqs, 0, seqs * context, 0)


def choose_plan(shape: ModelShape, hw: Hardware, budget: int, work: Workload, kv_block_bytes: int,
                host_scratch_bytes: int = 256 << 20, placements: tuple[str, ...] = PLACEMENTS,
                max_seq_blocks: int = 0, host_share: float | None = None) -> BatchPlan:
    """The plan with the highest predicted decode tokens/s within `budget` (see module doc);
    ties go to fewer bytes over the link, then to fewer ring slots."""
    plans = candidate_plans(shape, hw, budget, work, kv_block_bytes, host_scratch_bytes, placements,
                            max_seq_blocks, host_share)
    return max(plans, key=lambda p: (round(p.tokens_per_s, 6), -p.predicted.h2d_bytes, -p.expert_slots))


def staging_bytes(shape: ModelShape, kv_block_bytes: int, micro: int, context: int, max_seq_blocks: int = 0) -> int:
    """stream/split's device staging buffer: two halves, each one layer's KV blocks of `micro`
    sequences of `context` tokens, and at least `max_seq_blocks` (one sequence of the longest
    length, which cannot be cut)."""
    block_tokens = max(1, kv_block_bytes // max(1, shape.kv_bytes_per_token))
    half = max(micro * math.ceil(max(1, context) / block_tokens), max_seq_blocks, 1)
    return 2 * half * (kv_block_bytes // shape.layers)


def balanced_host_share(shape: ModelShape, hw: Hardware, context: int) -> float:
    """split's host share where host attention of a share of the sequences takes as long as
    streaming the others' KV over the link (per sequence, so independent of the batch)."""
    kv = max(1, context) * (shape.kv_bytes_per_token // shape.layers)
    host = attention_s(shape, hw, True, max(1, context))
    wire = kv / (hw.link_bytes_per_s or hw.device_bytes_per_s)
    return wire / (host + wire)


def candidate_plans(shape: ModelShape, hw: Hardware, budget: int, work: Workload, kv_block_bytes: int,
                    host_scratch_bytes: int = 256 << 20, placements: tuple[str, ...] = PLACEMENTS,
                    max_seq_blocks: int = 0, host_share: float | None = None) -> list[BatchPlan]:
    """Every plan choose_plan weighs, each with its predicted decode step. `max_seq_blocks`: the
    fewest blocks a staging half may hold (stream, split); `host_share`: split's share, fixed
    (None: the balance of host and link time and a few shares around it)."""
    free = budget - shape.dense_bytes
    if free < shape.expert_bytes:
        raise ValueError(f"budget {budget} holds no expert slot beside the dense weights ({shape.dense_bytes})")
    per_seq_kv = max(1, work.context) * shape.kv_bytes_per_token
    kv_layer = max(1, shape.kv_bytes_per_token // shape.layers)
    candidates: list[BatchPlan] = []
    slot_options = sorted({1, max(1, shape.experts // 2), shape.experts, 2 * shape.experts})
    for placement in placements:
        if placement in STREAMED:
            candidates += _streamed_plans(shape, hw, free, work, kv_block_bytes, placement, slot_options,
                                          max_seq_blocks, host_share)
            continue
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
                plan = BatchPlan(placement, seqs, micro, slots_used, resident,
                                 max(0, kv_bytes) if placement == "device" else 0)
                candidates.append(replace(plan, predicted=decode_cost(shape, hw, plan, seqs, work.context)))
    if not candidates:
        if all(p in STREAMED for p in placements):
            least = staging_bytes(shape, kv_block_bytes, 1 if "stream" in placements else 2, work.context,
                                  max_seq_blocks)
            raise ValueError(f"no plan fits budget {budget}: the KV staging buffer of the smallest micro-batch "
                             f"({least} bytes{'; split needs 2 sequences' if 'stream' not in placements else ''}) "
                             f"and one expert slot do not fit beside the dense weights ({shape.dense_bytes})")
        raise ValueError(f"no plan fits budget {budget}: KV for one sequence of {work.context} tokens "
                         f"({per_seq_kv} bytes) does not fit beside the weights")
    return candidates


def _streamed_plans(shape: ModelShape, hw: Hardware, free: int, work: Workload, kv_block_bytes: int, placement: str,
                    slot_options: list[int], max_seq_blocks: int, host_share: float | None) -> list[BatchPlan]:
    """stream/split plans: per micro-batch size (it sizes the staging buffer) and ring size,
    everything the staging buffer and the ring leave goes to resident experts."""
    seqs = work.seqs
    if placement == "stream":
        shares = [0.0]
    elif host_share is not None:
        shares = [host_share]
    else:
        balance = balanced_host_share(shape, hw, work.context)
        shares = sorted({round(balance, 4), 0.25, 0.5, 0.75})
    out = []
    for micro in sorted({m for m in (1, 2, 8, 32, 128, 512) if m < seqs} | {seqs}):
        staged = staging_bytes(shape, kv_block_bytes, micro, work.context, max_seq_blocks)
        for slots in slot_options:
            left = free - staged - slots * shape.expert_bytes
            if left < 0:
                continue
            resident = min(shape.total_experts, left // shape.expert_bytes)
            slots_used = 0 if resident == shape.total_experts else slots
            for share in shares:
                if host_share is None and placement == "split":
                    share = round(share * micro) / micro  # the executor splits whole sequences
                    if share in (0.0, 1.0):
                        continue  # that is stream or host
                plan = BatchPlan(placement, seqs, micro, slots_used, resident, 0, staging_bytes=staged,
                                 host_share=share)
                out.append(replace(plan, predicted=decode_cost(shape, hw, plan, seqs, work.context)))
    return out

"""moegen under `--simulate`: the plan's hardware from a hardware profile, and a simulated
layer-major executor.

`sim_hardware` turns the run's HardwareProfile (engines/sim/hardware.py) into the cost
model's `Hardware`, so the real plan (`make_plan`: placement, ring, residents, micro-batch)
is chosen for the simulated machine. `MoEGenSimExecutor` runs a step's control path as
`LayerMajorExecutor.forward` does, without compute: expert choices from the routing source;
per layer, the next MoE layer queued ahead on the streaming backend when T x top_k >= E (as
the measured executor decides), the attention micro-batches' copies (host: q/k/v down and the
output up per micro-batch; stream/split: each part's held KV blocks up and the new K/V down,
parts cut to the staging half exactly as `StreamAttention.begin` cuts them), then the
backend's ring decisions (`StreamingBackend.simulate`). Copies go to the TransferLedger with
the same sizes, transfer counts and tags as the measured run's CopyEngine records.

Pricing: moegen's own cost model (`step_cost`) for the step actually scheduled (its decode
rows, prefill chunks and contexts) with the experts that ran and crossed per layer taken from
the simulated routing and ring, plus the profile's per-step overhead. Why not the simulator's
flat CostModel: it has no micro-batches, no host attention (host placement's attention runs
on the host at host memory bandwidth, not at HBM's), and no per-layer ring overlap; this
model is the one the plan was chosen by, and prices exactly the executor's structure. Its
module rates come from the profile (which efficiency curves: `sim_hardware`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch

from engines.base import EngineError
from engines.common.device import dtype_name
from engines.moegen.cost import STREAMED, BatchPlan, Hardware, step_cost
from engines.moegen.executor import decode_cuts
from engines.moegen.streaming import StreamingBackend
from engines.runtime.batch import StepBatch
from engines.runtime.executor import StepResult
from engines.runtime.experts import Dispatch, ExpertBackend
from engines.runtime.kv_cache import PagedKVCache
from engines.runtime.model import MoEModel
from engines.runtime.shape import ModelShape
from engines.runtime.transfer import TransferLedger
from engines.sim.cost import (
    StepCost,
    module_curves,
    prefill_attention_pairs,
    prefill_overhead_rates,
    prefill_overhead_s,
)
from engines.sim.executor import SimExecutor
from engines.sim.routing import routing_source

# 2: GEMMs by the module curves engines/sim/cost.py picks; 3: the prefill overheads, and dense FLOPs from
# every dense parameter (were the attention projections'); 4: on a shared processor host prefill attention
# at the device's attention_prefill curve (was the host's peak FLOP/s: 2-3x fast on the cpu profile)
VERSION = "moegen-4"
_NO_ROWS = torch.empty(0, dtype=torch.long)
_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _curve(profile: Any, key: str) -> Any:
    return profile.efficiency.get(key)


def sim_hardware(profile: Any, dtype: str, shape: ModelShape, shared_processor: bool, context: int = 1024,
                 chunk: int = 512) -> Hardware:
    """The cost model's Hardware for a simulated machine. Peaks: memory_bytes_per_s,
    flops_per_s[dtype], host_memory_bytes_per_s, host_flops_per_s, link_pinned_bytes_per_s,
    op_overhead_s. GEMMs: the curves engines/sim/cost.py `module_curves` picks for `shape` (the
    model's own `gemm@K` / `grouped_gemm@K` / `head@K` where the profile has them, else "gemm" /
    "grouped_gemm" / "gemm") price the projections, the experts and the LM head as that model does
    (roofline bound over the curve at the GEMM's rows); `flops_at_rows` and `weight_bytes_per_s`
    (the generic "gemm") stay for what has no curve. "copy" at the size of one expert transfer
    (half an expert: gate_up and down cross apart) on the link, "attention_decode" at `context`
    tokens and "attention_prefill" (shaped where measured) at `chunk` tokens (the executor re-reads
    both per step at the step's own sizes), "elementwise" and "sample" when the profile has them.
    Host attention: no curve (host memory bandwidth and FLOP/s as given), except prefill attention on
    a shared processor, where the host is the device: the device's attention_prefill curve."""
    if dtype not in profile.flops_per_s:
        raise EngineError(f"hardware profile {profile.name!r} has no FLOP rate for dtype {dtype!r} "
                          f"(flops_per_s has {sorted(profile.flops_per_s)}); add it or pick one of those")
    bw, peak = float(profile.memory_bytes_per_s), float(profile.flops_per_s[dtype])

    def eff(key: str, size: float) -> float:
        c = _curve(profile, key)
        return c.at(size) if c is not None else 1.0

    ew = _curve(profile, "elementwise")
    sample = _curve(profile, "sample")
    chosen, _ = module_curves(profile.efficiency, shape)

    def points(module: str) -> tuple[tuple[float, float], ...]:
        c = chosen.get(module)
        return tuple((float(x), float(y)) for x, y in c.points) if c is not None else ()

    prefill = chosen.get("attention_prefill")
    prefill_rate = peak * (prefill.at(max(1, chunk)) if prefill is not None else 1.0)
    return Hardware(
        device_bytes_per_s=bw, device_flops_per_s=peak,
        host_bytes_per_s=float(profile.host_memory_bytes_per_s), host_flops_per_s=float(profile.host_flops_per_s),
        link_bytes_per_s=float(profile.link_pinned_bytes_per_s) * eff("copy", max(1, shape.expert_bytes // 2)),
        weight_bytes_per_s=bw * eff("gemm", 1), op_overhead_s=float(getattr(profile, "op_overhead_s", 0.0) or 0.0),
        decode_sequence_overhead_s=float(getattr(profile, "decode_sequence_overhead_s", 0.0) or 0.0),
        source=f"simulated: hardware profile {profile.name}", shared_processor=shared_processor,
        flops_at_rows=tuple((r, peak * eff("gemm", r)) for r in _ROWS),
        sample_bytes_per_s=bw * sample.at(256) if sample is not None else None,
        elementwise_bytes_per_s=bw * ew.at(256) if ew is not None else None,
        elementwise_at_tokens=tuple((t, bw * ew.at(t)) for t in _ROWS) if ew is not None else (),
        attention_bytes_per_s=bw * eff("attention_decode", max(1, context)),
        host_attention_bytes_per_s=float(profile.host_memory_bytes_per_s),
        prefill_attention_flops_per_s=prefill_rate,
        host_prefill_attention_flops_per_s=prefill_rate if shared_processor else float(profile.host_flops_per_s),
        dense_efficiency=points("gemm"), expert_efficiency=points("grouped_gemm"), head_efficiency=points("head"),
    )


def host_kv_gb(profile: Any, shape: ModelShape, utilization: float) -> float:
    """A simulated run's host-tier KV pool when host_kv_gb is not given: the profile's host
    memory less the routed experts the host tier holds, x gpu_memory_utilization."""
    free = profile.host_memory_bytes - shape.total_experts * shape.expert_bytes
    if free <= 0:
        raise EngineError(f"hardware profile {profile.name}: host memory ({profile.host_memory_bytes / 1e9:.0f} GB) "
                          "cannot hold the routed experts' host tier; set host_memory_bytes in a profile TOML")
    return free * utilization / (1 << 30)


class _Pricing:
    """What a result folder records about how a simulated moegen step is priced."""

    def __init__(self, hw: Hardware, profile: Any, plan: BatchPlan,
                 rates: tuple[float, float, float, str]) -> None:
        self.hw, self.profile, self.plan, self.rates = hw, profile, plan, rates

    def assumptions(self) -> dict[str, Any]:
        return {"cost_model": "engines/moegen/cost.py step_cost (moegen's own model of its layer-major step)",
                "version": VERSION, "profile": self.profile.name,
                "hardware": dataclasses.asdict(self.hw),
                "step_overhead_s": float(self.profile.step_overhead_s),
                "prefill_overhead": "layers x (per element x prefill tokens x hidden + per segment x prefill "
                                    "segments + per step), as engines/sim/cost.py adds it: " + ", ".join(
                                        f"{v:.3g} s" for v in self.rates[:3]) + f" ({self.rates[3]})",
                "curves_applied": "projections, experts, LM head: the curves engines/sim/cost.py module_curves "
                                  "picks (gemm@K, grouped_gemm@K, head@K where measured for this model, else "
                                  "gemm, grouped_gemm, gemm), roofline bound / curve(rows); copy (at one expert "
                                  "transfer), attention_decode (step's mean context), attention_prefill (step's "
                                  "mean chunk; @K where measured), elementwise, sample; host attention at host "
                                  "memory bandwidth (no curve); dequant curves not used",
                "plan": {k: v for k, v in dataclasses.asdict(self.plan).items() if k != "predicted"}}


class MoEGenSimExecutor(SimExecutor):
    def __init__(self, simulation: Any, cfg: Any, model: MoEModel, kv: PagedKVCache, ledger: TransferLedger,
                 experts: ExpertBackend, dense_bytes_read: int, plan: BatchPlan, shape: ModelShape,
                 hw: Hardware) -> None:
        mc = model.config
        try:
            routing = routing_source(cfg.routing, mc.architecture, mc.num_experts, cfg.seed,
                                     num_layers=mc.num_layers, top_k=mc.top_k)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        super().__init__(model, ledger, experts, routing, None, simulation.clock, dense_bytes_read, True,  # type: ignore[arg-type]
                         simulation.control_time)
        self.simulation, self.plan, self.shape, self.hw, self.kv = simulation, plan, shape, hw, kv
        self.profile = simulation.profile
        self.curves, _ = module_curves(self.profile.efficiency, shape)  # shaped where measured, as hw's
        simulation.routing, simulation.dtype = routing, dtype_name(model.weights.embed.dtype)
        self.prefill_rates = prefill_overhead_rates(self.profile, shape)  # fixed for the model: looked up once
        simulation.cost, simulation.executor = _Pricing(hw, self.profile, plan, self.prefill_rates), self
        simulation.notes.append(f"moegen's steps are priced by its own cost model (engines/moegen/cost.py, "
                                f"{VERSION}), not engines/sim/cost.py: cost_model_version names the latter")
        k0, v0 = kv.k[0], kv.v[0]  # [K, blocks, B, dim]
        self.K, _, self.B, self.kdim = k0.shape
        self.vdim = v0.shape[-1]
        self.elt = k0.element_size()
        H = mc.num_heads
        mla = getattr(mc, "mla", None) is not None
        self.q_el = H * (self.kdim + self.vdim) if mla else H * self.kdim
        self.o_el = H * self.kdim if mla else H * self.vdim
        self.qkv_bytes = (self.q_el + self.K * (self.kdim + self.vdim)) * self.elt  # per token
        self.new_kv_bytes = self.K * (self.kdim + self.vdim) * self.elt  # per token
        self.block_kv_bytes = self.B * self.new_kv_bytes  # one layer's block of K and V
        self.half = plan.staging_bytes // (2 * (kv.block_bytes // mc.num_layers)) if plan.kv_placement in STREAMED \
            else 0
        if plan.kv_placement in STREAMED and self.half < 1:
            raise ValueError(f"a staging half needs at least one block, got {self.half}")
        self.sinks = {i: w.attn.sinks for i, w in enumerate(model.weights.layers)
                      if getattr(w.attn, "sinks", None) is not None}
        self._sinks_sent: set[int] = set()

    def device_kv_bytes(self) -> int:
        """The staging buffer StreamAttention allocates (stream, split), else 0."""
        return 2 * self.half * self.block_kv_bytes if self.plan.kv_placement in STREAMED else 0

    # -- attention copies ---------------------------------------------------------------------------
    def _parts(self, batch: StepBatch) -> list[tuple[int, int, int]]:
        """The step's attention parts as (host rows, device rows, KV blocks copied up), per layer."""
        plan, micro, B = self.plan, self.plan.micro_batch, self.B
        nd = batch.num_decode
        prefills = [(c.start, c.length) for c in batch.chunks[nd:]]
        if plan.kv_placement == "device":
            return []
        if plan.kv_placement == "host":  # split_attention: decode runs, then every prefill chunk together
            parts = [(min(lo + micro, nd) - lo, 0, 0) for lo in range(0, nd, micro)]
            if prefills:
                parts.append((sum(n for _, n in prefills), 0, 0))
            return parts
        ctxs = [c.start + 1 for c in batch.chunks[:nd]]
        share = plan.host_share if plan.kv_placement == "split" else 0.0
        cap = self.half
        parts = [(h, hi - lo - h, sum(-(-(c - 1) // B) for c in ctxs[lo + h:hi]))
                 for lo, hi, h in decode_cuts(ctxs, micro, share, B, cap)]
        for s, n in prefills:
            if -(-(s + n) // B) > cap:
                raise ValueError(f"a prefill chunk reaching {s + n} tokens needs {-(-(s + n) // B)} staging blocks; "
                                 f"a staging half holds {cap}")
            parts.append((0, n, -(-s // B)))
        return parts

    def _attention_copies(self, layer: int, parts: list[tuple[int, int, int]]) -> None:
        """What HostAttention / StreamAttention give the CopyEngine for one layer's parts."""
        record = self.ledger.record
        for host_rows, dev_rows, blocks in parts:
            if host_rows:
                record("d2h", host_rows * self.qkv_bytes, "activations", transfers=3)
                if layer in self.sinks and layer not in self._sinks_sent and self.ledger.crosses_bus:
                    s = self.sinks[layer]
                    record("d2h", s.numel() * s.element_size(), "weights")  # once per layer (HostAttention)
                    self._sinks_sent.add(layer)
                record("h2d", host_rows * self.o_el * self.elt, "activations")
            if dev_rows:
                if blocks:
                    record("h2d", blocks * self.block_kv_bytes, "kv", transfers=2)
                record("d2h", dev_rows * self.new_kv_bytes, "kv", transfers=2)

    # -- the step -------------------------------------------------------------------------------------
    def execute(self, batch: StepBatch) -> StepResult:
        self.begin()
        cfg = self.model.config
        matrix = self.route_matrix(batch)
        counts = dict(zip(self.moe_layers, matrix.tolist()))
        experts = self.experts
        parts = self._parts(batch)
        copied_before = self._copied_bytes()
        moe_layers = experts.layers()
        # A backend that prefetches nothing has no per-layer order to keep with the ring's
        # copies: its whole step at once where it can (engine full's pagedweight backend).
        held = self._simulate_step(matrix) if type(experts).prefetch is ExpertBackend.prefetch else None
        simulate = self.timed_simulate if self.control_time else experts.simulate  # its decisions: control time
        ahead = held is None and batch.token_ids.shape[0] * cfg.top_k >= cfg.num_experts  # as LayerMajorExecutor
        if ahead and moe_layers:
            experts.prefetch(moe_layers[0])
        runs = Counter() if held is None else Counter(held[matrix > 0].tolist())  # layer by layer, expert order
        for i in range(cfg.num_layers):
            nxt = next((j for j in moe_layers if j > i), None) if ahead else None
            if nxt is not None:
                experts.prefetch(nxt)
            self._attention_copies(i, parts)
            if held is None and i in counts:
                simulate(i, Dispatch(_NO_ROWS, _NO_ROWS, counts[i]))
                runs.update(experts.expert_bytes(i, e) for e, n in enumerate(counts[i]) if n)
        return self.finish(batch, self._price(batch, counts, runs, self._copied_bytes() - copied_before), counts)

    def _copied_bytes(self) -> int:
        """Expert bytes the backend has copied host->device so far in this step (the ring's
        streamed experts); a technique with another backend overrides it (engine full)."""
        return self.experts._stats["streamed_bytes"] if isinstance(self.experts, StreamingBackend) else 0

    def _priced(self, runs: Counter, copied: int) -> tuple[ModelShape, BatchPlan]:
        """The shape and plan a step is priced with (moegen: the run's; engine full overrides it
        with the widths and residents of the step)."""
        return self.shape, self.plan

    def _price(self, batch: StepBatch, counts: dict[int, list[int]], runs: Counter, copied_bytes: int) -> StepCost:
        """moegen's step_cost for this step's batch, experts that ran and experts copied
        (`copied_bytes` in the step); the roofline as engines/sim/cost.py counts it (dense +
        experts that ran + KV attended)."""
        nd = batch.num_decode
        decodes, prefills = batch.chunks[:nd], batch.chunks[nd:]
        decode_context = sum(c.start + 1 for c in decodes)
        prefill_tokens = sum(c.length for c in prefills)
        # key-query pairs at the causal rate: a chunk after context computes its whole masked rectangle
        # (engines/sim/cost.py `prefill_attention_pairs`), at attention_prefill_context's rate
        after = 1.0  # (looked up only for a step with a chunk after context)
        if any(c.start for c in prefills):
            chunk = prefill_tokens / len(prefills)
            after = self._eff("attention_prefill", chunk) / self._eff("attention_prefill_context", chunk)
        prefill_context = sum(prefill_attention_pairs(c.length, c.start) * after if c.start
                              else c.length * (c.length + 1) // 2 for c in prefills)
        n_moe = max(1, len(counts))
        active = sum(n > 0 for layer in counts.values() for n in layer) / n_moe
        shape, plan = self._priced(runs, copied_bytes)
        copied = copied_bytes / max(1, shape.expert_bytes) / n_moe
        prefill_rate = self.hw.device_flops_per_s * self._eff("attention_prefill", prefill_tokens / len(prefills)) \
            if prefills else self.hw.prefill_attention_flops_per_s
        hw = dataclasses.replace(
            self.hw,
            attention_bytes_per_s=self.hw.device_bytes_per_s * self._eff("attention_decode", decode_context / nd)
            if nd else self.hw.attention_bytes_per_s,
            prefill_attention_flops_per_s=prefill_rate,
            # on a shared processor the host is the device: its prefill attention runs at the same rate
            host_prefill_attention_flops_per_s=prefill_rate if self.hw.shared_processor
            else self.hw.host_prefill_attention_flops_per_s)
        c = step_cost(shape, hw, plan, nd, prefill_tokens, decode_context, prefill_context, len(prefills),
                      active_experts=active, copied_experts=copied)
        overhead = float(self.profile.step_overhead_s) + prefill_overhead_s(
            self.profile, self.shape, prefill_tokens, sum(1 for c in prefills if c.length), self.prefill_rates)
        kvb = self.kv_bytes_per_token
        read = (self.dense_bytes_read + sum(nbytes * n for nbytes, n in runs.items())
                + decode_context * kvb + sum(ch.start for ch in prefills) * kvb)
        parts = {"compute": c.compute_s, "host_attention": c.host_s, "link_busy": c.link_s,
                 "layers_and_head": c.total_s, "overhead": overhead}
        return StepCost(c.total_s + overhead, parts, read / self.hw.device_bytes_per_s)

    def _eff(self, key: str, size: float) -> float:
        curve = self.curves.get(key)
        return curve.at(max(1.0, size)) if curve is not None else 1.0

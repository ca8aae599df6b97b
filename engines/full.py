"""Engine `full`, the default: PagedWeight's quality-aware expert widths under MoE-Gen's
module-based batching, a recipe of both techniques' parts. The plan (KV placement, micro-batch,
ring) is moegen's, made for experts at their quality floors; the pages, arbiter and feedback are
pagedweight's, in what the plan leaves. By default (`floor_bits` 0) an expert the budget cannot
hold leaves the device and is fetched at its quality floor when routed. A gpt-oss MXFP4 folder
is served from its own format, as pagedweight serves it (engines/pagedweight/engine.py).
Design: docs/full.md.

Under --simulate (docs/simulation.md): the plan is made for the hardware profile (moegen's
`machine`), pagedweight's stores, sensitivities and arbiter run on meta tensors as in its own
simulated run (quality feedback off, importance from token shares), and the step runs through
moegen's simulated layer-major executor (`FullSimExecutor`), priced by moegen's cost model with
the widths the step ran at, the experts fetched on demand and the page moves of the step.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from engines.base import EngineError
from engines.common.device import resolve_device, resolve_dtype
from engines.moegen.cost import BatchPlan, Hardware
from engines.moegen.engine import PlanPredictor, layer_major, machine, plan_stats
from engines.moegen.plan import MoEGenConfig, held_plan, loaded_shape, make_plan, placement_claims
from engines.pagedweight.backend import PagedWeightBackend
from engines.pagedweight.controller import PageBudget, PagedController
from engines.pagedweight.engine import (
    PagedWeightConfig,
    bits_text,
    paged_claims,
    paged_experts,
    paged_load,
    paged_stats,
    simulated_config,
    simulated_notes,
)
from engines.runtime.budget import DeviceBudget
from engines.runtime.checkpoint import open_checkpoint
from engines.runtime.engine import EngineParts, KVPool, Loaded, RuntimeEngine
from engines.runtime.executor import Executor
from engines.runtime.kv_cache import PagedKVCache
from engines.runtime.memory import KVSizing, kv_cache_blocks
from engines.runtime.model import MoEModel
from engines.runtime.shape import ModelShape, model_shape
from engines.runtime.transfer import TransferLedger

PAGES = "h2d:expert_pages"  # the ledger's total of page moves and on-demand fetches (CopyEngine tag)


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


def pricing_plan(plan: BatchPlan, backend: PagedWeightBackend) -> BatchPlan:
    """The plan as the step runs it: the experts on the device now (held, or a move in flight
    making them) are its residents; the rest go through the fetch slots (held_plan's rule)."""
    on = set(backend.held) | {m.key for m in backend.pending if m.to_bits}
    resident = sum(k in on for k in backend.stores)
    return dataclasses.replace(plan, resident_experts=resident,
                               expert_slots=backend.fetch_slots if resident < len(backend.stores) else 0)


@cache
def _sim_executor_class() -> type:
    """FullSimExecutor, defined on first use: it subclasses moegen's simulated executor, which
    imports engines.sim (simulated runs only, as moegen defers it)."""
    from engines.moegen.simulate import MoEGenSimExecutor  # noqa: PLC0415  (simulated runs only: engines.sim)
    from engines.sim.cost import CostModel, ExpertRun  # noqa: PLC0415

    class FullSimExecutor(MoEGenSimExecutor):
        """moegen's simulated layer-major step (attention copies as the plan places the KV; the
        backend's control path per MoE layer) over pagedweight's backend, priced by moegen's
        step_cost with: the step's own expert size (the mean bytes of the experts that ran, at
        their held width or, fetched on demand, at their fetch width); the on-demand fetches as
        the experts that crossed the link inside the layers (the fetch slots are the ring); the
        plan's residents as the experts on the device at the step; and the page moves the
        arbiter issued before the step on the link beside it (committed at the next boundary:
        the step ends no earlier than the link has carried them; on one processor, the `cpu`
        profile, their memcpy adds to the step). On the cpu profile the quantized experts run as the
        torch reference does: full-width GEMMs after dequantizing them, priced by the flat cost
        model's rule (`CostModel.cpu_dequantization`: its curves, groups and torch-call counts)."""

        def __init__(self, *args: Any, plan_now: Callable[[], BatchPlan], **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.plan_now = plan_now
            self._flat = None  # the flat cost model, for the CPU dequantization (cpu profile)
            self._seen = self.ledger.total_of(PAGES)  # the start's placement is no step's move
            self._moved = 0
            self.simulation.notes.append(
                "engine full: each simulated step is priced with the widths its experts ran at, the experts fetched "
                "on demand as the ring's copies and the arbiter's page moves on the link beside the step")

        def execute(self, batch: Any) -> Any:
            total = self.ledger.total_of(PAGES)
            self._moved = total - self._seen  # page moves issued since the last step (before_step)
            try:
                return super().execute(batch)
            finally:
                self._seen = self.ledger.total_of(PAGES)

        def _copied_bytes(self) -> int:
            return self.ledger.total_of(PAGES)  # inside a step only on-demand fetches add to it

        def _priced(self, runs: Counter, copied: int) -> tuple[ModelShape, BatchPlan]:
            if self.hw.shared_processor:  # the CPU reference runs full-width GEMMs on dequantized weights
                return self.shape, self.plan_now()
            ran = sum(runs.values())
            read = sum(nbytes * n for nbytes, n in runs.items()) + copied  # fetched experts run at fetch width
            shape = dataclasses.replace(self.shape, expert_bytes=max(1, read // ran)) if ran and read else self.shape
            return shape, self.plan_now()

        def _dequantization(self, runs: Counter) -> float:
            """On a shared processor (the cpu profile), the quantized experts' dequantization to full
            width and its torch calls, priced by the flat cost model's rule (engines/sim/cost.py)."""
            if not self.hw.shared_processor:
                return 0.0
            if self._flat is None:
                self._flat = CostModel(self.profile, self.shape, self.simulation.dtype)
            params = self.shape.expert_bytes / self.shape.dtype_bytes
            scheme = self.experts.dequant_scheme
            seconds, calls = self._flat.cpu_dequantization(tuple(
                ExpertRun(-1, 1, nbytes, 8 * nbytes / params, n, scheme) for nbytes, n in runs.items()))
            return seconds + calls * self.hw.op_overhead_s

        def _price(self, batch: Any, counts: dict[int, list[int]], runs: Counter, copied_bytes: int) -> Any:
            cost = super()._price(batch, counts, runs, copied_bytes)
            hw, parts = self.hw, dict(cost.parts)
            moves = self._moved / (hw.link_bytes_per_s or hw.device_bytes_per_s)
            memcpy = 2 * self._moved / hw.device_bytes_per_s if hw.shared_processor else 0.0
            dequant = self._dequantization(runs)
            body = max(parts["layers_and_head"] + memcpy + dequant, parts["link_busy"] + moves)
            parts.update(page_moves_link=moves, layers_and_head=body, cpu_dequant=dequant)
            return dataclasses.replace(cost, seconds=body + parts["overhead"], parts=parts)

    return FullSimExecutor


def simulated_host_kv_gb(sim: Any, cfg: FullConfig, backend: PagedWeightBackend, on_device: bool) -> float:
    """A simulated run's host-tier KV pool (host_kv_gb not given): the profile's host memory less
    what the experts' stores hold there (every width's parts, not only the 16-bit master moegen's
    `machine` subtracts), x gpu_memory_utilization; its note replaces machine()'s, and none is
    left when the plan keeps the KV on the device."""
    sim.notes[:] = [n for n in sim.notes if not n.startswith("host-tier KV pool")]
    if on_device:
        return 0.0
    stores = sum(s.host_bytes() for s in backend.stores.values())
    free = sim.profile.host_memory_bytes - stores
    if free <= 0:
        host = sim.profile.host_memory_bytes
        raise EngineError(f"hardware profile {sim.profile.name}: host memory ({host / 1e9:.0f} GB) cannot hold the "
                          f"experts' host-tier versions ({stores / 1e9:.0f} GB); set host_memory_bytes in a profile "
                          "TOML, or host_kv_gb")
    gb = free * cfg.gpu_memory_utilization / (1 << 30)
    sim.notes.append(f"host-tier KV pool {gb:.1f} GiB: {sim.profile.name}'s host memory less the experts' host-tier "
                     f"versions ({stores / 1e9:.1f} GB, every width), x gpu_memory_utilization "
                     f"{cfg.gpu_memory_utilization} (set host_kv_gb to change)")
    return gb


def simulated_executor(engine: FullEngine, cfg: FullConfig, shape: ModelShape, hw: Hardware,
                       backend: PagedWeightBackend) -> Callable[..., Executor]:
    """The executor part of a simulated run: built after the controllers started, so the plan
    is the one PlanPredictor refreshed for what the arbiter placed (`engine.plan`); each step is
    priced with that plan's residents as they are then (`pricing_plan`)."""

    def build(simulation: Any, model: MoEModel, kv: PagedKVCache, ledger: TransferLedger, experts: Any,
              dense_bytes_read: int) -> Executor:
        plan = engine.plan
        return _sim_executor_class()(simulation, cfg, model, kv, ledger, experts, dense_bytes_read, plan, shape, hw,
                                     plan_now=lambda: pricing_plan(plan, backend))

    return build


class FullEngine(RuntimeEngine):
    name = "full"
    config_cls = FullConfig
    needs_calibration = True
    simulates = True
    sim_overhead_keys = ("layer_major", "pagedweight")

    def start(self) -> None:
        # No --budget: the whole device; a simulated run's is the profile's (Simulation.configure).
        if self.config.budget_bytes is None and self.config.model is not None and not self.config.simulate:
            self.config = dataclasses.replace(self.config, budget_bytes=whole_device_budget(self.config),
                                              kv_cache_gb=None, kv_blocks=None)
        super().start()

    def load(self, cfg: FullConfig) -> Loaded:
        return paged_load(self, cfg)

    def build(self, cfg: FullConfig, loaded: Loaded) -> EngineParts:
        if cfg.expert_bits is not None:
            raise EngineError("engine full pages its own expert precisions; expert_bits is engine moe's fake "
                              "quantization (drop it, or use --engine moe)")
        cfg = simulated_config(cfg, loaded)  # --simulate: no quality feedback (it compares computed outputs)
        mc, dense = loaded.checkpoint.config, loaded.dense_bytes
        # A group size that does not divide the experts' widths is replaced (or rows padded) there, with a note.
        self.paged = paged = paged_experts(cfg, loaded, self.name)
        notes = [*paged.notes, *simulated_notes(loaded)]
        cfg = dataclasses.replace(cfg, group_size=paged.group_size, bits=bits_text(paged.bit_widths, paged.mxfp4))
        backend, block, per_expert = paged.backend, loaded.kv_block_bytes(cfg.block_size), loaded.bytes_per_expert
        shape = loaded_shape(loaded, per_expert, self.name)
        hw, host_gb = machine(self, cfg, loaded, shape)  # --simulate: the profile's machine and host memory

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
        if self.simulation is not None and cfg.host_kv_gb is None and not self.simulation.shared_processor:
            host_gb = simulated_host_kv_gb(self.simulation, cfg, backend, on_device)
        room = PageBudget(cfg.budget_bytes, dense, block, on_device, plan.staging_bytes, cfg.kv_reserve_bytes)

        def held() -> tuple:  # at start, once the arbiter placed the experts: the plan for what it holds
            new_shape, self.plan = held_plan(cfg, plan, shape, hw, [backend.expert_bytes(*k) for k in backend.stores],
                                             backend.fetch_slots)
            return new_shape, self.plan

        return EngineParts(
            backend, claims(plan.kv_placement, plan.staging_bytes),
            KVPool(on_device, dense + paged.floor_bytes(), host_gb),
            copies=backend.copies,
            executor=layer_major(plan, backend.copies),
            controllers=[PagedController(cfg, paged, room), PlanPredictor(shape, hw, plan, refresh=held)],
            stats=lambda: {**plan_stats(cfg, self.plan, per_expert), **paged_stats(paged), "plan_expert_bytes_at_floor":
                           max(store.nbytes(paged.quality[k]) for k, store in backend.stores.items())},
            notes=notes, config=cfg, sim_executor=simulated_executor(self, cfg, shape, hw, backend))

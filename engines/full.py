"""Engine `full`: PagedWeight's quality-aware expert precisions under MoE-Gen's module-based batching.

The two techniques pwbench tests, in one engine (engines/pagedweight.py + engines/moegen.py):

- **Execution** is moegen's: each step runs layer-major (engines/modbatch/executor.py),
  attention in micro-batches over every sequence in flight, then each routed expert once
  over all tokens routed to it. The KV placement and the micro-batch come from moegen's cost
  model (engines/modbatch/cost.py), planned for experts at their quality floors (the least
  the arbiter holds them at); with the KV in the host tier the batch is bounded by
  `max_num_seqs`, not by device memory.
- **Experts** are pagedweight's: every expert's master and quantized versions live in the
  host tier; the device holds each at a width the arbiter picks per step (importance x
  measured sensitivity), never below its quality floor (`max_expert_error`). One arbiter
  sees the device budget and what competes for it: with device KV, the KV demand of the
  running and waiting requests; with host KV, nothing, so every byte the dense weights
  leave goes to expert precision. By default (`floor_bits` 0) an expert the budget cannot
  hold leaves the device and is fetched at its quality floor when routed: under module-based
  batching that fetch serves every token of the step routed to it, so `full` runs budgets
  below every expert at its floor, where pagedweight refuses to start.

Without `--budget` the device budget is all weights at full precision plus the KV pool
`moe` would size (CUDA: `gpu_memory_utilization` of the free memory at start).
At a budget that holds every expert at 16 bits the output is token-identical to `moe`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engines.base import EngineError
from engines.modbatch.hardware import model_shape
from engines.modbatch.cost import STREAMED, Plan, decode_cost
from engines.moegen import MoEGenConfig, MoEGenEngine, make_plan, plan_workload, staging_minimum
from engines.pagedweight import PagedWeightConfig, PagedWeightEngine
from engines.paged.backend import PagedWeightBackend
from engines.runtime.experts import ExpertBackend
from engines.runtime.weights import DenseExperts


@dataclass(frozen=True)
class FullConfig(PagedWeightConfig, MoEGenConfig):
    max_num_batched_tokens: int = 8192  # large per-module batches (moegen's default)
    floor_bits: int = 0  # experts may leave the device; they come back at their quality floor


class FullEngine(PagedWeightEngine, MoEGenEngine):
    """pagedweight's experts (build_experts, step, feedback) on moegen's execution (plan, KV
    cache, layer-major executor, step predictions): see the module docstring."""

    name = "full"
    config_cls = FullConfig
    float32_reference = False
    needs_calibration = True

    def start(self) -> None:
        cfg: FullConfig = self.config  # type: ignore[assignment]
        if cfg.budget_bytes is None and cfg.model is not None:
            # info().config then shows the budget used
            self.config = dataclasses.replace(cfg, budget_bytes=self._whole_device_budget(), kv_cache_gb=None,
                                              kv_blocks=None)
        super().start()

    def _whole_device_budget(self) -> int:
        """No --budget: every weight at full precision plus the KV pool `moe` would size."""
        import torch  # noqa: PLC0415

        from engines.device import resolve_device, resolve_dtype  # noqa: PLC0415
        from engines.runtime.checkpoint import open_checkpoint  # noqa: PLC0415
        from engines.runtime.kv_cache import PagedKVCache  # noqa: PLC0415
        from engines.runtime.memory import KVSizing, kv_cache_blocks  # noqa: PLC0415

        cfg = self.config
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        mc = open_checkpoint(cfg.model).config
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * cfg.gpu_memory_utilization)
        shape = model_shape(mc, torch.empty((), dtype=dtype).element_size())
        weights = shape.dense_bytes + shape.total_experts * shape.expert_bytes
        block = PagedKVCache.model_block_bytes(mc, cfg.block_size, dtype)
        sizing = KVSizing(cfg.block_size, cfg.kv_cache_gb, cfg.kv_blocks, cfg.gpu_memory_utilization,
                          cfg.max_num_seqs, cfg.max_model_len or mc.max_position_embeddings)
        return weights + kv_cache_blocks(sizing, block, device) * block

    # -- loading: pagedweight's backend, then moegen's plan for it --------------------------------
    def build_experts(self, dense: dict[int, DenseExperts]) -> ExpertBackend:
        cfg: FullConfig = self.config  # type: ignore[assignment]
        if cfg.expert_bits is not None:
            raise EngineError("engine full pages its own expert precisions; expert_bits is engine moe's fake "
                              "quantization (drop it, or use --engine moe)")
        self._per_expert = next(iter(dense.values())).expert_nbytes(0) if dense else 0
        self._notes: list[str] = []
        widths = {d for w in dense.values() for d in (w.gate_up.shape[-1], w.down.shape[-1])}
        if cfg.bits != "16" and any(d % cfg.group_size for d in widths):
            # No quantized version can be built: page full-precision experts only (they still
            # leave the device and stream back when the budget is short), and say so.
            self._notes.append(f"expert input widths {sorted(widths)} are not multiples of group_size "
                               f"{cfg.group_size}: experts are paged at 16 bits only (no quantized widths)")
            self.config = cfg = dataclasses.replace(cfg, bits="16")
        backend = self._paged_backend(dense)
        self.plan = self._full_plan(backend)
        self._start_arbiter(backend)
        self.plan = self._held_prediction(backend)
        return backend

    def _full_plan(self, backend: PagedWeightBackend) -> Plan:
        """moegen's plan for experts at their quality floors, the least the arbiter holds them
        at (the ring: the backend's staging slots an expert that left the device is fetched
        into)."""
        self.shape, self.hardware = self._shape(), self._hardware()
        self._check_budget(sum(n for _, n in self.budget_minimum()))  # in full's own terms, before the plan's
        floors = [store.nbytes(self.quality[key]) for key, store in backend.stores.items()]
        at_floor = dataclasses.replace(self.shape, expert_bytes=max(floors))
        return make_plan(dataclasses.replace(self.config, expert_slots=backend.fetch_slots), at_floor, self.hardware,
                         self.checkpoint.config.max_position_embeddings, self.name)

    def _held_prediction(self, backend: PagedWeightBackend) -> Plan:
        """The plan's decode prediction redone for what the arbiter holds at start."""
        held = [backend.expert_bytes(*key) for key in backend.stores]
        resident = sum(n > 0 for n in held)
        per_expert = max(1, sum(held) // max(1, resident)) if resident else self.shape.expert_bytes
        self.shape = shape = dataclasses.replace(self.shape, expert_bytes=per_expert)  # for step predictions
        plan = dataclasses.replace(self.plan, resident_experts=resident,
                                   expert_slots=backend.fetch_slots if resident < len(held) else 0)
        context = plan_workload(self.config).context  # type: ignore[arg-type]
        return dataclasses.replace(plan, predicted=decode_cost(shape, self.hardware, plan, plan.batch_seqs, context))

    def notes(self) -> list[str]:
        return list(getattr(self, "_notes", []))

    def _kv_on_device(self) -> bool:
        return self._placement() == "device"

    def _placement(self) -> str:
        plan = getattr(self, "plan", None)  # before the plan: what kv_placement asks for
        return plan.kv_placement if plan is not None else self.config.kv_placement

    def _reserved_device_bytes(self) -> int:
        """moegen's KV staging buffer (placements stream and split), from the plan."""
        plan = getattr(self, "plan", None)
        return plan.staging_bytes if plan is not None else 0

    def budget_minimum(self) -> list[tuple[str, int]]:
        """pagedweight's minimum (dense, experts at their floors or the staging slots, a KV
        block), without the KV block when the plan keeps the KV in the host tier, with the KV
        staging buffer when it streams the KV to device attention."""
        parts = PagedWeightEngine.budget_minimum(self)
        if not self._kv_on_device():
            parts = [p for p in parts if p[0] != "one KV block"]
        if self._reserved_device_bytes():  # the plan's staging buffer
            parts.append(("the KV staging buffer", self._reserved_device_bytes()))
        elif self._placement() in STREAMED:  # before the plan: the smallest one
            mc = self.checkpoint.config
            parts.append(staging_minimum(self.config, self._kv_block_bytes(), mc.num_layers,  # type: ignore[arg-type]
                                         mc.max_position_embeddings))
        return parts

    def _model_stats(self) -> dict[str, float]:
        stats = super()._model_stats()
        stats["plan_expert_bytes_at_floor"] = max(s.nbytes(self.quality[k]) for k, s in self.experts.stores.items())
        return stats


"""One simulated run's parts: the hardware profile, the virtual clock, the routing source and
the cost model, and how they plug into a RuntimeEngine (`RuntimeEngine.start` asks for them
when the config says `simulate`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engines.base import EngineError
from engines.common.device import DTYPES, dtype_name
from engines.runtime.checkpoint import open_checkpoint
from engines.runtime.experts import ExpertBackend
from engines.runtime.model import MoEModel
from engines.runtime.shape import model_shape
from engines.runtime.transfer import TransferLedger
from engines.sim.clock import VirtualClock
from engines.sim.cost import CostModel
from engines.sim.executor import SimExecutor
from engines.sim.hardware import HardwareProfile, load_profile
from engines.sim.routing import routing_source

META = torch.device("meta")
CONTROL_TIME = ("measured", "off")  # RuntimeConfig.control_time


class Simulation:
    def __init__(self, cfg: Any) -> None:
        try:
            self.profile: HardwareProfile = load_profile(cfg.simulate)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        if cfg.control_time not in CONTROL_TIME:
            raise EngineError(f"control_time must be one of {', '.join(CONTROL_TIME)}, got {cfg.control_time!r} "
                              "(e.g. --set control_time=off)")
        self.control_time = cfg.control_time == "measured"
        self.clock = VirtualClock()
        self.executor: SimExecutor | None = None
        self.routing: Any = None
        self.notes: list[str] = []

    @property
    def shared_processor(self) -> bool:
        """Host and device are one processor (the `cpu` profile): nothing crosses a bus."""
        return self.profile.shared

    def configure(self, cfg: Any) -> Any:
        """The options as a simulated run takes them: no --budget on a GPU profile means its
        memory x gpu_memory_utilization (as vLLM sizes a real device); nothing to prepack."""
        changes: dict[str, Any] = {"prepack": False}
        # A shared processor (the cpu profile) sizes the KV cache as a measured CPU run does
        # (kv_cache_gb's CPU default), so the two compare; a GPU is the device's memory.
        if (cfg.budget_bytes is None and cfg.kv_cache_gb is None and cfg.kv_blocks is None
                and not self.shared_processor):
            changes["budget_bytes"] = int(self.profile.memory_bytes * cfg.gpu_memory_utilization)
            self.notes.append(f"device budget {changes['budget_bytes'] / 1e9:.1f} GB: {self.profile.name}'s "
                              f"{self.profile.memory_bytes / 1e9:.0f} GB x gpu_memory_utilization "
                              f"{cfg.gpu_memory_utilization}")
        return dataclasses.replace(cfg, **changes)

    def open(self, cfg: Any) -> tuple[Any, torch.device, torch.dtype, TransferLedger]:
        name = cfg.dtype or self.profile.default_dtype
        if name not in DTYPES:
            raise EngineError(f"unknown dtype {name!r}; valid: float32, float16, bfloat16")
        ledger = TransferLedger(META)
        ledger.crosses_bus = not self.shared_processor
        checkpoint = open_checkpoint(cfg.model, config_only=True)
        method = (checkpoint.config.quantization or {}).get("quant_method")
        if method == "fp8":  # DeepSeek-V3 / Kimi K2 ship fp8 blocks; the runtime serves no fp8
            self.notes.append(f"{checkpoint.path.name}: its fp8 weights are simulated at {name} (pwbench's runtime "
                              "serves no fp8; --dtype sets the width every dense weight and expert is priced at)")
            checkpoint = dataclasses.replace(checkpoint, config=dataclasses.replace(checkpoint.config,
                                                                                    quantization=None))
        return checkpoint, META, DTYPES[name], ledger

    def make_executor(self, cfg: Any, model: MoEModel, ledger: TransferLedger, experts: ExpertBackend,
                      dense_bytes_read: int, copies_overlap: bool) -> SimExecutor:
        mc = model.config
        try:
            self.routing = routing_source(cfg.routing, mc.architecture, mc.num_experts, cfg.seed,
                                          num_layers=mc.num_layers, top_k=mc.top_k)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        dtype_bytes = model.weights.embed.element_size()
        self.dtype = dtype_name(model.weights.embed.dtype)
        self.cost = CostModel(self.profile, model_shape(mc, dtype_bytes), self.dtype)
        self.executor = SimExecutor(model, ledger, experts, self.routing, self.cost, self.clock, dense_bytes_read,
                                    copies_overlap, self.control_time)
        return self.executor

    def describe(self) -> dict[str, Any]:
        """What a result folder records: profile, cost model version and assumptions, routing."""
        return {"hardware": self.profile.name, "hardware_description": self.profile.description,
                "cost_model_version": CostModel.VERSION,
                "cost_model": self.cost.assumptions() if self.executor is not None else {},
                "executor_overhead": self.executor.overhead_assumptions() if self.executor is not None else {},
                "routing": self._routing(),
                "control_time": ("measured: each step adds the CPU time of the engine's control code (scheduler, KV, "
                                 "the technique's per-step host work, the harness's bookkeeping) as it ran here, "
                                 "assuming a host as fast as this one" if self.control_time
                                 else "off: compute only (--set control_time=off)"),
                "totals": self.stats(),  # the run's simulated steps: seconds, roofline, parts
                "notes": list(self.notes)}

    def _routing(self) -> dict[str, Any]:
        if self.routing is None:
            return {}
        ahead = getattr(self.executor, "ahead", None)
        return {**self.routing.describe(), **({"drawing": ahead.describe()} if ahead is not None else {})}

    def peaks(self) -> dict[str, Any]:
        """The profile's peaks in `pwbench hw`'s keys, for the summary's efficiency metrics."""
        p = self.profile
        dtype = self.dtype if self.executor is not None else p.default_dtype
        return {"memory_bandwidth_bytes_per_s": p.memory_bytes_per_s,
                "matmul_flops_per_s": p.flops_per_s.get(dtype, max(p.flops_per_s.values())),
                "h2d_bytes_per_s": p.link_pinned_bytes_per_s,
                "source": f"simulated: hardware profile {p.name} ({p.description})"}

    def stats(self) -> dict[str, float]:
        t = self.executor.totals if self.executor is not None else None
        if t is None or not t.steps:
            return {}
        return {"sim_steps": t.steps, "sim_seconds": t.seconds, "sim_roofline_s": t.roofline_s,
                **{f"sim_{k}_s": v for k, v in t.parts.items()}}

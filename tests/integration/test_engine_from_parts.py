"""A new engine assembled from existing parts in this one file plus one registry line: engine
offload's expert cache under moegen's layer-major executor. Oracle: engine moe's greedy tokens
on the same model (no other engine file is touched to make it)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from engine_runs import generate, random_requests, run_engine
from tiny_models import CPU32

from engines import registry
from engines.moegen.executor import LayerMajorExecutor
from engines.offload.engine import OffloadConfig, offload_parts
from engines.registry import create_engine, engine_class, register_engine
from engines.runtime.engine import EngineParts, Loaded, RuntimeEngine

DEMO = "engines/demo_model"


@dataclass(frozen=True)
class LayerMajorOffloadConfig(OffloadConfig):
    micro_batch: int = 2  # sequences per attention micro-batch


class LayerMajorOffloadEngine(RuntimeEngine):
    name = "offload-layer-major"
    config_cls = LayerMajorOffloadConfig

    def build(self, cfg: LayerMajorOffloadConfig, loaded: Loaded) -> EngineParts:
        parts = offload_parts(cfg, loaded)
        parts.executor = lambda model, kv, ledger: LayerMajorExecutor(model, ledger, cfg.micro_batch)
        return parts


@pytest.fixture
def registered(monkeypatch):
    """The one registry line, undone after the test (other tests list the registry)."""
    monkeypatch.setattr(registry, "_ENGINES", dict(registry._ENGINES))
    register_engine(LayerMajorOffloadEngine.name, f"{__name__}:LayerMajorOffloadEngine",
                    "offload's expert cache under the layer-major executor (a test of the parts)")


def test_an_engine_from_parts_serves_moes_tokens_within_its_budget(registered):
    assert engine_class("offload-layer-major") is LayerMajorOffloadEngine
    reqs = random_requests(1109, n=6, new=12, lo=20, hi=120, seed=3)
    expected, _, _ = generate("moe", DEMO, reqs)
    budget = 2_000_000
    engine = create_engine("offload-layer-major", {"model": DEMO, **CPU32, "budget_bytes": budget,
                                                   "experts_per_layer": 2})
    got, steps, info = run_engine(engine, reqs)
    assert got == expected
    assert isinstance(engine.executor, LayerMajorExecutor)  # the recipe's executor part is the one that ran
    assert info.model_stats["expert_slots_per_layer"] == 2
    assert sum(s.h2d_bytes for s in steps) > 0  # experts did cross from the host tier
    assert all(s.device_weight_bytes + s.device_kv_bytes <= budget for s in steps)

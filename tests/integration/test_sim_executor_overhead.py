"""A simulated engine's parts' host time (engines/sim/cost.py `executor_overhead_s`): each step of a
simulated run adds, over the model's layers, the profile's per-layer and per-layer-token seconds for the
keys of its expert backend and executor; engine full, pagedweight's backend on moegen's executor, pays
both keys. The oracle is the hand sum from the profile's tables and each step's tokens."""

from __future__ import annotations

import dataclasses

import pytest

from engines.common.demo import demo_model_path

PER_LAYER = {"offload": 3e-5, "pagedweight": 7e-5, "layer_major": 1.1e-4}
PER_TOKEN = {"pagedweight": 2e-7, "layer_major": 5e-7}


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory):
    from engines.sim.hardware import load_profile, profile_toml

    p = dataclasses.replace(load_profile("cpu"), executor_overhead_s=PER_LAYER, executor_token_overhead_s=PER_TOKEN)
    f = tmp_path_factory.mktemp("profile") / "cpu-overheads.toml"
    f.write_text(profile_toml(p, name="cpu-overheads"))
    return f


@pytest.mark.parametrize("engine, keys", [("moe", ()), ("offload", ("offload",)), ("pagedweight", ("pagedweight",)),
                                          ("moegen", ("layer_major",)), ("full", ("layer_major", "pagedweight"))])
def test_each_step_adds_its_parts_overhead(profile_file, engine, keys):
    from engines.base import EngineRequest
    from engines.registry import create_engine
    from harness.bench.simulate import engine_options, model_sizes

    model = str(demo_model_path())
    options = {"model": model, **engine_options(engine, model_sizes(model)), "simulate": str(profile_file),
               "routing": "uniform", "control_time": "off"}
    e = create_engine(engine, options)
    e.start()
    try:
        assert e.executor.overhead_keys == keys == type(e).sim_overhead_keys
        layers = e.checkpoint.config.num_layers
        for i in range(3):
            e.add_request(EngineRequest(f"r{i}", tuple(range(5, 45 + 7 * i)), 4, ignore_eos=True))
        steps = 0
        while e.has_unfinished():
            out = e.step()
            tokens = out.num_prefill_tokens + out.num_decode_tokens
            want = layers * sum(PER_LAYER.get(k, 0.0) + PER_TOKEN.get(k, 0.0) * tokens for k in keys)
            parts = e.executor.last.parts
            assert parts.get("executor", 0.0) == pytest.approx(want, rel=1e-12, abs=0.0)
            assert e.executor.last.seconds == pytest.approx(parts.get("executor", 0.0) + _rest(parts))
            steps += 1
        assert steps >= 4
        recorded = e.executor.overhead_assumptions()
        assert recorded["keys"] == list(keys)
        if keys:
            assert recorded["per_layer_s"] == {k: PER_LAYER.get(k, 0.0) for k in keys}
            assert recorded["per_layer_token_s"] == {k: PER_TOKEN.get(k, 0.0) for k in keys}
    finally:
        e.stop()


def _rest(parts: dict) -> float:
    """The step's time before the parts' overhead: engines/sim/cost.py's sum (compute + copies + step
    overhead) or moegen's (its layers and head + overhead)."""
    if "layers_and_head" in parts:
        return parts["layers_and_head"] + parts["overhead"]
    return (parts["dense"] + parts["head"] + parts["experts"] + parts["attention"] + parts["activations"]
            + parts["dispatch"] + parts["copies"] + parts["overhead"])

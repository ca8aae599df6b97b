"""The cost model's torch-call count against a real count (engines/sim/cost.py `torch_calls`).

The oracle is a TorchFunctionMode counting every torch call of one decode step of engine moe
(6 sequences) on a random checkpoint of each attention kind, 8 layers as the bench models have:
grouped-query (Mixtral) and multi-head latent attention (DeepSeek-V3, a dense first layer and a
shared expert). The count does not depend on the matrices' sizes, only on the code path.
"""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import CPU32, build_hf_model, save_checkpoint

BOUND = 0.15  # the counts per layer move with the batch (~140-225 per GQA layer at 1-16 sequences)


def _count_decode_step(folder, seqs: int = 6) -> tuple[int, int, object]:
    """(torch calls, expert runs) of one decode step of `seqs` sequences, and the model config."""
    from torch.overrides import TorchFunctionMode

    from engines.base import EngineRequest
    from engines.registry import create_engine

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    engine = create_engine("moe", {"model": str(folder), **CPU32})
    engine.start()
    try:
        for i in range(seqs):
            engine.add_request(EngineRequest(f"r{i}", tuple(3 + (53 * i + 17 * j) % 250 for j in range(20 + 3 * i)), 8,
                                             ignore_eos=True))
        out = engine.step()
        while out.num_prefill_tokens:
            out = engine.step()
        counter = Count()
        with counter:
            out = engine.step()
        assert out.num_decode_tokens == seqs and out.num_prefill_tokens == 0
        return counter.calls, out.experts_hit, engine.checkpoint.config
    finally:
        engine.stop()


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_torch_calls_match_a_counted_decode_step(tmp_path, arch):
    from engines.runtime.shape import model_shape
    from engines.sim.cost import OPS_PER_LAYER, torch_calls

    folder = save_checkpoint(build_hf_model(arch, num_hidden_layers=8), tmp_path / arch)
    counted, runs, config = _count_decode_step(folder)
    shape = model_shape(config, 4)
    assert shape.attention == ("mla" if arch == "deepseek_v3" else "gqa")
    predicted = torch_calls(shape, groups=1, expert_runs=runs)
    assert abs(predicted - counted) <= BOUND * counted, f"{arch}: predicted {predicted} calls, counted {counted}"
    if arch == "deepseek_v3":  # one count for every architecture would miss MLA's calls by far more
        as_gqa = torch_calls(dataclasses.replace(shape, attention="gqa"), groups=1, expert_runs=runs)
        assert counted - as_gqa > BOUND * counted, f"MLA counted {counted}, a GQA layer's count gives {as_gqa}"
        assert OPS_PER_LAYER["mla"] > OPS_PER_LAYER["gqa"]


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None}], ids=["q_lora", "no_q_lora"])
def test_mla_projections_measured_are_the_checkpoints(tmp_path, overrides):
    """`pwbench hw calibrate --model` times an MLA model's own projection chain (harness/bench/
    cpu_ops.py model_matrices): the oracle is the checkpoint's attention weights as saved."""
    from safetensors import safe_open

    from engines.runtime.checkpoint import open_checkpoint
    from engines.runtime.shape import model_shape
    from harness.bench.cpu_ops import model_matrices

    folder = save_checkpoint(build_hf_model("deepseek_v3", **overrides), tmp_path / "ds")
    config = open_checkpoint(str(folder), config_only=True).config
    layer = "model.layers.1.self_attn."  # an MoE layer's attention (layer 0 is dense)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        # kv_b expands the latent per head inside attention (absorbed, a bmm): not a projection timed
        saved = sorted(tuple(f.get_slice(k).get_shape()) for k in f.keys()
                       if k.startswith(layer) and k.endswith(".weight") and "norm" not in k and "kv_b" not in k)
    assert sorted(model_matrices(model_shape(config, 4), config.mla)["dense"]) == saved

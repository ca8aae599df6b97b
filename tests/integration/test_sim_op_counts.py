"""The cost model's torch-call count against a real count (engines/sim/cost.py `torch_calls`).

The oracle is a TorchFunctionMode counting every torch call of one decode step of engine moe
on a random checkpoint of each attention kind, 8 layers as the bench models have: grouped-query
(Mixtral) and multi-head latent attention (DeepSeek-V3, a dense first layer and a shared
expert); 6 sequences of close contexts (the runtime attends them as two groups) and 6 of
contexts 21-211 tokens (six groups, each attended in its own calls). The count does not depend
on the matrices' sizes, only on the code path.
"""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import CPU32, build_hf_model, save_checkpoint

BOUND = 0.15  # within one group the counts per layer move a little with the batch (GQA ~140-165 at 1-12)
CLOSE = tuple(20 + 3 * i for i in range(6))  # prompt lengths: contexts 21-36
SPREAD = (20, 32, 48, 80, 130, 210)  # 2, 3, 4, 6, 9 and 14 KV blocks of 16: six groups


def _count_decode_step(folder, lengths: tuple[int, ...] = CLOSE) -> tuple[int, int, int, object]:
    """(torch calls, expert runs, decode attention groups) of one decode step of sequences with
    prompts of `lengths` tokens, and the model config."""
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
        seqs = len(lengths)
        for i, n in enumerate(lengths):
            engine.add_request(EngineRequest(f"r{i}", tuple(3 + (53 * i + 17 * j) % 250 for j in range(n)), 8,
                                             ignore_eos=True))
        out = engine.step()
        while out.num_prefill_tokens:
            out = engine.step()
        groups = []
        execute = engine.executor.execute
        engine.executor.execute = lambda batch: groups.append(len(batch.attn.decodes)) or execute(batch)
        counter = Count()
        with counter:
            out = engine.step()
        assert out.num_decode_tokens == seqs and out.num_prefill_tokens == 0
        return counter.calls, out.experts_hit, groups[0], engine.checkpoint.config
    finally:
        engine.stop()


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_torch_calls_match_a_counted_decode_step(tmp_path, arch):
    from engines.runtime.shape import model_shape
    from engines.sim.cost import OPS_PER_DECODE_GROUP, OPS_PER_LAYER, torch_calls

    folder = save_checkpoint(build_hf_model(arch, num_hidden_layers=8), tmp_path / arch)
    counts = {}
    for lengths in (CLOSE, SPREAD):
        counted, runs, groups, config = _count_decode_step(folder, lengths)
        shape = model_shape(config, 4)
        predicted = torch_calls(shape, groups, False, runs)
        assert abs(predicted - counted) <= BOUND * counted, \
            f"{arch}, {groups} groups: predicted {predicted} calls, counted {counted}"
        counts[groups] = counted, runs, shape
    assert shape.attention == ("mla" if arch == "deepseek_v3" else "gqa")
    assert sorted(counts)[-1] == 6 and sorted(counts)[0] <= 2, counts  # the runtime grouped them as expected
    # each group's own calls: counting every batch as one group (cost model 6) misses the spread one
    (few, (c_few, r_few, _)), (many, (c_many, r_many, _)) = sorted(counts.items())
    per_group = (c_many - 8 * r_many - c_few + 8 * r_few) / (many - few) / shape.layers
    assert per_group == pytest.approx(OPS_PER_DECODE_GROUP[shape.attention], rel=BOUND)
    if arch == "deepseek_v3":  # one count for every architecture would miss MLA's calls by far more
        as_gqa = torch_calls(dataclasses.replace(shape, attention="gqa"), many, False, r_many)
        assert c_many - as_gqa > BOUND * c_many, f"MLA counted {c_many}, a GQA layer's count gives {as_gqa}"
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

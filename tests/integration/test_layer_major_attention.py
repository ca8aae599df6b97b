"""Every attention kind in every KV placement of the layer-major executor (engine moegen; `full`
reuses it): DeepSeek-V3's multi-head latent attention (with and without the low-rank query,
YaRN with its softmax mscale), GLM-4.5 (partial rotary, q/k norm, q/k/v biases) and gpt-oss
(attention sinks, sliding windows shorter than the prompts, biases), with KV on the device, in
the host tier attended on the host, streamed into a device staging buffer, and split between
the two.

Oracle: transformers' own greedy generate() of each prompt alone (batch 1, no padding, float32)
on tiny random checkpoints. Our runs batch the prompts, chunk long prefills, and attend decodes
in micro-batches of two sequences. The cost model's sizes are checked against the loaded
weights' bytes and the KV cache's own block size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from engine_runs import run_engine
from tiny_models import CPU32, build_hf_model

from engines.base import EngineRequest
from engines.moegen.engine import MoEGenEngine, layer_major, plan_copies
from engines.moegen.executor import HostAttention, LayerMajorExecutor, StreamAttention
from engines.moegen.plan import MoEGenConfig, loaded_shape, make_plan, plan_hardware
from engines.registry import create_engine
from engines.runtime.engine import EngineParts, KVPool, Loaded
from engines.runtime.experts import ResidentBackend
from engines.runtime.kv_cache import PagedKVCache
from harness.cli.plan import plan_row

# name -> (architecture, transformers config overrides)
MODELS = {
    "deepseek_v3": ("deepseek_v3", {}),
    # test_moe_matches_transformers.py's variant: no low-rank query, rotate-half rope, YaRN
    # with DeepSeek's mscale on the softmax scale.
    "deepseek_v3-no_q_lora-yarn": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})),
    "glm4_moe": ("glm4_moe", {}),
    "gpt_oss": ("gpt_oss", {}),
}
# Every placement, decode attention in micro-batches of 2 sequences; split attends one of
# each micro-batch's two on the host and streams the other's KV.
PLACEMENTS = {
    "device": {"kv_placement": "device", "micro_batch": 2},
    "host": {"kv_placement": "host", "micro_batch": 2},
    "stream": {"kv_placement": "stream", "micro_batch": 2},
    "split": {"kv_placement": "split", "host_share": 0.5, "micro_batch": 2},
}
# Lengths 1 to 37 (gpt-oss's window is 6); 37 > the 24-token step budget, so a prefill chunk
# continues its sequence (attending cached blocks) in every placement.
PROMPTS = [[5], [7, 8, 9, 10, 11, 12, 13], list(range(20, 57)), [3, 250, 17, 4, 9, 33, 61, 2, 90, 44, 1]]
NEW_TOKENS = 8
OPTIONS = {**CPU32, "budget_bytes": 64 << 20, "host_kv_gb": 0.01, "block_size": 4, "max_num_batched_tokens": 24,
           "max_model_len": 64}


@pytest.fixture(scope="module")
def reference():
    """model name -> transformers' greedy tokens of each prompt."""
    cache: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            arch, overrides = MODELS[name]
            model = build_hf_model(arch, **overrides)
            with torch.inference_mode():
                cache[name] = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                               for p in PROMPTS]
        return cache[name]

    return get


def folder(checkpoints, name: str):
    arch, overrides = MODELS[name]
    return checkpoints(arch, **overrides)


def tokens(engine) -> list[list[int]]:
    reqs = [EngineRequest(str(i), tuple(p), NEW_TOKENS, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    got, _, _ = run_engine(engine, reqs)
    return [got[str(i)] for i in range(len(PROMPTS))]


class ResidentLayerMajor(MoEGenEngine):
    """Engine moegen's plan and layer-major executor (its attention placements) over engine
    moe's ResidentBackend: every expert resident and computed as engine moe does, so these
    tests see attention alone, whatever the streaming ring computes."""

    name = "moegen-resident"

    def build(self, cfg: MoEGenConfig, loaded: Loaded) -> EngineParts:
        shape = loaded_shape(loaded, loaded.bytes_per_expert, self.name)
        hw, max_len = plan_hardware(cfg, loaded.device), loaded.checkpoint.config.max_position_embeddings
        plan = make_plan(cfg, shape, hw, max_len, self.name)
        copies = plan_copies(loaded, cfg, self.name)
        experts = ResidentBackend(loaded.experts)
        kv = KVPool(plan.kv_placement == "device", loaded.dense_bytes + experts.device_bytes(), cfg.host_kv_gb)
        return EngineParts(experts, [], kv, copies=copies, executor=layer_major(plan, copies))


ATTENTION = {"device": type(None), "host": HostAttention, "stream": StreamAttention, "split": StreamAttention}


@pytest.mark.parametrize("placement", PLACEMENTS)
# the real engine test below runs every model in every placement; here DeepSeek-V3 in the default run
@pytest.mark.parametrize("name", [n if n == "deepseek_v3" else pytest.param(n, marks=pytest.mark.slow) for n in MODELS])
def test_every_placement_attends_as_transformers(name, placement, checkpoints, reference):
    engine = ResidentLayerMajor(MoEGenConfig(model=str(folder(checkpoints, name)), **OPTIONS, **PLACEMENTS[placement]))
    got = tokens(engine)
    assert isinstance(engine.executor, LayerMajorExecutor)
    assert isinstance(engine.executor.attend, ATTENTION[placement])  # the placement asked for is the one that ran
    assert got == reference(name), (name, placement)


# gpt-oss's experts are biased and clamped: until engines/moegen/streaming.py's ring holds and
# applies their biases, engine moegen's tokens for it may differ because of the experts (the
# test above shows its attention is right in every placement).
@pytest.mark.parametrize("name", list(MODELS))
def test_engine_moegen_gives_transformers_tokens_in_every_placement(name, checkpoints, reference):
    """The real engine: its streaming ring (nothing resident, 2 slots) under device and host KV,
    the plan's residents under stream and split."""
    model = str(folder(checkpoints, name))
    for placement, ring in (("device", {"resident_experts": 0, "expert_slots": 2}),
                            ("host", {"resident_experts": 0, "expert_slots": 2}), ("stream", {}), ("split", {})):
        engine = create_engine("moegen", {"model": model, **OPTIONS, **PLACEMENTS[placement], **ring})
        assert tokens(engine) == reference(name), (name, placement)
        assert engine.plan.kv_placement == placement


@pytest.mark.parametrize("arch, overrides", [
    ("deepseek_v3", {}), ("deepseek_v3", {"q_lora_rank": None}), ("deepseek_v3", {"attention_bias": True}),
    ("glm4_moe", {}), ("glm4_moe", {"use_qk_norm": False, "attention_bias": False}), ("gpt_oss", {}),
])
def test_the_cost_models_sizes_are_the_loaded_weights(arch, overrides, checkpoints):
    """model_shape from config.json alone equals the loaded model: dense bytes (MLA's projections,
    norms and biases; sinks; router biases), bytes per expert (gpt-oss's expert biases
    included: 3 D I + 2 I + D) and KV bytes per token (MLA: layers x (latent + rope key))."""
    engine = create_engine("moegen", {"model": str(checkpoints(arch, **overrides)), **CPU32,
                                      "budget_bytes": 64 << 20, "host_kv_gb": 0.01})
    engine.start()  # loaded_shape refuses sizes that differ from the weights
    try:
        loaded = engine.loaded
        shape = loaded_shape(loaded, loaded.bytes_per_expert, "moegen")
        mc = loaded.checkpoint.config
    finally:
        engine.stop()
    D, I = mc.hidden_size, mc.moe_intermediate_size
    assert shape.expert_bytes == 4 * (3 * D * I + (2 * I + D if arch == "gpt_oss" else 0))
    assert shape.kv_bytes_per_token == PagedKVCache.model_block_bytes(mc, 1, torch.float32)
    if arch == "deepseek_v3":
        assert shape.kv_bytes_per_token == mc.num_layers * (16 + 8) * 4  # kv_lora_rank 16 + rope 8, float32


def test_pwbench_plan_plans_deepseek_v3(checkpoints, tmp_path):
    """`pwbench plan --model` on an MLA folder prints the plan engine moegen runs for it."""
    model = str(checkpoints("deepseek_v3"))
    opts = {"peak_memory_gbps": "20", "peak_gflops": "100", "op_overhead_us": "5", "link_gbps": "25",
            "max_num_seqs": "16", "plan_context": "64", "max_model_len": "128"}
    budget = 1 << 20
    sets = [x for k, v in opts.items() for x in ("--set", f"{k}={v}")]
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "plan", "--model", model, "--budget", str(budget),
                           "--json", *sets], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PWBENCH_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout.strip().splitlines()[-1])["plan"]
    engine = create_engine("moegen", {"model": model, **CPU32, "budget_bytes": budget, "host_kv_gb": 0.01, **opts})
    engine.start()
    try:
        plan = engine.plan
    finally:
        engine.stop()
    expected = plan_row(plan)
    assert printed.keys() == expected.keys()
    for key, value in expected.items():
        assert printed[key] == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value), key
    assert printed["kv_placement"] in ("device", "host", "stream", "split") and printed["predicted_tokens_per_s"] > 0

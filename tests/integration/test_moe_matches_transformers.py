"""The `moe` engine against transformers' own generate(): same greedy tokens, logits within 1e-3.

Oracle: each prompt run alone through transformers' model class (batch 1, no padding).
Our engine runs the prompts together, chunked, joining mid-decode and under KV pressure.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, CPU32, build_hf_model

from engines.base import EngineRequest
from engines.moe import MoEEngine, MoEEngineConfig

NEW_TOKENS = 32
PROMPTS = [[5], [7, 8, 9, 10, 11, 12, 13], list(range(20, 43)), list(range(100, 164)),
           [3, 250, 17, 4, 9, 33, 61, 2, 90, 44, 1]]
LOGIT_TOL = 1e-3


def hf_reference(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
        pad_token_id=0, output_logits=True, return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(arch: str, **overrides):
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            model = build_hf_model(arch, **overrides)
            with torch.inference_mode():
                cache[key] = [hf_reference(model, p) for p in PROMPTS]
        return cache[key]

    return get


def run_engine(engine: MoEEngine, schedule: dict[int, list[int]]) -> tuple[dict, dict, int]:
    """schedule: step number -> prompt indices added before that step. Returns tokens, logits, preemptions."""
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    preempted, step = 0, 0
    while step <= max(schedule) or engine.has_unfinished():
        for i in schedule.get(step, []):
            engine.add_request(EngineRequest(str(i), tuple(PROMPTS[i]), NEW_TOKENS, ignore_eos=True,
                                             return_logits=True))
            tokens[str(i)], logits[str(i)] = [], []
        out = engine.step()
        preempted += out.num_preempted
        for o in out.outputs:
            tokens[o.request_id] += o.new_token_ids
            logits[o.request_id].append(o.logits)
        step += 1
    return tokens, logits, preempted


def check(tokens, logits, refs):
    for key, got in tokens.items():
        ref_tokens, ref_logits = refs[int(key)]
        assert got == ref_tokens, f"prompt {key}: tokens differ"
        diff = (torch.cat(logits[key]) - ref_logits).abs().max().item()
        assert diff <= LOGIT_TOL, f"prompt {key}: max logit difference {diff}"


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_different_lengths(arch, checkpoints, references):
    # Small blocks and token budget: multi-block tables, chunked prefill mixed with decodes.
    engine = MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints(arch)), block_size=4, max_num_batched_tokens=24))
    with engine:
        tokens, logits, _ = run_engine(engine, {0: list(range(len(PROMPTS)))})
        assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks  # every block came back
    check(tokens, logits, references(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_requests_join_while_others_decode(arch, checkpoints, references):
    engine = MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints(arch)), block_size=8, max_num_batched_tokens=40))
    with engine:
        tokens, logits, _ = run_engine(engine, {0: [0, 1], 5: [2], 9: [3, 4]})
    check(tokens, logits, references(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_under_kv_pressure(arch, checkpoints, references):
    # 30 blocks of 4 tokens cannot hold all five sequences at full length: some are preempted
    # and recomputed, and the tokens must not change.
    engine = MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints(arch)), block_size=4, kv_blocks=30))
    with engine:
        tokens, logits, preempted = run_engine(engine, {0: list(range(len(PROMPTS)))})
    assert preempted > 0
    check(tokens, logits, references(arch))


def test_sliding_window(checkpoints, references):
    # Window 10 < prompt + output lengths: the mask must drop old keys exactly as transformers does.
    engine = MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints("mixtral", sliding_window=10)), block_size=4,
                                       max_num_batched_tokens=16))
    with engine:
        tokens, logits, _ = run_engine(engine, {0: [1, 2, 3], 3: [4]})
    check(tokens, logits, references("mixtral", sliding_window=10))


# Variants of the new architectures beside their ARCH_KWARGS defaults: DeepSeek-V3 without the
# low-rank query, rotate-half rope and YaRN (with DeepSeek's mscale on the softmax); GLM-4.5
# without q/k norm and biases, a quarter of each head rotated, YaRN.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
VARIANTS = {
    "deepseek_v3-no_q_lora-yarn": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, rope_parameters=YARN)),
    "glm4_moe-plain-yarn": ("glm4_moe", dict(use_qk_norm=False, attention_bias=False,
                                             rope_parameters={**YARN, "partial_rotary_factor": 0.25})),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_architecture_variants(variant, checkpoints, references):
    arch, overrides = VARIANTS[variant]
    folder = checkpoints(arch, **overrides)
    engine = MoEEngine(MoEEngineConfig(**CPU32, model=str(folder), block_size=4, max_num_batched_tokens=24))
    with engine:
        tokens, logits, _ = run_engine(engine, {0: [0, 3], 4: [1, 2, 4]})
    check(tokens, logits, references(arch, **overrides))


def test_tied_embeddings(checkpoints, references):
    engine = MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints("olmoe", tie_word_embeddings=True))))
    with engine:
        tokens, logits, _ = run_engine(engine, {0: [1, 3]})
    check(tokens, logits, references("olmoe", tie_word_embeddings=True))


def test_eos_stops_unless_ignored(checkpoints, references):
    # Take the 5th greedy token of a prompt as "EOS": the engine must stop right there.
    ref_tokens, _ = references("mixtral")[1]
    stop_token = ref_tokens[4]
    first = ref_tokens.index(stop_token)
    engine = MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints("mixtral"))))
    with engine:
        engine.checkpoint = engine.checkpoint.__class__(
            engine.checkpoint.path, _with_eos(engine.checkpoint.config, stop_token),
            engine.checkpoint.raw_config, engine.checkpoint.key_files,
        )
        engine.add_request(EngineRequest("stop", tuple(PROMPTS[1]), NEW_TOKENS))
        engine.add_request(EngineRequest("ignore", tuple(PROMPTS[1]), NEW_TOKENS, ignore_eos=True))
        got, reasons = {"stop": [], "ignore": []}, {}
        while engine.has_unfinished():
            for o in engine.step().outputs:
                got[o.request_id] += o.new_token_ids
                if o.finished:
                    reasons[o.request_id] = o.finish_reason
    assert got["stop"] == ref_tokens[: first + 1] and reasons["stop"] == "stop"
    assert got["ignore"] == ref_tokens and reasons["ignore"] == "length"


def _with_eos(config, token):
    import dataclasses

    return dataclasses.replace(config, eos_token_ids=(token,))


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe"])
def test_prompt_logits_match_a_forward_pass(arch, checkpoints):
    """Teacher-forced prompt logits, collected across prefill chunks, equal transformers' forward."""
    from engines.hf import HFEngine, HFEngineConfig

    model = build_hf_model(arch)
    prompts = [PROMPTS[3], PROMPTS[4], PROMPTS[1]]
    with torch.inference_mode():
        expected = [model(input_ids=torch.tensor([p])).logits[0].float() for p in prompts]
    engines = [
        MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints(arch)), block_size=4, max_num_batched_tokens=20)),
        HFEngine(HFEngineConfig(**CPU32, model=str(checkpoints(arch)))),
    ]
    for engine in engines:
        got = {}
        with engine:
            for i, p in enumerate(prompts):
                engine.add_request(EngineRequest(str(i), tuple(p), 2, ignore_eos=True, return_prompt_logits=True))
            while engine.has_unfinished():
                for o in engine.step().outputs:
                    if o.prompt_logits is not None:
                        got[o.request_id] = o.prompt_logits
        for i, ref in enumerate(expected):
            assert got[str(i)].shape == ref.shape
            assert (got[str(i)] - ref).abs().max().item() <= LOGIT_TOL

"""Seeded sampling, preemption and abort in the engines, against transformers' own model.

Oracle for seeded sampling in `moe`: transformers' model gives the next-token logits of the
sequence so far, and the token is one `torch.multinomial` draw from softmax(logits / T) with a
generator seeded by the request's seed (the contract in engines/runtime/sampling.py: a
request's tokens depend on its own seed and logits only). Oracle for `hf`: transformers'
generate() itself after `torch.manual_seed(seed)`.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import CPU32, build_hf_model

from engines.base import EngineRequest, SamplingParams
from engines.hf import HFEngine, HFEngineConfig
from engines.moe import MoEEngine, MoEEngineConfig
from harness.offline import run_offline

NEW = 24
PROMPT = tuple(range(20, 43))
OTHERS = [(5,), (7, 8, 9, 10, 11, 12, 13), tuple(range(100, 164))]
HOT = SamplingParams(temperature=0.9, seed=11)


def sampled_reference(model, prompt, n: int, temperature: float, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            token = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).item()
            ids.append(token)
            out.append(token)
    return out


def greedy_reference(model, prompt, n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def drive(engine, requests: list[EngineRequest], on_step=None) -> tuple[dict, dict, int]:
    """The project's offline driver; returns tokens and finish reasons per request, and
    preemptions. `on_step(engine, step_output)` runs after each step."""
    preempted = 0

    def step(out):
        nonlocal preempted
        preempted += out.num_preempted
        if on_step is not None:
            on_step(engine, out)

    done = run_offline(engine, requests, on_step=step)
    return ({k: c.output_ids for k, c in done.items()},
            {k: c.finish_reason for k, c in done.items() if c.finish_reason},
            preempted)


@pytest.fixture(scope="module", params=[pytest.param("mixtral", marks=pytest.mark.slow), "qwen3_moe"])  # mixtral: ~33 s
def arch_model(request):
    return request.param, build_hf_model(request.param)


def test_seeded_request_same_alone_in_a_batch_and_across_preemption(arch_model, checkpoints):
    arch, model = arch_model
    expected = sampled_reference(model, PROMPT, NEW, HOT.temperature, HOT.seed)
    assert expected != greedy_reference(model, PROMPT, NEW)  # the test samples, it is not greedy in disguise
    folder = str(checkpoints(arch))
    seeded = EngineRequest("s", PROMPT, NEW, sampling=HOT, ignore_eos=True)

    with MoEEngine(MoEEngineConfig(**CPU32, model=folder)) as engine:
        alone, _, _ = drive(engine, [seeded])
    assert alone["s"] == expected

    # Neighbours: greedy ones and sampled ones with other seeds, all drawing in the same steps.
    others = [EngineRequest(f"o{i}", p, NEW, ignore_eos=True,
                            sampling=SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams())
              for i, p in enumerate(OTHERS)]
    with MoEEngine(MoEEngineConfig(**CPU32, model=folder, block_size=4, max_num_batched_tokens=16)) as engine:
        batched, _, _ = drive(engine, [*others, seeded])
    assert batched["s"] == expected

    # 20 blocks of 4 tokens hold the three prompts but not their 24 new tokens each: the newest
    # admitted ("s", added last) is preempted after it has sampled, recomputed, and must go on
    # with the same draws.
    preempted_after_tokens = []

    def watch(engine, out):
        for seq in engine.scheduler.waiting:
            if seq.id == "s" and seq.num_generated > 0:
                preempted_after_tokens.append(seq.num_generated)

    with MoEEngine(MoEEngineConfig(**CPU32, model=folder, block_size=4, kv_blocks=20)) as engine:
        squeezed, reasons, preempted = drive(engine, [*others[:2], seeded], on_step=watch)
    assert preempted > 0 and preempted_after_tokens, "the KV budget no longer forces preemption of 's'"
    assert squeezed["s"] == expected and reasons["s"] == "length"
    # the neighbours' tokens, sampled and greedy, survive the preemption of another too
    assert {k: squeezed[k] for k in ("o0", "o1")} == {k: batched[k] for k in ("o0", "o1")}


def test_unseeded_requests_draw_from_the_engine_seed(checkpoints):
    """A request without a seed gets one from the engine's `seed` and its arrival order:
    reproducible per engine seed, different across engine seeds."""
    folder = str(checkpoints("mixtral"))
    req = EngineRequest("u", PROMPT, NEW, sampling=SamplingParams(temperature=1.0), ignore_eos=True)
    runs = []
    for seed in (0, 0, 1):
        with MoEEngine(MoEEngineConfig(**CPU32, model=folder, seed=seed)) as engine:
            runs.append(drive(engine, [req])[0]["u"])
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("arch", ["qwen3_moe", pytest.param("olmoe", marks=pytest.mark.slow)])  # olmoe: ~16 s
def test_preemption_keeps_prompt_logits_and_sampled_logits(arch, checkpoints):
    """Under preemption and chunked prefill, teacher-forced prompt logits still equal one
    forward pass, and each request's logits match transformers' for the tokens it produced."""
    model = build_hf_model(arch)
    prompts = [tuple(range(100, 164)), tuple(range(20, 43)), (3, 250, 17, 4, 9, 33, 61, 2, 90, 44, 1)]
    reqs = [EngineRequest(str(i), p, 16, ignore_eos=True, return_prompt_logits=True, return_logits=True,
                          sampling=SamplingParams(temperature=1.0, seed=i) if i == 1 else SamplingParams())
            for i, p in enumerate(prompts)]
    got_prompt, got_logits = {}, {r.request_id: [] for r in reqs}

    def collect(engine, out):
        for o in out.outputs:
            got_logits[o.request_id].append(o.logits)
            if o.prompt_logits is not None:
                assert o.request_id not in got_prompt  # returned once, with the first token
                got_prompt[o.request_id] = o.prompt_logits

    with MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints(arch)), block_size=4, kv_blocks=24,
                                   max_num_batched_tokens=16)) as engine:
        tokens, _, preempted = drive(engine, reqs, on_step=collect)
    assert preempted > 0
    for r in reqs:
        full = list(r.prompt_ids) + tokens[r.request_id]
        with torch.inference_mode():
            ref = model(input_ids=torch.tensor([full])).logits[0].float()
        n = len(r.prompt_ids)
        assert (got_prompt[r.request_id] - ref[:n]).abs().max().item() <= 1e-3
        # Logits of token k come from the context up to it: rows n-1 .. n+14 of the forward.
        assert (torch.cat(got_logits[r.request_id]) - ref[n - 1 : n - 1 + 16]).abs().max().item() <= 1e-3
    assert tokens["0"] == greedy_reference(model, prompts[0], 16)
    assert tokens["1"] == sampled_reference(model, prompts[1], 16, 1.0, 1)


def test_abort_a_waiting_request(checkpoints):
    model = build_hf_model("mixtral")
    with MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints("mixtral")), max_num_seqs=1)) as engine:
        engine.add_request(EngineRequest("a", PROMPT, 8, ignore_eos=True))
        engine.add_request(EngineRequest("b", OTHERS[1], 8, ignore_eos=True))
        first = engine.step()
        assert [s.id for s in engine.scheduler.waiting] == ["b"]  # max_num_seqs=1 keeps b waiting
        engine.abort("b")
        tokens, reasons, _ = drive(engine, [])
        assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks
    assert first.started == ("a",)
    assert reasons == {"b": "abort", "a": "length"} and tokens["b"] == []
    assert list(first.outputs[0].new_token_ids) + tokens["a"] == greedy_reference(model, PROMPT, 8)


def test_abort_a_preempted_request(checkpoints):
    """A preempted sequence waits with its generated tokens and no blocks; aborting it ends it
    at once, and the others' tokens are untouched."""
    model = build_hf_model("mixtral")
    reqs = [EngineRequest(str(i), p, NEW, ignore_eos=True) for i, p in enumerate([*OTHERS[:2], PROMPT])]
    victim = None

    def abort_a_preempted_one(engine, out):
        nonlocal victim
        if victim is None:
            waiting = [s for s in engine.scheduler.waiting if s.num_generated > 0]
            if waiting:
                victim = waiting[0].id
                assert victim not in engine.kv.allocator.tables  # preempted: its blocks are free
                engine.abort(victim)

    with MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints("mixtral")), block_size=4, kv_blocks=20)) as engine:
        tokens, reasons, _ = drive(engine, reqs, on_step=abort_a_preempted_one)
        assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks
    assert victim is not None, "the KV budget no longer forces a preemption"
    assert reasons.pop(victim) == "abort" and 0 < len(tokens[victim]) < NEW
    for r in reqs:
        if r.request_id != victim:
            assert reasons[r.request_id] == "length"
            assert tokens[r.request_id] == greedy_reference(model, r.prompt_ids, NEW)


def test_hf_engine_seeding_matches_generate(checkpoints):
    """`hf` samples with transformers' generate() after seeding torch with the request's seed."""
    model = build_hf_model("olmoe")
    params = SamplingParams(temperature=0.8, seed=5)

    def direct(seed: int) -> list[int]:
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=True, temperature=0.8,
                                 top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)
        return out[0, len(PROMPT):].tolist()

    def engine_tokens(sampling: SamplingParams) -> list[int]:
        with HFEngine(HFEngineConfig(**CPU32, model=str(checkpoints("olmoe")))) as engine:
            return drive(engine, [EngineRequest("h", PROMPT, NEW, sampling=sampling, ignore_eos=True)])[0]["h"]

    expected = direct(5)
    assert expected != direct(6)
    assert engine_tokens(params) == expected
    assert engine_tokens(SamplingParams(temperature=0.8, seed=6)) == direct(6)

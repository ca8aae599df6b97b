"""Automatic prefix caching in the `moe` runtime, end to end.

Oracle: the same engine with `prefix_caching=False` (the path the other integration tests
hold to transformers): with caching on, every request's greedy and seeded tokens and its
prompt logits must be the same, on the bundled demo model and on tiny random checkpoints of
all four architectures, with requests that share prefixes, a KV pool small enough to preempt,
and a request that finishes while others still hold its blocks. Each test also checks that
what it is about happened (cache hits, preemptions, shared blocks outliving their first owner).

The workload tests compare what caching saves with `workloads.reuse.repeated_prefix_tokens`,
computed from the workload's block metadata alone; the bound is derived in their docstring.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import ARCHS, CPU32

from engines.base import EngineRequest, SamplingParams
from engines.common.demo import demo_model_path
from engines.registry import create_engine
from harness.offline import run_offline
from harness.run import RunArgs, build
from workloads.registry import WorkloadSpec
from workloads.reuse import repeated_prefix, repeated_prefix_tokens

B = 4
NEW = 10


def shared_prefix_requests() -> list[EngineRequest]:
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 250) for _ in range(n)]

    P = tokens(40)  # 10 blocks of 4
    a = P + tokens(5)
    specs = [
        ("a", a, NEW, {}),
        ("b", P + tokens(9), NEW, {}),
        ("c", P, NEW, {}),  # a whole number of blocks: the last one is computed, not taken
        ("d", P[:22], 2, {}),  # takes 5 of a's blocks and finishes while a, b, ... hold them
        ("e", a, NEW, {}),  # the same prompt as a
        ("f", tokens(30), NEW, {}),
        ("g", P + tokens(3), 4, {"return_prompt_logits": True}),  # must compute every position
        ("h", P + tokens(7), NEW, {"sampling": SamplingParams(temperature=0.8, seed=3)}),
    ]
    return [EngineRequest(rid, tuple(ids), n, ignore_eos=True, **kw) for rid, ids, n, kw in specs]


class Watch:
    """What a run did, step by step: cached prompt tokens, preemptions, recomputes that took
    their own cached blocks, requests finishing while others still held their blocks, and
    `started` reports; and (checked in every plan) no chunk writes a shared or registered block."""

    def __init__(self, engine) -> None:
        self.engine, self.alloc = engine, engine.kv.allocator
        self.cached = self.preempted = self.outlived = self.recompute_hits = 0
        self.started: list[str] = []
        self.tables: dict[str, list[int]] = {}
        schedule = engine.scheduler.schedule

        def checked_schedule():
            waiting = {s.id for s in engine.scheduler.waiting}
            plan = schedule()
            for c in plan.decodes + plan.prefills:
                table = self.alloc.tables[c.seq.id]
                for p in range(c.start, c.start + c.length):
                    block = table[p // B]
                    assert self.alloc.ref_count(block) == 1 and self.alloc.registered_hash(block) is None, (c.seq.id, p)
                if c.seq.id in waiting and c.seq.num_generated > 0 and c.start > 0:
                    self.recompute_hits += 1  # a preempted sequence came back to its cached blocks
            return plan

        engine.scheduler.schedule = checked_schedule

    def __call__(self, out) -> None:
        self.cached += out.cached_prompt_tokens
        self.preempted += out.num_preempted
        self.started += out.started
        held = {b for t in self.alloc.tables.values() for b in t}
        for o in out.outputs:
            if o.finished and held & set(self.tables.get(o.request_id, ())):
                self.outlived += 1
        self.tables = {k: list(t) for k, t in self.alloc.tables.items()}


def run(model: str, requests: list[EngineRequest], caching: bool, **options):
    config = {**CPU32, "model": model, "block_size": B, "prefix_caching": caching, **options}
    with create_engine("moe", config) as engine:
        watch = Watch(engine)
        done = run_offline(engine, requests, on_step=watch)
        alloc = engine.kv.allocator
        assert alloc.num_used == 0 and alloc.num_free == alloc.num_blocks
        assert (alloc.num_cached > 0) == caching
    return done, watch


@pytest.mark.parametrize("arch", ["demo", *ARCHS])
def test_same_tokens_with_prefix_caching_under_preemption(arch, checkpoints):
    model = str(demo_model_path() if arch == "demo" else checkpoints(arch))
    requests = shared_prefix_requests()
    options = {"kv_blocks": 24, "max_num_batched_tokens": 16}
    off, w_off = run(model, requests, caching=False, **options)
    on, w_on = run(model, requests, caching=True, **options)
    for r in requests:
        assert on[r.request_id].output_ids == off[r.request_id].output_ids, r.request_id
        assert on[r.request_id].finish_reason == off[r.request_id].finish_reason == "length"
    assert torch.allclose(on["g"].prompt_logits, off["g"].prompt_logits, atol=1e-4, rtol=0)
    assert w_off.cached == 0 and w_on.cached > 0
    assert w_on.preempted > 0 and w_off.preempted > 0, "kv_blocks no longer forces preemption"
    assert w_on.recompute_hits > 0, "no preempted request was recomputed from its cached blocks"
    assert w_on.outlived > 0, "no request finished while others still held its blocks"
    assert sorted(w_on.started) == sorted(w_off.started) == sorted(r.request_id for r in requests)


# -- what the cache saves on the named workloads ------------------------------------------------

DEMO_B = 16  # the default block size
QUESTION = 7  # DemoTaskSynthesizer overwrites a prompt's last 6 tokens (closed book: 7)


def serve(workload, caching: bool, kv_blocks: int) -> tuple[dict[str, int], list]:
    """Serve the workload's requests one at a time, at most 2 new tokens each; returns each
    request's cached prompt tokens (read from the step that started it) and the steps."""
    steps: list = []
    requests = [EngineRequest(r.request_id, tuple(r.prompt_ids), min(2, r.max_new_tokens), ignore_eos=True)
                for r in workload.requests]
    config = {**CPU32, "model": str(demo_model_path()), "max_num_seqs": 1, "kv_blocks": kv_blocks,
              "prefix_caching": caching}
    with create_engine("moe", config) as engine:
        run_offline(engine, requests, on_step=steps.append)
    cached = {}
    for s in steps:
        assert len(s.started) <= 1 and (s.started or not s.cached_prompt_tokens)
        for rid in s.started:
            cached[rid] = s.cached_prompt_tokens
    return cached, steps


@pytest.mark.parametrize("demo_tasks", [False, True], ids=["hash_blocks", "demo_tasks"])
@pytest.mark.parametrize("name", ["long_chat", "rag_long"])
def test_prefix_cache_saves_what_the_workload_repeats(name, demo_tasks):
    """Computed prefill tokens saved by caching >= what the workload's metadata says repeats,
    minus block rounding, on the demo model.

    The requests run one at a time (max_num_seqs=1) in workload order, so each one is admitted
    after every earlier one has finished and registered its full blocks (running them together,
    two requests could compute a shared prefix in the same step and neither would find it);
    the KV pool holds every block of the workload, so nothing is evicted or preempted, and
    every prompt fits one step's token budget, so caching off computes exactly `total`. Request r (n_r prompt tokens)
    shares its first L_r tokens (repeated_prefix) with an earlier request q, L_r <= n_q. With
    hash-synthesized prompts equal metadata means equal tokens, so q's blocks covering
    [0, B*floor(L_r/B)) are in the cache (computed: q's prompt ran), and r takes them, capped
    at (n_r-1)//B blocks: saved_r >= B*floor(min(L_r, n_r-1)/B). That falls short of L_r by
    L_r mod B <= B-1 when L_r < n_r, and by 1 + (n_r-1) mod B <= B when L_r = n_r (the last
    token is computed for its logits): at most B per request with a repeat, and in total

        (off - on) / total >= repeated/total - sum_r (L_r - B*floor(min(L_r, n_r-1)/B)) / total.

    The demo model's task prompts (what `pwbench run` builds for it: harness/run.py) are the
    same blocks shifted by one BOS token, with the last Q <= 7 tokens of every prompt
    overwritten by the question (workloads/demo/synth.py), so r and q agree on at least
    min(L_r+1, n_q-Q, n_r-Q) >= L_r-7 leading tokens: saved_r >= B*floor(max(0, L_r-7)/B),
    short of L_r by at most B+6 per request.
    """
    with create_engine("moe", {**CPU32, "model": str(demo_model_path())}) as engine:
        info = engine.info()
    scale = {"long_chat": 0.1, "rag_long": 0.25}[name]  # harness/demo_model.py's DEMO_DEFAULTS
    _, workload = build(RunArgs(WorkloadSpec(name, requests=30, scale=scale), given=frozenset({"scale"})), info,
                        demo_tasks)
    assert all(r.prefix_blocks for r in workload.requests)
    repeated, total = repeated_prefix_tokens(workload.requests)
    matched = dict(zip((r.request_id for r in workload.requests), repeated_prefix(workload.requests)))
    lengths = {r.request_id: r.num_prompt_tokens for r in workload.requests}
    kv_blocks = sum(-(-(n + 2) // DEMO_B) for n in lengths.values())  # every block ever taken

    cached_off, off_steps = serve(workload, False, kv_blocks)
    cached_on, on_steps = serve(workload, True, kv_blocks)
    off = sum(s.num_prefill_tokens for s in off_steps)
    on = sum(s.num_prefill_tokens for s in on_steps)
    assert sum(s.num_preempted for s in off_steps + on_steps) == 0
    assert off == total and set(cached_on) == set(lengths) and not any(cached_off.values())
    assert off - on == sum(cached_on.values())

    slack = 0
    for rid, n in lengths.items():
        L = matched[rid]
        bound = DEMO_B * (max(0, L - QUESTION) // DEMO_B) if demo_tasks else DEMO_B * (min(L, n - 1) // DEMO_B)
        assert cached_on[rid] >= bound, (rid, L, n, cached_on[rid])
        slack += L - bound
    with_repeats = sum(L > 0 for L in matched.values())
    assert slack <= (DEMO_B + 6 * demo_tasks) * with_repeats
    assert repeated > total / 4, "the workload no longer repeats much; the test would prove little"
    assert (off - on) / total >= repeated / total - slack / total

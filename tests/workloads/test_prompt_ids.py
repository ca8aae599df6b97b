"""Prompt token ids held compactly (workloads/prompts.py): a built workload holds no tokens
until a request's prompt is read, reads exactly what the synthesizer makes, and costs well
under a byte a token where a tuple of ints cost about 36.

Oracles: the synthesizer called by the test on the plan's skeletons, Python tuples, and
tracemalloc's count of the bytes allocated while building.
"""

from __future__ import annotations

import pickle
import tracemalloc

import numpy as np
import pytest

from engines.base import EngineRequest
from workloads.assemble import make_plan
from workloads.base import TaskInfo
from workloads.prompts import RECENT_PROMPTS, PromptIds
from workloads.registry import ModelTarget, WorkloadSpec, build_workload, workload_shape
from workloads.synth import HashBlockSynthesizer, Prompt

TARGET = ModelTarget(vocab_size=32000, max_model_len=10**6, special_ids=(0, 1, 2))


def expected(spec: WorkloadSpec) -> list[tuple[int, ...]]:
    plan = make_plan(spec, TARGET, workload_shape(spec))
    synthesizer = HashBlockSynthesizer(spec.seed, TARGET.vocab_size, TARGET.special_ids)
    return [tuple(synthesizer.token_ids(s).tolist()) for s in plan.skeletons]


def test_deferred_prompts_read_like_the_tuples_they_replace():
    spec = WorkloadSpec("rag_long", requests=30, scale=0.2, seed=5)
    requests = build_workload(spec, TARGET).requests
    want = expected(spec)
    assert all(isinstance(r.prompt_ids, PromptIds) and not r.prompt_ids.tokens_held for r in requests)
    for r, ids in zip(requests, want):
        p = r.prompt_ids
        assert len(p) == len(ids) == r.num_prompt_tokens and bool(p)
        assert p == ids and ids == p and not (p != ids) and p != ids[:-1] and p != list(ids)
        assert tuple(p) == ids and list(p) == list(ids) and hash(p) == hash(ids)
        assert p[0] == ids[0] and p[-1] == ids[-1] and p[3:17] == ids[3:17] and p[::7] == ids[::7]
        assert type(p[0]) is int and type(p[3:5]) is tuple
        assert np.asarray(p).tolist() == list(ids)
        assert p + (5,) == ids + (5,) and (5,) + p == (5,) + ids
        assert ids[5] in p and p.index(ids[5]) == ids.index(ids[5])
        assert pickle.loads(pickle.dumps(p)) == ids
        assert EngineRequest(r.request_id, tuple(p), r.max_new_tokens).prompt_ids == ids
    with pytest.raises(IndexError):
        requests[0].prompt_ids[len(want[0])]


def test_only_the_last_few_prompts_read_keep_their_tokens():
    requests = build_workload(WorkloadSpec("rag_long", requests=3 * RECENT_PROMPTS, scale=0.1), TARGET).requests
    for r in requests:
        tuple(r.prompt_ids)
    held = [r.prompt_ids.tokens_held for r in requests]
    assert held == [False] * (2 * RECENT_PROMPTS) + [True] * RECENT_PROMPTS
    assert requests[0].prompt_ids == requests[0].prompt_ids  # read again: made again, the same


def test_building_2000_rag_requests_costs_under_a_byte_a_token():
    """tracemalloc counts numpy's buffers too; a tuple of ints would be ~36 bytes a token."""
    spec = WorkloadSpec("rag_long", requests=2000)
    build_workload(WorkloadSpec("rag_long", requests=5), TARGET)  # imports and caches, outside the count
    tracemalloc.start()
    try:
        workload = build_workload(spec, TARGET)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    tokens = sum(r.num_prompt_tokens for r in workload.requests)
    assert tokens > 5_000_000  # ~3k tokens a request
    assert peak / tokens < 1.0, f"{peak / tokens:.2f} bytes a token"


class TaskSynth:
    """A synthesizer that is not deferrable (it sets tasks): run at build time, ids kept as int32."""

    def synthesize(self, skeleton):
        ids = tuple((skeleton.index * 7 + t) % 1000 + 3 for t in range(skeleton.input_tokens))
        return Prompt(ids, TaskInfo("copy", f"answer-{skeleton.index}"))


def test_other_synthesizers_run_at_build_and_are_held_as_int32():
    spec = WorkloadSpec("offline_batch", requests=5, input_range=(20, 60))
    workload = build_workload(spec, TARGET, TaskSynth())
    plan = make_plan(spec, TARGET, workload_shape(spec))
    for r, s in zip(workload.requests, plan.skeletons):
        assert r.prompt_ids == TaskSynth().synthesize(s).ids
        assert r.task == TaskInfo("copy", f"answer-{s.index}")
        assert not r.prompt_ids.deferred_tokens and np.asarray(r.prompt_ids).dtype == np.int32


def test_stored_ids_too_wide_for_int32_stay_exact():
    ids = (0, 2**31, 2**40 + 3)
    assert PromptIds.stored(ids) == ids and np.asarray(PromptIds.stored(ids)).dtype == np.int64

"""rag_long --direct-share: a share of the requests are direct questions outside the RAG
pipeline. Oracles: the real RAGPulse user-input lengths, the same workload without the
option (its RAG sessions must come back unchanged, in order), the demo book of facts."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from workloads.base import WorkloadError
from workloads.demo.language import BOS_ID, demo_language
from workloads.demo.synth import DemoTaskSynthesizer
from workloads.registry import ModelTarget, WorkloadSpec, build_workload

TARGET = ModelTarget(vocab_size=1000, max_model_len=10**6, special_ids=(0, 1, 2))


def is_direct(r) -> bool:
    return r.session_id.startswith("rag_long-d")


def test_the_share_of_requests_and_their_lengths_follow_ragpulse_user_inputs(real_trace):
    requests = build_workload(WorkloadSpec("rag_long", requests=3000, seed=2, direct_share=0.4), TARGET).requests
    direct = [r for r in requests if is_direct(r)]
    assert len(direct) / len(requests) == pytest.approx(0.4, abs=0.04)
    assert all(r.turn == 0 and len(r.prefix_blocks) == 1 for r in direct)  # one question, one session each
    real = pd.read_json(real_trace("ragpulse/4_user_input.jsonl"), lines=True)["token_length"]
    ours = np.array([r.num_prompt_tokens for r in direct])
    for q in (0.25, 0.5, 0.75, 0.9):
        assert np.quantile(ours, q) == pytest.approx(real.quantile(q), abs=1.5), q


def test_the_rag_sessions_are_the_same_with_and_without_direct_questions():
    def rag(spec: WorkloadSpec):
        return [(r.session_id, r.turn, r.prefix_blocks, r.block_lengths, r.num_prompt_tokens, r.max_new_tokens)
                for r in build_workload(spec, TARGET).requests if not is_direct(r)]

    # the same request count: the passage and template pools are sized from it
    without = rag(WorkloadSpec("rag_long", requests=400, seed=4, arrival="offline"))
    mixed = rag(WorkloadSpec("rag_long", requests=400, seed=4, arrival="offline", direct_share=0.5))
    n = min(len(without), len(mixed)) - 10  # the last sessions may be cut short differently
    assert n > 100
    strip = [(re.sub(r"-s(\d+)$", "", s), *rest) for s, *rest in without[:n]]
    assert [(re.sub(r"-s(\d+)$", "", s), *rest) for s, *rest in mixed[:n]] == strip


def test_on_the_demo_model_a_direct_question_is_a_closed_book_question_alone():
    lang = demo_language()
    target = ModelTarget(len(lang.vocab), 2048, (0, 1, 2, 3))
    spec = WorkloadSpec("rag_long", requests=60, seed=1, scale=0.25, direct_share=0.5)
    requests = build_workload(spec, target, DemoTaskSynthesizer(1, "rag")).requests
    direct = [r for r in requests if is_direct(r)]
    assert len(direct) > 10
    book = lang.book_facts
    for r in direct:
        assert r.prompt_ids[0] == BOS_ID and r.task.task == "closed_book"
        words = lang.decode(list(r.prompt_ids[1:])).split()
        assert words[:3] == ["question", ":", "the"] and words[4] == "of" and len(words) == 7
        entity = " ".join(words[5:])
        assert book[(entity, words[3])] == r.task.answer


@pytest.mark.parametrize("options, field", [
    ({"name": "rag_long", "direct_share": 1.0}, "direct_share"),
    ({"name": "rag_long", "direct_share": -0.1}, "direct_share"),
    ({"name": "long_chat", "direct_share": 0.3}, "direct_share"),
])
def test_bad_direct_shares_name_the_field(options, field):
    with pytest.raises(WorkloadError, match=field):
        WorkloadSpec(**options)

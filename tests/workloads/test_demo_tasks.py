"""Demo tasks and the demo synthesizer: every question is answerable from exactly one stated
fact (checked by parsing the prompt text), lengths and block sharing follow the skeleton."""

from __future__ import annotations

import random
import re

import pytest

from workloads.demo.language import BOS_ID, demo_language
from workloads.demo.synth import DemoTaskSynthesizer
from workloads.demo.tasks import chat_recall, closed_book, copy_task, make_sample, rag_recall, score
from workloads.registry import ModelTarget, WorkloadSpec, build_workload

FACT = re.compile(r"the (\w+) of (\w+) (\w+) \.")
QUESTION = re.compile(r"(?:question|user) : the (\w+) of (\w+(?: \w+)?)$")


def stated(text: str) -> list[tuple[str, str, str]]:
    return FACT.findall(text)


@pytest.mark.parametrize("make", [rag_recall, chat_recall])
@pytest.mark.parametrize("seed", range(5))
def test_recall_answer_is_stated_exactly_once(make, seed):
    lang = demo_language()
    sample = make(random.Random(seed), 16, 512)
    attr, entity = QUESTION.findall(sample.prompt)[-1]
    matches = [v for a, e, v in stated(sample.context) if (a, e) == (attr, entity)]
    assert matches == [sample.answer]
    assert sum(1 for _, e, _ in stated(sample.context) if e == entity) == 1  # entity unique per prompt
    assert 480 <= len(sample.prompt.split()) <= 540
    assert all(w in lang.token_to_id for w in sample.prompt.split())


@pytest.mark.parametrize("make", [rag_recall, chat_recall])
def test_one_attribute_prompts_differ_only_by_entity(make):
    """The probe's "all facts about one attribute" prompts (only the entity tells facts apart);
    without `attributes` facts mix attributes."""
    sample = make(random.Random(4), 16, 512, attributes=("city",))
    facts = stated(sample.context)
    assert len(facts) == 16 and {a for a, _, _ in facts} == {"city"}
    assert len({e for _, e, _ in facts}) == 16
    attr, entity = QUESTION.findall(sample.prompt)[-1]
    assert attr == "city" and [v for _, e, v in facts if e == entity] == [sample.answer]
    assert len({a for a, _, _ in stated(make(random.Random(4), 16, 512).context)}) > 1


def test_closed_book_and_copy_answers():
    facts = demo_language().book_facts
    s = closed_book(random.Random(1), 20)
    for question, answer in s.qa:
        attr, entity = QUESTION.findall(question)[0]
        assert facts[(entity, attr)] == answer
    c = copy_task(random.Random(2), 9)
    assert c.prompt.split()[2:11] == c.answer.split()
    with pytest.raises(ValueError, match="known"):
        make_sample("nope", random.Random(0))


def test_score_is_exact_match():
    assert score(" red ", "red") and not score("red .", "red") and not score("Red", "red")


@pytest.mark.parametrize("name, style", [("rag_long", "rag"), ("long_chat", "chat")])
def test_synthesizer_on_workload_shapes(name, style):
    lang = demo_language()
    target = ModelTarget(len(lang.vocab), 2048, (0, 1, 2, 3))
    spec = WorkloadSpec(name, seed=3, requests=30, scale=0.1)
    workload = build_workload(spec, target, DemoTaskSynthesizer(3, style))
    again = build_workload(spec, target, DemoTaskSynthesizer(3, style))
    assert [r.prompt_ids for r in workload.requests] == [r.prompt_ids for r in again.requests]
    plain = build_workload(spec, target)  # the same shapes with hash content
    tasks = set()
    for req, ref in zip(workload.requests, plain.requests):
        assert len(req.prompt_ids) == len(ref.prompt_ids) and req.prompt_ids[0] == BOS_ID
        text = lang.decode(list(req.prompt_ids))
        attr, entity = QUESTION.findall(text)[-1]
        tasks.add(req.task.task)
        if req.task.task == "closed_book":
            assert lang.book_facts[(entity, attr)] == req.task.answer
        else:
            context = text[: text.rindex(" : the ")]
            assert [v for a, e, v in stated(context) if (a, e) == (attr, entity)] == [req.task.answer]
    assert tasks & {"rag_recall", "chat_recall"}
    # Equal block ids give equal tokens wherever the block appears in full.
    seen: dict[int, tuple[int, ...]] = {}
    for req in workload.requests:
        pos = 1
        lengths = req.block_lengths or (req.block_tokens,) * len(req.prefix_blocks)
        for block, n in zip(req.prefix_blocks, lengths):
            if pos + n <= len(req.prompt_ids) - 15:
                toks = req.prompt_ids[pos : pos + n]
                assert seen.setdefault(block, toks) == toks
            pos += n

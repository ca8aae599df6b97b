"""Scheduler and block allocator: budgets, chunking, preemption order, blocks returned."""

from __future__ import annotations

import pytest

from engines.base import EngineRequest
from engines.runtime.kv_cache import BlockAllocator
from engines.runtime.scheduler import Scheduler, Sequence


def seq(rid: str, n_prompt: int, max_new: int = 8) -> Sequence:
    ids = list(range(n_prompt))
    return Sequence(EngineRequest(rid, tuple(ids), max_new), ids, n_prompt)


def run_plan(plan, token=1):
    """Apply a plan the way the engine does: compute chunks, append a token when sampled."""
    for c in plan.decodes + plan.prefills:
        sampled = c.samples
        c.seq.num_computed += c.length
        if sampled:
            c.seq.token_ids.append(token)


def test_allocator_slots_and_free():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    alloc.grow("a", 6)
    assert alloc.tables["a"] == [0, 1] and alloc.num_free == 2
    assert alloc.slots("a", 3, 3) == [3, 4, 5]
    assert alloc.tokens_fitting("a", 6) == 10
    assert not alloc.can_grow("b", 13)
    alloc.free("a")
    assert alloc.num_free == 4 and "a" not in alloc.tables
    with pytest.raises(MemoryError):
        alloc.grow("b", 17)


def test_chunked_prefill_under_token_budget():
    sched = Scheduler(BlockAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq("a", 7), seq("b", 12)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [(c.seq.id, c.start, c.length) for c in plan.prefills] == [("a", 0, 7), ("b", 0, 3)]
    run_plan(plan)
    plan = sched.schedule()  # a decodes (1), b continues its prompt with the other 9
    assert [(c.seq.id, c.length) for c in plan.decodes] == [("a", 1)]
    assert [(c.seq.id, c.start, c.length, c.samples) for c in plan.prefills] == [("b", 3, 9, True)]


def test_max_num_seqs():
    sched = Scheduler(BlockAllocator(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(seq(str(i), 2))
    plan = sched.schedule()
    assert [c.seq.id for c in plan.prefills] == ["0", "1"] and len(sched.waiting) == 1


def test_preempts_newest_and_requeues_it_first():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = seq("a", 4), seq("b", 4)
    sched.add(a)
    sched.add(b)
    run_plan(sched.schedule())  # both prompts (2 blocks each); both now need a 3rd block
    plan = sched.schedule()
    assert [s.id for s in plan.preempted] == ["b"]
    assert [c.seq.id for c in plan.decodes] == ["a"]
    assert b.num_computed == 0 and list(sched.waiting) == [b] and "b" not in alloc.tables


def test_waits_for_blocks_instead_of_admitting_a_sliver():
    alloc = BlockAllocator(num_blocks=3, block_size=4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(seq("a", 8))
    sched.add(seq("b", 9))
    plan = sched.schedule()
    assert [c.seq.id for c in plan.prefills] == ["a"] and len(sched.waiting) == 1


def test_remove_frees_blocks():
    alloc = BlockAllocator(8, 4)
    sched = Scheduler(alloc, 8, 100)
    sched.add(seq("a", 9))
    run_plan(sched.schedule())
    assert alloc.num_free == 5
    assert sched.remove("a") is not None and alloc.num_free == 8 and not sched.has_work()

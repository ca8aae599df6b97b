"""The memory home: KV sizing (engines/runtime/memory.py) and an allocator capacity that can
be lowered and raised between steps, with the scheduler preempting newest-first to honour it."""

from __future__ import annotations

import pytest
import torch

from engines.base import EngineError, EngineRequest
from engines.runtime.kv_cache import BlockAllocator, PagedKVCache
from engines.runtime.memory import CPU_KV_BYTES, KVSizing, kv_cache_blocks
from engines.runtime.scheduler import Scheduler, Sequence

CPU = torch.device("cpu")


def seq(rid: str, n_prompt: int) -> Sequence:
    ids = list(range(n_prompt))
    return Sequence(EngineRequest(rid, tuple(ids), 8), ids, n_prompt)


def admit(sched: Scheduler) -> None:
    """Run one plan the way the engine does (compute the chunks, append a sampled token)."""
    for c in sched.schedule().prefills:
        c.seq.num_computed += c.length
        if c.samples:
            c.seq.token_ids.append(1)


def sizing(**kw) -> KVSizing:
    base = dict(block_size=16, kv_cache_gb=None, kv_blocks=None, gpu_memory_utilization=0.9, max_num_seqs=4,
                max_model_len=100)
    return KVSizing(**{**base, **kw})


def test_kv_sizing_by_hand():
    # 2 layers x 16 tokens x 2 KV heads x 8 dims x 2 (K and V) x 4 bytes = 4096 bytes a block.
    block = PagedKVCache.bytes_per_block(2, 16, 2, 8, torch.float32)
    assert block == 4096
    # 4 sequences of at most 100 tokens use at most 4 x ceil(100 / 16) = 28 blocks.
    assert kv_cache_blocks(sizing(), block, CPU) == 28
    assert kv_cache_blocks(sizing(max_num_seqs=10_000, max_model_len=10_000), block, CPU) == CPU_KV_BYTES // 4096
    assert kv_cache_blocks(sizing(kv_cache_gb=40 * 4096 / 2**30, max_num_seqs=100), block, CPU) == 40
    assert kv_cache_blocks(sizing(kv_blocks=5), block, CPU) == 5  # exact count wins
    with pytest.raises(EngineError, match="cannot hold one block of 4096 bytes"):
        kv_cache_blocks(sizing(kv_cache_gb=1000 / 2**30), block, CPU)


def test_capacity_lowered_and_raised():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    alloc.grow("a", 12)  # 3 blocks
    alloc.set_capacity(5)
    assert (alloc.num_used, alloc.num_free, alloc.over_capacity) == (3, 2, 0)
    assert alloc.can_grow("b", 8) and not alloc.can_grow("b", 9)  # 2 blocks fit, 3 do not
    assert alloc.tokens_fitting("a", 12) == 8
    with pytest.raises(MemoryError, match="needs 3 blocks, 2 free"):
        alloc.grow("b", 9)
    alloc.set_capacity(2)
    assert (alloc.num_free, alloc.over_capacity) == (0, 1)
    alloc.set_capacity(8)
    assert (alloc.num_free, alloc.over_capacity) == (5, 0)
    for bad in (-1, 9):
        with pytest.raises(ValueError, match=r"within \[0, 8\]"):
            alloc.set_capacity(bad)


def test_scheduler_preempts_newest_when_capacity_drops_below_use():
    alloc = BlockAllocator(num_blocks=12, block_size=4)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = seq("a", 8), seq("b", 8), seq("c", 8)  # 2 blocks each, then a 3rd for the new token
    for s in (a, b, c):
        sched.add(s)
    admit(sched)
    assert alloc.num_used == 6
    alloc.set_capacity(4)  # 2 blocks too many: c (newest) goes first, then b
    plan = sched.schedule()
    assert [s.id for s in plan.preempted] == ["c", "b"]
    assert [ch.seq.id for ch in plan.decodes] == ["a"] and alloc.num_used == 3
    assert list(sched.waiting) == [b, c] and b.num_computed == c.num_computed == 0
    alloc.set_capacity(12)  # raised again: both come back, oldest first, as recomputes
    plan = sched.schedule()
    assert [(ch.seq.id, ch.start, ch.length) for ch in plan.prefills] == [("b", 0, 9), ("c", 0, 9)]

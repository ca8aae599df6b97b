"""Prefix cache in the block allocator and the scheduler, by hand-built cases (no model).

Allocator cases name every block id, so the expected tables, reference counts and eviction
order are written out. The scheduler oracle is a simulated KV memory: a computed position
p of a sequence writes "the K/V of token_ids[:p+1]" into its slot, and after every step each
sequence's computed positions must read back exactly that through its block table, which
fails if a shared block were written or a cached prefix attached to the wrong sequence.
"""

from __future__ import annotations

import random

import pytest

from engines.base import EngineRequest
from engines.runtime.kv_cache import BlockAllocator, block_hash
from engines.runtime.scheduler import Scheduler, Sequence

B = 4


def hashes(ids: list[int]) -> list[int]:
    """Chain keys of the full blocks of `ids`, written out independently of the scheduler."""
    out: list[int] = []
    for i in range(len(ids) // B):
        out.append(block_hash(out[-1] if out else None, ids[i * B : (i + 1) * B]))
    return out


def filled(alloc: BlockAllocator, seq_id: str, ids: list[int]) -> list[int]:
    """Give `seq_id` blocks for `ids` and register its full ones, as if computed."""
    alloc.grow(seq_id, len(ids))
    for i, h in enumerate(hashes(ids)):
        alloc.register(seq_id, i, h)
    return alloc.tables[seq_id]


def test_block_hash_chains_the_prefix():
    a, b = block_hash(None, [1, 2, 3, 4]), block_hash(None, [1, 2, 3, 5])
    assert a == block_hash(None, (1, 2, 3, 4)) and a != b
    # The same tokens after a different first block are a different block.
    assert block_hash(a, [9, 9, 9, 9]) != block_hash(b, [9, 9, 9, 9])
    assert block_hash(a, [9, 9, 9, 9]) == block_hash(block_hash(None, [1, 2, 3, 4]), [9, 9, 9, 9])


def test_shared_blocks_are_reference_counted_and_cached_when_released():
    alloc = BlockAllocator(num_blocks=6, block_size=B)
    ids = list(range(10, 20))  # 2 full blocks + 2 tokens
    assert filled(alloc, "a", ids) == [0, 1, 2]
    h = hashes(ids)
    assert alloc.lookup(h) == [0, 1] and alloc.lookup([h[0], 12345, h[1]]) == [0]
    alloc.attach("b", [0, 1])
    alloc.attach("c", [0])
    assert [alloc.ref_count(x) for x in (0, 1, 2)] == [3, 2, 1]
    assert (alloc.num_used, alloc.num_held, alloc.num_cached, alloc.num_free) == (3, 3, 0, 3)
    alloc.free("a")  # block 2 was never full: back to the free list; 0 and 1 are still held
    assert (alloc.num_used, alloc.num_cached, alloc.registered_hash(2)) == (2, 0, None)
    alloc.free("b")  # block 1: nobody holds it, it stays cached
    assert (alloc.num_used, alloc.num_held, alloc.num_cached, alloc.num_free) == (1, 2, 1, 5)
    alloc.free("c")
    assert (alloc.num_used, alloc.num_held, alloc.num_cached, alloc.num_free) == (0, 2, 2, 6)
    assert alloc.lookup(h) == [0, 1]
    alloc.attach("d", [0, 1])  # a cached block taken back leaves the evictable set
    assert (alloc.num_used, alloc.num_cached, alloc.num_free) == (2, 0, 4)
    with pytest.raises(ValueError, match="already has blocks"):
        alloc.attach("d", [0])
    with pytest.raises(ValueError, match=r"blocks \[5\] are not in the prefix cache"):
        alloc.attach("e", [0, 5])


def test_free_blocks_first_then_least_recently_used_cached_tail_first():
    alloc = BlockAllocator(num_blocks=7, block_size=B)
    x = filled(alloc, "x", list(range(12)))  # blocks 0 1 2, all full
    y = filled(alloc, "y", list(range(100, 108)))  # blocks 3 4
    alloc.free("x")  # released first: evicted first, its last block before its first
    alloc.free("y")
    assert (x, y, alloc.num_cached, alloc.num_free) == ([0, 1, 2], [3, 4], 5, 7)
    alloc.grow("z", 8)  # two never-used blocks (5, 6) before any cached one
    assert alloc.tables["z"] == [5, 6] and alloc.num_cached == 5
    alloc.grow("z", 16)  # then x's blocks, tail first
    assert alloc.tables["z"] == [5, 6, 2, 1] and alloc.num_cached == 3
    assert alloc.registered_hash(2) is None and alloc.lookup(hashes(list(range(12)))) == [0]
    alloc.attach("w", alloc.lookup(hashes(list(range(100, 108)))))  # touching y's blocks ...
    alloc.free("w")  # ... makes them the most recently used: x's head goes next
    alloc.grow("z", 20)
    assert alloc.tables["z"][-1] == 0 and alloc.lookup(hashes(list(range(100, 108)))) == [3, 4]


def test_a_duplicate_block_stays_private():
    alloc = BlockAllocator(num_blocks=4, block_size=B)
    ids = [7, 7, 7, 7]
    filled(alloc, "a", ids)
    filled(alloc, "b", ids)  # computed the same block itself (e.g. in the same step as a)
    assert alloc.tables == {"a": [0], "b": [1]}
    assert alloc.lookup(hashes(ids)) == [0] and alloc.registered_hash(1) is None
    alloc.free("b")  # unregistered: back to the free list, not cached
    assert (alloc.num_cached, alloc.num_held) == (0, 1)


def test_capacity_bounds_cached_plus_used_and_drops_cached_first():
    alloc = BlockAllocator(num_blocks=8, block_size=B)
    filled(alloc, "a", list(range(8)))  # blocks 0 1
    filled(alloc, "b", list(range(50, 62)))  # blocks 2 3 4
    alloc.free("b")
    assert (alloc.num_used, alloc.num_cached, alloc.num_free) == (2, 3, 6)
    alloc.set_capacity(4)  # 5 held: one cached block dropped (b's last, the least useful)
    assert (alloc.num_held, alloc.num_cached, alloc.num_free, alloc.over_capacity) == (4, 2, 2, 0)
    assert alloc.lookup(hashes(list(range(50, 62)))) == [2, 3]
    # At the capacity, growing takes a cached block rather than a free one beyond it.
    alloc.grow("c", 4)
    assert (alloc.num_held, alloc.num_cached, alloc.tables["c"]) == (4, 1, [3])
    assert alloc.tokens_fitting("c", 4) == 4 and not alloc.can_grow("c", 9)
    alloc.set_capacity(1)  # every cached block goes; the rest is the scheduler's to preempt
    assert (alloc.num_held, alloc.num_cached, alloc.num_free, alloc.over_capacity) == (3, 0, 0, 2)
    alloc.free("a")  # released over the capacity: not kept
    assert (alloc.num_held, alloc.num_cached, alloc.over_capacity) == (1, 0, 0)
    alloc.set_capacity(8)
    assert alloc.num_free == 7


# -- the scheduler -----------------------------------------------------------------------------


def seq(rid: str, ids: list[int], caching: bool = True, max_new: int = 4, prompt_logits: bool = False) -> Sequence:
    request = EngineRequest(rid, tuple(ids), max_new, return_prompt_logits=prompt_logits)
    return Sequence(request, list(ids), len(ids), prefix_caching=caching)


class SimulatedKV:
    """A KV memory by slot: a computed position holds the prefix it was computed from."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.slots = sched, {}
        self.writes_to_shared = 0

    def step(self) -> tuple[list, int]:
        """One schedule + compute + sample; returns (plan, tokens computed)."""
        sched, alloc = self.sched, self.sched.allocator
        plan = sched.schedule()
        chunks = plan.decodes + plan.prefills
        for c in chunks:
            table = alloc.tables[c.seq.id]
            for p in range(c.start, c.start + c.length):
                block = table[p // B]
                # A block another table holds, or one registered, is never written again.
                self.writes_to_shared += alloc.ref_count(block) > 1 or alloc.registered_hash(block) is not None
                self.slots[block * B + p % B] = tuple(c.seq.token_ids[: p + 1])
        for c in chunks:
            c.seq.num_computed += c.length
            sched.register_computed(c.seq)
        for c in chunks:
            if c.samples:  # a "greedy" token: a function of the whole context
                c.seq.token_ids.append(sum(c.seq.token_ids) * 31 % 17)
                if c.seq.num_generated >= c.seq.request.max_new_tokens:
                    sched.remove(c.seq.id)
        return plan, sum(c.length for c in chunks)

    def check(self) -> None:
        alloc = self.sched.allocator
        holders: dict[int, int] = {}
        for s in self.sched.running:
            table = alloc.tables[s.id]
            for p in range(s.num_computed):
                assert self.slots[table[p // B] * B + p % B] == tuple(s.token_ids[: p + 1]), (s.id, p)
            for i, block in enumerate(table):
                holders[block] = holders.get(block, 0) + 1
                if alloc.registered_hash(block) is not None:  # shared or shareable: full and computed
                    assert (i + 1) * B <= s.num_computed
        assert holders == {b: alloc.ref_count(b) for b in range(alloc.num_blocks) if alloc.ref_count(b)}
        assert alloc.num_used == len(holders) and alloc.num_held == alloc.num_used + alloc.num_cached


def run(seqs: list[Sequence], num_blocks: int, budget: int, capacity_dip: tuple[int, int] | None = None):
    """Drive `seqs` to the end; returns (their tokens, cached tokens, computed tokens, preemptions)."""
    alloc = BlockAllocator(num_blocks, B)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=budget)
    kv = SimulatedKV(sched)
    for s in seqs:
        sched.add(s)
    cached = computed = preempted = steps = 0
    while sched.has_work():
        if capacity_dip is not None:
            alloc.set_capacity(capacity_dip[1] if steps == capacity_dip[0] else num_blocks)
        plan, n = kv.step()
        kv.check()
        cached, computed, preempted = cached + plan.cached_tokens, computed + n, preempted + len(plan.preempted)
        steps += 1
        assert steps < 10_000
    assert kv.writes_to_shared == 0
    assert alloc.num_used == 0 and alloc.num_free == num_blocks
    return {s.id: s.token_ids[s.num_prompt :] for s in seqs}, cached, computed, preempted


def workload(rng: random.Random, caching: bool) -> list[Sequence]:
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(5, 14))] for _ in range(3)]
    out = []
    for i in range(12):
        ids = list(prefixes[i % 3]) + [rng.randrange(50) for _ in range(rng.randrange(0, 4))]
        out.append(seq(f"s{i}", ids, caching, max_new=rng.randrange(1, 9), prompt_logits=i == 5))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_scheduler_shares_prefixes_without_corrupting_kv(seed):
    """Sequences with shared prefixes, a KV pool small enough to preempt and a capacity dip:
    the same tokens as without caching, fewer tokens computed, every K/V read back intact."""
    on = run(workload(random.Random(seed), True), num_blocks=14, budget=9, capacity_dip=(6, 5))
    off = run(workload(random.Random(seed), False), num_blocks=14, budget=9, capacity_dip=(6, 5))
    assert on[0] == off[0]
    assert on[1] > 0 and off[1] == 0
    assert on[3] > 0, "the pool no longer forces preemption with caching on"
    assert on[2] < off[2]


def test_admission_takes_the_cached_prefix_but_leaves_the_last_token():
    alloc = BlockAllocator(16, B)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=100)
    kv = SimulatedKV(sched)
    first = list(range(1, 11))  # 10 tokens: blocks [1..4] [5..8] registered, [9 10] partial
    sched.add(seq("a", first, max_new=1))
    kv.step()
    assert not sched.has_work() and alloc.num_cached == 2
    sched.add(seq("b", first[:8] + [42]))  # 2 blocks from the cache
    sched.add(seq("c", first[:8]))  # exactly 2 blocks: only 1 taken, the last token is computed
    sched.add(seq("d", first[:8] + [42], prompt_logits=True))  # needs every prompt position computed
    sched.add(seq("e", [99] + first[1:8], caching=False))  # off: neither reads nor registers
    plan, _ = kv.step()
    kv.check()
    assert [(c.seq.id, c.start, c.length) for c in plan.prefills] == [
        ("b", 8, 1), ("c", 4, 4), ("d", 0, 9), ("e", 0, 8)
    ]
    assert plan.cached_tokens == 8 + 4
    b, c, d, e = (alloc.tables[x] for x in "bcde")
    assert b[:2] == [0, 1] and c[:1] == [0] and c[1] != 1 and d[0] not in (0, 1)
    assert alloc.ref_count(0) == 2 and alloc.ref_count(1) == 1
    assert all(alloc.registered_hash(x) is None for x in e)
    # d computed its first two blocks itself; a's are registered under those hashes, so d's
    # copies stay private (and go back to the free list when d ends).
    assert alloc.registered_hash(d[0]) is None and alloc.registered_hash(d[1]) is None


def test_prompt_logits_request_registers_blocks_for_others():
    alloc = BlockAllocator(16, B)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=100)
    kv = SimulatedKV(sched)
    ids = list(range(20, 29))
    sched.add(seq("p", ids, max_new=1, prompt_logits=True))
    plan, _ = kv.step()
    assert plan.cached_tokens == 0 and alloc.num_cached == 2
    sched.add(seq("q", ids))
    plan, _ = kv.step()
    kv.check()
    assert plan.cached_tokens == 8 and [(c.start, c.length) for c in plan.prefills] == [(8, 1)]


def test_preempted_sequence_recomputes_from_its_own_cached_blocks():
    alloc = BlockAllocator(6, B)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=100)
    kv = SimulatedKV(sched)
    a, b = seq("a", list(range(8)), max_new=8), seq("b", list(range(30, 38)), max_new=8)
    sched.add(a)
    sched.add(b)
    kv.step()  # 2 full blocks each, registered; each has sampled its first token
    alloc.set_capacity(4)
    plan, _ = kv.step()  # a's decode needs a 3rd block: b (newest) is preempted, its blocks
    # cached, and a's new block is b's tail (the least useful cached block) at the capacity
    kv.check()
    assert plan.preempted == [b] and alloc.num_cached == 1 and alloc.num_held == 4
    assert alloc.lookup(hashes(b.token_ids)) == [alloc.lookup(hashes(b.token_ids))[0]]
    plan, _ = kv.step()  # b waits: its head block is cached but nothing else fits
    assert list(sched.waiting) == [b] and plan.cached_tokens == 0
    alloc.set_capacity(6)
    plan, _ = kv.step()
    kv.check()
    # The recompute starts after b's cached head block and keeps b's sampled token.
    assert plan.cached_tokens == B and [(c.seq.id, c.start, c.length) for c in plan.prefills] == [("b", 4, 5)]


def test_preempted_sequence_with_no_cached_blocks_left_registers_them_again():
    alloc = BlockAllocator(6, B)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=100)
    kv = SimulatedKV(sched)
    a, b = seq("a", list(range(8)), max_new=8), seq("b", list(range(30, 38)), max_new=8)
    sched.add(a)
    sched.add(b)
    kv.step()
    alloc.set_capacity(3)  # b preempted; its cached blocks make way for the capacity and a's growth
    plan, _ = kv.step()
    assert plan.preempted == [b] and alloc.lookup(hashes(b.token_ids)) == []
    alloc.set_capacity(6)
    plan, _ = kv.step()
    kv.check()
    assert plan.cached_tokens == 0 and [(c.seq.id, c.start) for c in plan.prefills] == [("b", 0)]
    assert len(alloc.lookup(hashes(b.token_ids))) == 2  # the recompute's full blocks are shareable again


def test_cached_blocks_a_prefix_would_take_back_are_not_counted_as_free():
    """A sequence is admitted only if the rest of its prompt fits once its cached prefix blocks
    are held: they count in num_free until then, and cannot pay for its other blocks."""
    alloc = BlockAllocator(4, B)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=100)
    kv = SimulatedKV(sched)
    sched.add(seq("a", list(range(8)), max_new=1))
    kv.step()  # a done: 2 cached blocks
    sched.add(seq("c", [90, 91, 92], max_new=4))
    kv.step()  # c holds 1 block: 3 free, 2 of them a's cached blocks
    sched.add(seq("b", list(range(8)) + [50, 51, 52, 53, 54]))  # 8 cached + 5 to compute (2 blocks)
    plan, _ = kv.step()
    assert [c.seq.id for c in plan.prefills] == [] and [s.id for s in sched.waiting] == ["b"]
    assert alloc.num_free == 3 and alloc.num_cached == 2


def test_drop_cached_forgets_every_prefix_and_keeps_blocks_in_use():
    alloc = BlockAllocator(num_blocks=6, block_size=2)
    alloc.grow("a", 4)
    alloc.register("a", 0, 11)
    alloc.register("a", 1, 12)
    alloc.grow("b", 2)
    alloc.register("b", 0, 21)
    alloc.free("a")  # a's two registered blocks are now cached
    assert alloc.num_cached == 2 and alloc.lookup([11, 12]) == alloc.lookup([11, 12]) != []
    assert alloc.drop_cached() == 2
    assert alloc.num_cached == 0 and alloc.lookup([11]) == [] and alloc.lookup([21]) == []
    assert alloc.num_used == 1 and alloc.num_free == 5  # b keeps its block; the rest can be taken
    alloc.grow("c", 10)  # every block but b's
    assert alloc.num_free == 0

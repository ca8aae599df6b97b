"""Continuous-batching scheduler: which tokens of which sequences run in the next step.

Policy (first come, first served), each step:
  0. if the KV capacity was lowered below the blocks in use, the most recently admitted
     sequences are preempted until it holds again;
  1. every running sequence with one pending token decodes it; if the KV cache cannot grow,
     the most recently admitted sequences are preempted (blocks freed, recomputed later);
  2. the remaining token budget goes to prefill chunks: first sequences already mid-prompt,
     then new ones from the waiting queue while `max_num_seqs` and the KV cache allow.
A sequence's pending tokens are everything after `num_computed`, so a prompt chunk, a decode
and the recompute of a preempted sequence are the same operation. Pure Python, no torch.

Prefix caching (per sequence, `prefix_caching`): on admission a sequence starts from the
longest run of its leading full blocks already in the allocator's prefix cache (always
leaving one token to compute, whose logits give the next token), and after each step the
engine calls `register_computed` so that blocks it filled can serve later sequences.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engines.base import EngineRequest
from engines.runtime.kv_cache import BlockAllocator, block_hash


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    token_ids: list[int]
    num_prompt: int
    num_computed: int = 0  # tokens whose K/V are in the cache
    state: object = None  # engine-owned per-sequence state (sampling generator, logits, ...)
    finish_reason: str | None = None
    # Share full blocks through the prefix cache: register them, and start from cached ones on
    # admission (unless the request wants prompt logits, which need every position computed).
    prefix_caching: bool = False
    prompt_started: bool = False  # a prompt chunk of it has run (the engine's `started`, once)
    # Prefix-cache keys of its leading full blocks, hashed as needed (token ids never change,
    # so they survive preemption), and how many leading blocks of its table were registered
    # or attached from the cache.
    block_hashes: list[int] = field(default_factory=list)
    num_registered: int = 0

    @property
    def id(self) -> str:
        return self.request.request_id

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt


@dataclass(frozen=True)
class Chunk:
    seq: Sequence
    start: int  # first position computed
    length: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's end, so its last row yields a new token."""
        return self.start + self.length == len(self.seq.token_ids)


@dataclass
class Schedule:
    decodes: list[Chunk] = field(default_factory=list)
    prefills: list[Chunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    cached_tokens: int = 0  # tokens of admitted sequences whose K/V came from the prefix cache

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.decodes + self.prefills)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq_id: str) -> Sequence | None:
        """Take a sequence out (finished or aborted) and free its blocks."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.id == seq_id:
                    queue.remove(seq)
                    self.allocator.free(seq_id)
                    return seq
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence, plan: Schedule) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.id)
        seq.num_computed = seq.num_registered = 0
        plan.preempted.append(seq)

    def schedule(self) -> Schedule:
        plan = Schedule()
        alloc = self.allocator
        budget = self.max_num_batched_tokens
        while alloc.over_capacity and self.running:
            self._preempt(self.running[-1], plan)
        # A sequence leaves `running` here only through _preempt, into plan.preempted (short,
        # mostly empty): asking it spares a scan of `running` per sequence.
        preempted = plan.preempted
        for seq in list(self.running):
            if seq.num_pending != 1 or budget == 0 or seq in preempted:
                continue
            while not alloc.can_grow(seq.id, len(seq.token_ids)):
                self._preempt(self.running[-1], plan)
                if seq in preempted:
                    break
            if seq not in preempted:
                alloc.grow(seq.id, len(seq.token_ids))
                plan.decodes.append(Chunk(seq, seq.num_computed, 1))
                budget -= 1
        # Preempted sequences go back to the front of the queue, oldest first.
        # (preempted is newest first; extendleft reverses it, so the oldest ends up in front)
        self.waiting.extendleft(plan.preempted)
        for seq in self.running:
            if seq.num_pending > 1 and budget > 0:
                budget -= self._prefill(seq, budget, plan)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]  # no blocks, nothing computed (new, or preempted)
            hit = self._cached_prefix(seq)
            # Cached blocks nobody holds count as free until they are attached.
            fitting = (alloc.num_free - alloc.num_evictable(hit)) * alloc.block_size
            if fitting < min(seq.num_pending - len(hit) * alloc.block_size, budget):
                break  # wait for blocks rather than admit a sliver of a prompt
            self.waiting.popleft()
            self.running.append(seq)
            if hit:
                alloc.attach(seq.id, hit)
                seq.num_registered = len(hit)
                seq.num_computed = len(hit) * alloc.block_size
                plan.cached_tokens += seq.num_computed
            budget -= self._prefill(seq, budget, plan)
        return plan

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for `seq`'s leading full blocks, short of its last token (which is
        computed for its logits); none when it does not read the prefix cache."""
        if not seq.prefix_caching or seq.request.return_prompt_logits:
            return []
        return self.allocator.lookup(self._block_hashes(seq, (len(seq.token_ids) - 1) // self.allocator.block_size))

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The keys of `seq`'s first `num_blocks` full blocks, each hashed once."""
        B, hashes = self.allocator.block_size, seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else None, seq.token_ids[i * B : (i + 1) * B]))
        return hashes[:num_blocks]

    def register_computed(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that are now full of computed tokens (prompt or
        generated) in the prefix cache. Call after `num_computed` advanced."""
        full = seq.num_computed // self.allocator.block_size
        if not seq.prefix_caching or full <= seq.num_registered or seq.id not in self.allocator.tables:
            return
        hashes = self._block_hashes(seq, full)
        for i in range(seq.num_registered, full):
            self.allocator.register(seq.id, i, hashes[i])
        seq.num_registered = full

    def _prefill(self, seq: Sequence, budget: int, plan: Schedule) -> int:
        length = min(seq.num_pending, budget, self.allocator.tokens_fitting(seq.id, seq.num_computed))
        if length <= 0:
            return 0
        self.allocator.grow(seq.id, seq.num_computed + length)
        plan.prefills.append(Chunk(seq, seq.num_computed, length))
        return length

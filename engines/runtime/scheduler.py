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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engines.base import EngineRequest
from engines.runtime.kv_cache import BlockAllocator


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    token_ids: list[int]
    num_prompt: int
    num_computed: int = 0  # tokens whose K/V are in the cache
    state: object = None  # engine-owned per-sequence state (sampling generator, logits, ...)
    finish_reason: str | None = None

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
class Plan:
    decodes: list[Chunk] = field(default_factory=list)
    prefills: list[Chunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

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

    def _preempt(self, seq: Sequence, plan: Plan) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.id)
        seq.num_computed = 0
        plan.preempted.append(seq)

    def schedule(self) -> Plan:
        plan = Plan()
        alloc = self.allocator
        budget = self.max_num_batched_tokens
        while alloc.over_capacity and self.running:
            self._preempt(self.running[-1], plan)
        for seq in list(self.running):
            if seq not in self.running or seq.num_pending != 1 or budget == 0:
                continue
            while not alloc.can_grow(seq.id, len(seq.token_ids)):
                self._preempt(self.running[-1], plan)
                if seq not in self.running:
                    break
            if seq in self.running:
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
            seq = self.waiting[0]
            if alloc.tokens_fitting(seq.id, 0) < min(seq.num_pending, budget):
                break  # wait for blocks rather than admit a sliver of a prompt
            self.waiting.popleft()
            self.running.append(seq)
            budget -= self._prefill(seq, budget, plan)
        return plan

    def _prefill(self, seq: Sequence, budget: int, plan: Plan) -> int:
        length = min(seq.num_pending, budget, self.allocator.tokens_fitting(seq.id, seq.num_computed))
        if length <= 0:
            return 0
        self.allocator.grow(seq.id, seq.num_computed + length)
        plan.prefills.append(Chunk(seq, seq.num_computed, length))
        return length

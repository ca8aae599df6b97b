"""StepBatch: one step's work as a record, built in one place from the scheduler's Schedule.

The flow of a step (engines/runtime/engine.py): Scheduler.schedule() -> Schedule (which tokens
of which sequences) -> build_batch() -> StepBatch (host bookkeeping plus the device tensors the model
reads: token ids, positions, cache slots, attention layout, logit rows) -> an executor runs
it -> the engine updates sequences from the executor's result. Decodes come first in the
flat batch, shortest context first, so attention can batch them in groups of similar length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from engines.runtime.attention import AttentionBatch, DecodeGroup, PrefillSegment, group_by_length
from engines.runtime.kv_cache import BlockAllocator
from engines.runtime.scheduler import Chunk, Schedule
from engines.runtime.transfer import TransferLedger


@dataclass
class SeqState:
    """The runtime's per-sequence state (Sequence.state): sampling generator, collected logits."""

    generator: torch.Generator | None = None
    logits: list[Tensor] = field(default_factory=list)
    prompt_logits: list[Tensor] = field(default_factory=list)  # chunks, until the first token
    prompt_rows_done: int = 0  # prompt positions whose logits are collected (survives preemption)


@dataclass
class StepBatch:
    chunks: list[Chunk]  # decodes (shortest context first), then prefill chunks
    num_decode: int
    token_ids: Tensor  # [T] on the device
    positions: Tensor  # [T]
    logit_rows: Tensor  # [S] rows of the flat batch whose logits are computed
    attn: AttentionBatch
    sampled: list[tuple[Chunk, int]]  # chunk whose last row yields a token, its index in logit_rows
    prompt_rows: list[tuple[Chunk, int, int]]  # chunk, first and end index in logit_rows of prompt logits

    def row_keys(self) -> list[tuple[str, int]]:
        """(request id, token position) of each row of the flat batch, in row order: how routing
        is recorded and replayed (engines/sim/routing.py)."""
        return [(c.seq.request.request_id, p) for c in self.chunks for p in range(c.start, c.start + c.length)]


def build_batch(plan: Schedule, allocator: BlockAllocator, ledger: TransferLedger) -> StepBatch | None:
    """The plan's chunks as one flat batch (None when the plan runs nothing). Advances each
    prompt-logit-collecting sequence's `prompt_rows_done` to what this batch computes."""
    if not plan.decodes and not plan.prefills:
        return None
    decodes = sorted(plan.decodes, key=lambda c: c.start)
    chunks = decodes + plan.prefills
    # A simulated run (the meta device) builds only shapes: its rows' ids, positions and KV slots
    # are never read, so they are not listed (the same tensors' shapes and counted bytes).
    meta = ledger.device.type == "meta"
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    sampled: list[tuple[Chunk, int]] = []
    prompt_rows: list[tuple[Chunk, int, int]] = []
    rows = 0
    for c in chunks:
        row0 = rows
        state: SeqState = c.seq.state  # type: ignore[assignment]
        if c.seq.request.return_prompt_logits and state.prompt_rows_done < c.seq.num_prompt:
            lo = max(c.start, state.prompt_rows_done)
            hi = min(c.start + c.length, c.seq.num_prompt)
            if hi > lo:
                prompt_rows.append((c, len(logit_rows), len(logit_rows) + hi - lo))
                logit_rows += range(row0 + lo - c.start, row0 + hi - c.start)
                state.prompt_rows_done = hi
        if c.samples:
            last = row0 + c.length - 1
            if not logit_rows or logit_rows[-1] != last:
                logit_rows.append(last)
            sampled.append((c, len(logit_rows) - 1))
        rows += c.length
        if not meta:
            token_ids += c.seq.token_ids[c.start : c.start + c.length]
            positions += range(c.start, c.start + c.length)
            slots += allocator.slots(c.seq.id, c.start, c.length)
    long = torch.long
    if meta:
        ids, pos = ledger.shaped((rows,), long), ledger.shaped((rows,), long)
    else:
        ids, pos = ledger.tensor(token_ids, long), ledger.tensor(positions, long)
    return StepBatch(
        chunks, len(decodes), ids, pos, ledger.tensor(logit_rows, long),
        _attention_batch(chunks, len(decodes), slots, rows, allocator, ledger), sampled, prompt_rows,
    )


def _attention_batch(chunks: list[Chunk], num_decode: int, slots: list[int], rows: int, allocator: BlockAllocator,
                     ledger: TransferLedger) -> AttentionBatch:
    """Decode chunks come first in `chunks`; each later chunk is a prefill segment. On the meta
    device (a simulated run) shapes only: `slots` is not listed there, `rows` gives its length."""
    tables, tensor, long = allocator.tables, ledger.tensor, torch.long
    meta = ledger.device.type == "meta"
    batch = AttentionBatch(slots=ledger.shaped((rows,), long) if meta else tensor(slots, long),
                           num_decode=num_decode)
    dec = [tables[c.seq.id] for c in chunks[:num_decode]]  # shortest first
    for lo, hi in group_by_length([len(t) for t in dec]):
        width = max(len(t) for t in dec[lo:hi])
        if meta:
            table, context = ledger.shaped((hi - lo, width), long), ledger.shaped((hi - lo,), long)
        else:
            table = tensor([t + [0] * (width - len(t)) for t in dec[lo:hi]], long)
            context = tensor([c.start + 1 for c in chunks[lo:hi]], long)
        batch.decodes.append(DecodeGroup(lo, table, context, allocator.block_size))
    row = num_decode
    for c in chunks[num_decode:]:
        nb = allocator.blocks_for(c.start + c.length)
        table = ledger.shaped((nb,), long) if meta else tensor(tables[c.seq.id][:nb], long)
        batch.prefills.append(PrefillSegment(row, c.length, c.start, table))
        row += c.length
    return batch

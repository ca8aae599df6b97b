"""The request record every workload produces and the harness consumes (no torch, no engines).

A Request says what to send (prompt token ids, expected output length), when (arrival time
for open-loop traffic, or think time after the session's previous turn for closed-loop),
how it relates to other requests (session and turn, shared prefix blocks), and optionally
what the right answer is (for accuracy scoring).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class WorkloadError(Exception):
    """Bad trace file or workload option; the message names the file, line or field and the fix."""


@dataclass(frozen=True)
class TaskInfo:
    """An exact-match task embedded in a request: the scorer compares the answer text."""

    task: str  # e.g. "rag_recall", "chat_recall", "closed_book", "copy"
    answer: str  # exact expected answer (words, without the end-of-sequence token)


@dataclass(frozen=True)
class Request:
    request_id: str
    # A tuple, or (from build_workload) a workloads.prompts.PromptIds that reads like one but
    # holds its ids as int32 or synthesizes them when read; give engines tuple(prompt_ids).
    prompt_ids: Sequence[int]
    max_new_tokens: int  # expected output length (exact when ignore_eos)
    # Seconds from the start of the run; None = closed loop (sent when the session's previous
    # turn has finished, plus think_time_s).
    arrival_s: float | None = None
    session_id: str | None = None
    turn: int = 0
    think_time_s: float = 0.0
    # Hash ids of the prompt's leading blocks of `block_tokens` tokens, as in the trace: equal
    # ids mean identical token blocks, i.e. reusable prefix/KV. Empty when unknown.
    prefix_blocks: tuple[int, ...] = ()
    block_tokens: int = 512
    # Benchmarks want exact output lengths; task requests stop at EOS to be scored.
    ignore_eos: bool = True
    task: TaskInfo | None = None
    # Token length of each prefix block when blocks differ in size (RAGPulse components: one
    # block per system-prompt chunk, passage, history chunk, question); empty = every block is
    # `block_tokens` long (the last one may be cut by the prompt's end).
    block_lengths: tuple[int, ...] = ()
    # Open loop, a later turn of a session: sent no earlier than the session's previous turn's
    # finish plus this many seconds (the think time after its answer), nor before arrival_s.
    # None: sent at arrival_s whatever the previous turn does (--turns independent, turn 0).
    after_previous_s: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

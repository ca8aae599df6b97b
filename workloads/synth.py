"""The content step: request skeletons -> prompt token ids, behind the PromptSynthesizer seam.

A RequestSkeleton is everything about a request except its tokens (when, how long, which
session, which blocks it shares). A PromptSynthesizer turns one into a Prompt. The default,
HashBlockSynthesizer, derives every token from (seed, block id, offset) by hashing, so equal
block ids give equal tokens in any request and any process; no tokenizer, no text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from workloads.base import Request, TaskInfo, WorkloadError
from workloads.traces.common import block_spans


@dataclass(frozen=True, slots=True)
class RequestSkeleton:
    """A request before content: the shape step's output, the content step's input."""

    index: int  # position in the workload; keys the request's unique tokens
    input_tokens: int
    output_tokens: int
    arrival_s: float | None = None  # None: closed loop (or not assigned yet)
    session_id: str | None = None
    turn: int = 0
    think_time_s: float = 0.0  # before this turn, after the previous answer (closed loop)
    # Shared structure, as in TraceRow: ids in prompt order, explicit lengths or () for
    # uniform blocks of block_tokens (last one cut by input_tokens). A block cut short holds
    # the first tokens of that id's block. Tokens after the blocks are unique to the request.
    blocks: tuple[int, ...] = ()
    block_lengths: tuple[int, ...] = ()
    block_tokens: int = 512
    # What each block is ("sys_prompt", "passage", "history", "web_search", "question",
    # "system", "turn"); a task synthesizer uses it to know where passages and questions are.
    block_kinds: tuple[str, ...] = ()
    # The think time after the previous turn's answer, when known (a generator's draw, or a
    # trace's gap from the previous request's end to this one's start); None = unknown.
    think_after_s: float | None = None
    # Open loop: the wait after the previous turn's finish (Request.after_previous_s); set by
    # apply_arrivals for dependent turns, None otherwise.
    after_previous_s: float | None = None

    def spans(self) -> list[int]:
        return block_spans(self.blocks, self.block_lengths, self.block_tokens, self.input_tokens)


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    task: TaskInfo | None = None  # set by task synthesizers; the request then stops at EOS


@runtime_checkable
class PromptSynthesizer(Protocol):
    """Turns a skeleton into prompt tokens.

    Contract, so that replays stay faithful: return exactly `skeleton.input_tokens` ids, in
    [0, vocab_size) and outside the target's special ids; equal block ids must give equal
    tokens across all requests of a workload; the same skeleton must give the same prompt
    (derive all randomness from the synthesizer's seed and the skeleton, never from call
    order). A task synthesizer (rag_long / long_chat with an answer to score) overwrites the
    tokens of chosen blocks (by `block_kinds`: e.g. a fact into a "passage" block, the query
    into the "question" block) and returns the TaskInfo.

    Optional: a synthesizer whose `deferrable` attribute is true promises that its prompts
    carry no task and cost nothing to remake; its prompts are then synthesized when the
    request is sent, not when the workload is built (with `token_ids(skeleton)`, an integer
    array, when it has one). Any other synthesizer runs for every request at build time and
    its ids are held as an int32 array (workloads.prompts.PromptIds).
    """

    def synthesize(self, skeleton: RequestSkeleton) -> Prompt: ...


_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x):  # splitmix64's finalizer on a uint64 array (wrapping arithmetic is intended)
    import numpy as np

    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class HashBlockSynthesizer:
    """Token t of block b = allowed[hash(seed, b, t) mod len(allowed)]; unique tokens likewise.

    Block ids map to even keys and request indices (for unique tokens) to odd keys, so the
    two never collide. `avoid_ids` (BOS, EOS, pad, ...) never appear in a prompt.
    """

    deferrable = True  # no tasks, pure: prompts are synthesized when sent (workloads.prompts)

    def __init__(self, seed: int, vocab_size: int, avoid_ids: tuple[int, ...] = ()) -> None:
        import numpy as np

        if vocab_size < 1:
            raise WorkloadError(f"vocab_size must be at least 1, got {vocab_size}")
        self.allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.asarray(avoid_ids, dtype=np.int64))
        if len(self.allowed) == 0:
            raise WorkloadError(f"every token id of the {vocab_size}-token vocabulary is a special id to avoid")
        self.seed_key = _mix(np.array([seed & _MASK], dtype=np.uint64))[0]

    def token_ids(self, skeleton: RequestSkeleton):
        """The prompt as an int64 numpy array (synthesize() wraps it in a Prompt)."""
        import numpy as np

        spans = skeleton.spans()
        covered = min(sum(spans), skeleton.input_tokens)
        keys = [2 * b for b in skeleton.blocks] + [2 * skeleton.index + 1]
        counts = np.asarray(spans + [skeleton.input_tokens - covered], dtype=np.int64)
        if covered < sum(spans):  # blocks longer than the prompt: cut the tail off
            counts = np.minimum(counts, np.maximum(0, skeleton.input_tokens - (np.cumsum(counts) - counts)))
        starts = np.cumsum(counts) - counts
        per_key = _mix(np.asarray(keys, dtype=np.uint64) ^ self.seed_key)
        offsets = np.arange(skeleton.input_tokens, dtype=np.uint64) - np.repeat(starts, counts).astype(np.uint64)
        hashed = _mix(np.repeat(per_key, counts) + offsets * np.uint64(_GOLDEN))
        return self.allowed[(hashed % np.uint64(len(self.allowed))).astype(np.int64)]

    def synthesize(self, skeleton: RequestSkeleton) -> Prompt:
        return Prompt(tuple(self.token_ids(skeleton).tolist()))


def to_request(skeleton: RequestSkeleton, prompt: Prompt, request_id: str) -> Request:
    """The request for `skeleton`; `prompt.ids` as given (a tuple or a workloads.prompts.PromptIds)."""
    return Request(
        request_id=request_id,
        prompt_ids=prompt.ids,
        max_new_tokens=skeleton.output_tokens,
        arrival_s=skeleton.arrival_s,
        session_id=skeleton.session_id,
        turn=skeleton.turn,
        think_time_s=skeleton.think_time_s,
        prefix_blocks=skeleton.blocks,
        block_tokens=skeleton.block_tokens,
        # Always the trace's output length: a task is scored on the output up to the first
        # EOS, and throughput still reflects the traffic's real output lengths.
        ignore_eos=True,
        task=prompt.task,
        block_lengths=skeleton.block_lengths,
        after_previous_s=skeleton.after_previous_s,
    )

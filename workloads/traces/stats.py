"""Summary numbers of a trace (what `pwbench trace info` prints), as pure functions of a Trace.

Percentiles use linear interpolation (numpy's and pandas' default). Fields a format cannot
provide (arrival times, sessions, prefix blocks) are None, never a made-up zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from workloads.sessions import reuse_of, session_clock, session_rows
from workloads.traces.common import Trace, block_spans

FIRST_SKIPPED = 3  # malformed lines quoted by trace info --json (the count covers them all)


@dataclass(frozen=True)
class TokenStats:
    mean: float
    p50: float
    p99: float
    max: int


@dataclass(frozen=True)
class TraceInfo:
    path: str
    format: str
    requests: int
    # Last minus first arrival, rounded to 100 ns (Azure's resolution, the finest of any format)
    # so float noise from subtracting two large clock readings does not show.
    duration_s: float | None
    input_tokens: TokenStats
    output_tokens: TokenStats
    sessions: int | None  # distinct session ids
    prefix_blocks: int | None  # block references in all prompts
    prefix_repeat_share: float | None  # share of block references whose id appeared before
    repeated_token_share: float | None  # share of prompt tokens inside such repeated blocks
    bad_lines_skipped: int
    dropped: tuple[str, ...]
    # Sessions without block ids (workloads/sessions.py): later turns, those whose input holds
    # the previous turn's input + output, the share of prompt tokens that repeat the previous
    # prompt (what a replay's prefix cache can serve) and the share that repeat its answer.
    # None when the trace has no sessions or has block ids of its own.
    later_turns: int | None = None
    extending_turns: int | None = None
    inferred_reuse_share: float | None = None
    inferred_answer_share: float | None = None
    session_relative: bool | None = None  # every session starts at the first instant (None: no sessions)
    first_skipped: tuple[str, ...] = ()  # the first malformed lines skipped, as "PATH:LINE: what"
    provenance: tuple[str, ...] = ()  # a converted file's header: its source, --map and lines skipped

    def as_dict(self) -> dict[str, Any]:
        """Flat JSON-ready dict: input_tokens_mean, input_tokens_p50, ..., output_tokens_max."""
        out = asdict(self)
        for key in ("input_tokens", "output_tokens"):
            for stat, value in out.pop(key).items():
                out[f"{key}_{stat}"] = value
        out["dropped"] = list(self.dropped)
        out["first_skipped"] = list(self.first_skipped)
        out["provenance"] = list(self.provenance)
        return out


def _token_stats(values: list[int]) -> TokenStats:
    import numpy as np

    array = np.asarray(values, dtype=np.int64)
    p50, p99 = np.percentile(array, [50, 99])
    # An integer sum divided once is what pandas' mean of an int64 column gives, to the bit.
    return TokenStats(int(array.sum()) / len(array), float(p50), float(p99), int(array.max()))


def repeated_blocks(trace: Trace) -> tuple[int, int, int, int]:
    """(block references, repeated references, prompt tokens, tokens in repeated blocks).

    A reference repeats when its id appeared earlier in arrival order (in an earlier prompt
    or earlier in the same prompt): that is the KV a prefix-aware engine could have kept.
    """
    seen: set[int] = set()
    refs = repeats = tokens = repeated_tokens = 0
    for row in trace.rows:
        tokens += row.input_tokens
        spans = block_spans(row.blocks, row.block_lengths, trace.block_tokens, row.input_tokens)
        for block_id, span in zip(row.blocks, spans):
            refs += 1
            if block_id in seen:
                repeats += 1
                repeated_tokens += span
            else:
                seen.add(block_id)
    return refs, repeats, tokens, repeated_tokens


def summarize(trace: Trace) -> TraceInfo:
    rows = trace.rows
    arrivals = [r.arrival_s for r in rows if r.arrival_s is not None]
    refs, repeats, tokens, repeated_tokens = repeated_blocks(trace)
    groups = session_rows(rows)
    sessions = trace.has_sessions and any(r.session_id is not None for r in rows)
    reuse = reuse_of([g for g in groups if g[0].session_id is not None]) if sessions and not refs else None
    return TraceInfo(
        path=trace.path,
        format=trace.format,
        requests=len(rows),
        duration_s=round(max(arrivals) - min(arrivals), 7) if arrivals else None,
        input_tokens=_token_stats([r.input_tokens for r in rows]),
        output_tokens=_token_stats([r.output_tokens for r in rows]),
        sessions=len({r.session_id for r in rows if r.session_id is not None}) if trace.has_sessions else None,
        prefix_blocks=refs or None,
        prefix_repeat_share=repeats / refs if refs else None,
        repeated_token_share=repeated_tokens / tokens if refs else None,
        bad_lines_skipped=len(trace.bad_lines),
        dropped=trace.dropped,
        later_turns=reuse.later_turns if reuse else None,
        extending_turns=reuse.extending if reuse else None,
        inferred_reuse_share=reuse.share if reuse else None,
        inferred_answer_share=reuse.answer_share if reuse else None,
        session_relative=session_clock(groups).relative if sessions else None,
        first_skipped=trace.bad_lines[:FIRST_SKIPPED],
        provenance=trace.provenance,
    )

"""Sessions of a trace as they happened: session-relative clocks and the prefix reuse of turns.

`session_clock` detects an arrival column that counts from each session's start and places the
sessions (a session start column, or a stated Poisson rule); `infer_reuse` gives a trace with
session ids and no block ids the reuse its turns had: a turn whose input holds the previous
turn's input + output begins with that prompt and (synthesized) answer. Rules and why:
docs/workloads.md "Sessions".
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from workloads.synth import RequestSkeleton
from workloads.traces.common import TraceRow

STREAM_SESSION_STARTS = 4  # seed stream of the Poisson session starts (arrivals.py uses 1, shapes 2, 3)
INFERRED_BLOCK_IDS = 1 << 42  # block ids of inferred turns and answers (a trace without block ids has none)


def session_rows(rows: Sequence[TraceRow]) -> list[list[TraceRow]]:
    """Rows grouped by session id, sessions in order of their first request, turns in order;
    a row without a session id is a group of its own."""
    groups: dict[str, list[TraceRow]] = {}
    for number, row in enumerate(rows):
        groups.setdefault(row.session_id if row.session_id is not None else f"\0{number}", []).append(row)
    return list(groups.values())


def extends(previous: TraceRow | RequestSkeleton, row: TraceRow | RequestSkeleton) -> bool:
    """Whether `row`'s prompt can hold the previous turn's prompt and answer (the inference's rule)."""
    return _input(row) >= _input(previous) + _output(previous)


def _input(r) -> int:
    return r.input_tokens


def _output(r) -> int:
    return r.output_tokens


@dataclass(frozen=True)
class SessionClock:
    """How a trace's session times read: `relative` when every session starts at the trace's
    first instant and some turn comes later (the arrival column counts from the session's start)."""

    relative: bool
    sessions: int  # sessions with an id
    span_s: float  # the longest session's last turn, after its start

    def note(self, placed_by: str) -> str:
        return (f"session-relative arrival times: all {self.sessions} sessions start at the trace's first instant and "
                f"their turns later (the arrival column counts from each session's start); {placed_by}")


def session_clock(groups: Sequence[Sequence[TraceRow]]) -> SessionClock:
    """Detect a session-relative arrival column from the rows grouped by session (id'd groups only)."""
    timed = [g for g in groups if g and g[0].session_id is not None and g[0].arrival_s is not None]
    if len(timed) < 2:
        return SessionClock(False, len(timed), 0.0)
    first = min(r.arrival_s for g in groups for r in g if r.arrival_s is not None)
    starts_together = all(g[0].arrival_s == first for g in timed)
    span = max(max(r.arrival_s for r in g if r.arrival_s is not None) - first for g in timed)
    return SessionClock(starts_together and span > 0, len(timed), span)


def session_starts(groups: Sequence[Sequence[TraceRow]], clock: SessionClock, seed: int) -> tuple[list[float], str]:
    """Start time of each group and how it was chosen: the session start column when every timed
    session has one, else a Poisson process of `sessions` starts over the longest session's span
    (the first at 0), seeded. Untimed or id-less groups start at 0 (they keep their own times)."""
    import numpy as np

    has_column = all(g[0].session_start_s is not None for g in groups if g and g[0].session_id is not None)
    if has_column:
        starts = [g[0].session_start_s or 0.0 if g and g[0].session_id is not None else 0.0 for g in groups]
        return starts, "each session placed at its session_start_s column"
    rate = clock.sessions / clock.span_s
    gaps = np.random.default_rng([seed, STREAM_SESSION_STARTS]).exponential(1.0 / rate, size=len(groups))
    placed = iter(np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist())
    starts = [next(placed) if g and g[0].session_id is not None else 0.0 for g in groups]
    return starts, (
        f"the trace has no session start column (map one with session_start_s=COLUMN), so sessions start as a "
        f"Poisson process (seed {seed}) at {rate:.4g} sessions/s: all {clock.sessions} over the longest session's "
        f"span of {clock.span_s:.4g} s; --arrival poisson --rate R chooses the rate instead"
    )


@dataclass(frozen=True)
class InferredReuse:
    later_turns: int  # turns after a session's first
    extending: int  # of those, turns whose input holds the previous turn's input + output
    # Prompt tokens that repeat the previous turn's prompt: what an engine's prefix cache can
    # serve in a replay (up to its block rounding)
    prompt_tokens_reused: int
    # Prompt tokens that repeat the previous turn's answer: synthesized, so they repeat in every
    # later turn of the session, but the engine's own answer differs and computes them once
    answer_tokens: int
    prompt_tokens: int  # all prompt tokens

    @property
    def share(self) -> float:
        """Share of prompt tokens a replay's prefix cache can serve (the previous prompts)."""
        return self.prompt_tokens_reused / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def answer_share(self) -> float:
        return self.answer_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def note(self) -> str:
        return (f"session reuse inferred (the trace has session ids and no block ids): {self.extending} of "
                f"{self.later_turns} later turns hold the previous turn's prompt + answer and begin with them; "
                f"{self.share:.1%} of prompt tokens repeat the previous prompt (a prefix cache can serve these), "
                f"{self.answer_share:.1%} are the previous answer (synthesized tokens, not the engine's own answer, "
                "so computed again); --session-reuse none gives every turn fresh tokens")


def reuse_of(sessions: Sequence[Sequence[TraceRow | RequestSkeleton]],
             links: Sequence[Sequence[bool]] | None = None) -> InferredReuse:
    """What `infer_reuse` infers, from lengths alone (`trace info` reads it from the rows)."""
    later = extending = reused = answers = total = 0
    for k, session in enumerate(sessions):
        for j, turn in enumerate(session):
            total += _input(turn)
            if j == 0:
                continue
            later += 1
            previous = session[j - 1]
            if links[k][j] if links is not None else extends(previous, turn):
                extending += 1
                reused += _input(previous)
                answers += _output(previous)
    return InferredReuse(later, extending, reused, answers, total)


def infer_reuse(sessions: list[list[RequestSkeleton]], links: Sequence[Sequence[bool]] | None = None,
                ) -> tuple[list[list[RequestSkeleton]], InferredReuse]:
    """Each session's turns as chains of blocks with explicit lengths: a turn that extends the
    previous one repeats its blocks, then an "answer" block of its output length, then a
    "turn" block of the new tokens; any other turn is one fresh "turn" block. Equal blocks
    synthesize equal tokens (workloads/synth.py), so the prompt literally begins with the
    previous prompt and the previous answer's (synthesized) ids.

    `links[k][j]`: whether turn j of session k extends turn j-1 (default: `extends` on the
    skeletons); give the trace's unscaled rows' answer so rounding by `scale` cannot break a
    chain (a linked turn is then lengthened by the token or two rounding took)."""
    ids = itertools.count(INFERRED_BLOCK_IDS)
    out = []
    for k, session in enumerate(sessions):
        chain: list[tuple[int, int, str]] = []  # (block id, tokens, kind) of the previous prompt
        previous = None
        turns = []
        for j, s in enumerate(session):
            linked = previous is not None and (links[k][j] if links is not None else extends(previous, s))
            if linked:
                held = previous.input_tokens + previous.output_tokens
                s = dataclasses.replace(s, input_tokens=max(s.input_tokens, held))
                parts = [*chain, (next(ids), previous.output_tokens, "answer"),
                         (next(ids), s.input_tokens - held, "turn")]
            else:
                parts = [(next(ids), s.input_tokens, "turn")]
            chain = [p for p in parts if p[1] > 0]
            s = dataclasses.replace(s, blocks=tuple(b for b, _, _ in chain),
                                    block_lengths=tuple(n for _, n, _ in chain),
                                    block_kinds=tuple(kind for _, _, kind in chain))
            turns.append(s)
            previous = s
        out.append(turns)
    return out, reuse_of(out, links)


def links_of(groups: Sequence[Sequence[TraceRow]]) -> list[list[bool]]:
    """For each session, whether each turn extends the previous one (False for the first)."""
    return [[j > 0 and extends(rows[j - 1], rows[j]) for j in range(len(rows))] for rows in groups]

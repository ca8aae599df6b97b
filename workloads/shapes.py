"""The shape step of every named workload: a stream of sessions of RequestSkeletons.

rag_long (RAGPulse), long_chat (Mooncake conversation), offline_batch (MoE-Gen), burst (Azure
2023 code) and trace:PATH. Distribution constants come from fitted.py; `scale` multiplies
every length. No tokens here: content is synth.py's job.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator

from workloads.arrivals import STREAM_SHAPES, rng
from workloads.assemble import Shape
from workloads.base import WorkloadError
from workloads.fitted import (
    BURST_BURSTINESS,
    BURST_INPUT_Q,
    BURST_OUTPUT_Q,
    BURST_RATE,
    CHAT_FIRST_INPUT_Q,
    CHAT_NEW_MESSAGE_Q,
    CHAT_OUTPUT_Q,
    CHAT_SHARED_BLOCKS,
    CHAT_THINK_Q,
    CHAT_TURNS_PMF,
    RAG_EMPTY_HISTORY_TOKENS,
    RAG_OUTPUT_Q,
    RAG_PASSAGE_LEN_Q,
    RAG_PASSAGE_POOL_PER_REF,
    RAG_PASSAGE_ZIPF,
    RAG_PASSAGES_PMF,
    RAG_QUESTION_Q,
    RAG_SYS_BLOCK_TOKENS,
    RAG_SYS_POOL_PER_REQUEST,
    RAG_SYS_POOL_ZIPF,
    RAG_SYS_VARIANTS,
    RAG_TEMPLATE_TOKENS,
    RAG_THINK_Q,
    RAG_TURNS_PMF,
    RAG_WEB_LEN_Q,
    RAG_WEB_PMF,
    cumulative,
    draw_index,
    pmf_mean,
    sample_pmf,
    sample_quantiles,
)
from workloads.synth import RequestSkeleton
from workloads.traces.common import BLOCK_TOKENS, TraceRow
from workloads.traces.formats import read_trace

DEFAULT_RATE = 1.0  # requests per second; a CPU demo model serves well under one 3k prompt a second
CONTEXT_LOW = 0.85  # with `context`, a prompt's target is uniform in [0.85, 1.0] x context
OFFLINE_INPUT_TOKENS = 512  # MoE-Gen's headline setup: 512 in / 256 out
OFFLINE_OUTPUT_TOKENS = 256
_BATCH = 256  # single-request lengths are drawn this many at a time
STREAM_DIRECT = 3  # rag_long's direct questions (--direct-share): their own random stream
DIRECT_BLOCK_IDS = 1 << 40  # ... and their own block ids


def rag_long_shape(spec, target=None) -> Shape:
    return Shape(lambda hint: _rag_sessions(spec, hint), _rag_mean_turns(spec.direct_share), "poisson", DEFAULT_RATE)


def _direct_session_share(direct_share: float | None) -> float:
    """The share of sessions that are one direct question, so that `direct_share` of the
    requests are (a RAG session has pmf_mean(RAG_TURNS_PMF) requests on average)."""
    q, turns = direct_share or 0.0, pmf_mean(RAG_TURNS_PMF)
    return q * turns / (q * turns + 1.0 - q)  # p / (p + (1 - p) * turns) = q


def _rag_mean_turns(direct_share: float | None) -> float:
    p = _direct_session_share(direct_share)
    return p + (1.0 - p) * pmf_mean(RAG_TURNS_PMF)


def zipf_weights(size: int, exponent: float):
    import numpy as np

    weights = np.arange(1, size + 1, dtype=np.float64) ** -exponent
    return weights / weights.sum()


def smallest_first(keys, k: int):
    """The first k indices of np.argsort(keys, kind="stable") (k smallest keys, ties by index),
    in O(len(keys)) instead of a full sort: the rag_long pool grows with the requests asked for."""
    import numpy as np

    if k >= len(keys):
        return np.argsort(keys, kind="stable")
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    kth = np.partition(keys, k - 1)[k - 1]
    candidates = np.flatnonzero(keys <= kth)  # the k smallest and any ties with the k-th, by index
    return candidates[np.argsort(keys[candidates], kind="stable")][:k]


def _fill(keys, lengths, budget: float) -> list[int]:
    """Passages in key order until their lengths add up to `budget` (all of them if they never do)."""
    import numpy as np

    k = 64
    while True:
        order = smallest_first(keys, k)
        reached = np.flatnonzero(np.cumsum(lengths[order]) >= budget)
        if len(reached) or k >= len(keys):
            return order[: reached[0] + 1 if len(reached) else len(keys)].tolist()
        k *= 4


def _rag_sessions(spec, hint: int) -> Iterator[list[RequestSkeleton]]:
    import numpy as np

    g = rng(spec.seed, STREAM_SHAPES)
    ids = itertools.count()
    scale = spec.scale

    def tokens(n: float) -> int:
        return max(1, round(n * scale))

    def draw(table: tuple[float, ...]) -> int:
        return int(sample_quantiles(g, table, 1, scale)[0])

    sys_tokens = tokens(RAG_SYS_BLOCK_TOKENS)
    variants = [(next(ids), tokens(tail), next(ids) if shared else None) for _, tail, shared in RAG_SYS_VARIANTS]
    variant_p = np.array([n for n, _, _ in RAG_SYS_VARIANTS], dtype=np.float64)
    variant_p /= variant_p.sum()
    template_ids = [next(ids) for _ in range(max(1, math.ceil(RAG_SYS_POOL_PER_REQUEST * hint)))]
    template_cdf = cumulative(zipf_weights(len(template_ids), RAG_SYS_POOL_ZIPF))
    variant_cdf = cumulative(variant_p)
    per_request = pmf_mean(RAG_PASSAGES_PMF)
    if spec.context is not None:  # enough passages that a prompt can reach `context` tokens
        per_request = max(per_request, spec.context / (sum(RAG_PASSAGE_LEN_Q) / len(RAG_PASSAGE_LEN_Q)))
    pool = max(2 * max(RAG_PASSAGES_PMF), math.ceil(RAG_PASSAGE_POOL_PER_REF * hint * per_request))
    passage_ids = [next(ids) for _ in range(pool)]
    passage_len = sample_quantiles(g, RAG_PASSAGE_LEN_Q, pool, scale).tolist()
    passage_p = zipf_weights(pool, RAG_PASSAGE_ZIPF)
    lengths_array = np.asarray(passage_len, dtype=np.int64)
    empty_history = next(ids)
    # Direct questions draw from their own stream and id space, so the RAG sessions are the
    # same with and without them (interleaved, not replaced).
    direct_p = _direct_session_share(spec.direct_share)
    gd = rng(spec.seed, STREAM_DIRECT) if direct_p else None
    direct_ids = itertools.count(DIRECT_BLOCK_IDS)

    for number in itertools.count():
        if gd is not None and gd.random() < direct_p:
            question = int(sample_quantiles(gd, RAG_QUESTION_Q, 1, scale)[0])
            yield [RequestSkeleton(
                index=-1, input_tokens=question, output_tokens=int(sample_quantiles(gd, RAG_OUTPUT_Q, 1, scale)[0]),
                session_id=f"rag_long-d{number}", blocks=(next(direct_ids),), block_lengths=(question,),
                block_tokens=sys_tokens, block_kinds=("question",),
            )]
            continue
        history_ids: list[int] = []  # chunk j of a session's history keeps its id as it grows
        history_tokens = 0
        session = []
        for turn in range(int(sample_pmf(g, RAG_TURNS_PMF, 1)[0])):
            parts: list[tuple[int, int, str]] = []  # (block id, tokens, kind)
            first, tail, tail_id = variants[int(draw_index(g, variant_cdf))]
            parts.append((first, sys_tokens, "sys_prompt"))
            parts.append((template_ids[int(draw_index(g, template_cdf))], sys_tokens, "sys_prompt"))
            parts.append((tail_id if tail_id is not None else next(ids), tail, "sys_prompt"))
            if turn == 0:
                parts.append((empty_history, tokens(RAG_EMPTY_HISTORY_TOKENS), "history"))
            else:  # earlier questions and answers, in chunks of the system block size
                while len(history_ids) < math.ceil(history_tokens / sys_tokens):
                    history_ids.append(next(ids))
                parts.extend(
                    (b, min(sys_tokens, history_tokens - sys_tokens * j), "history") for j, b in enumerate(history_ids)
                )
            for _ in range(int(sample_pmf(g, RAG_WEB_PMF, 1)[0])):
                parts.append((next(ids), draw(RAG_WEB_LEN_Q), "web_search"))
            question = draw(RAG_QUESTION_Q)
            parts.append((next(ids), question, "question"))
            glue = tokens(g.integers(RAG_TEMPLATE_TOKENS[0], RAG_TEMPLATE_TOKENS[1] + 1))
            fixed = sum(n for _, n, _ in parts) + glue
            # Popularity-weighted order without replacement (Efraimidis-Spirakis exponential keys):
            # the passages with the smallest keys, in key order.
            keys = g.exponential(size=pool) / passage_p
            if spec.context is None:
                chosen = smallest_first(keys, int(sample_pmf(g, RAG_PASSAGES_PMF, 1)[0])).tolist()
            else:
                budget = g.uniform(CONTEXT_LOW, 1.0) * spec.context * scale - fixed
                chosen = _fill(keys, lengths_array, budget) if budget > 0 else []
            passages = [(passage_ids[i], passage_len[i], "passage") for i in chosen]
            parts[3:3] = passages  # prompt order: system prompt, passages, history, web, question
            output = draw(RAG_OUTPUT_Q)
            think = float(sample_quantiles(g, RAG_THINK_Q, 1, 1.0, 0)[0]) if turn else 0.0
            session.append(
                RequestSkeleton(
                    index=-1,
                    input_tokens=fixed + sum(n for _, n, _ in passages),
                    output_tokens=output,
                    session_id=f"rag_long-s{number}",
                    turn=turn,
                    think_time_s=think,
                    think_after_s=think if turn else None,
                    blocks=tuple(b for b, _, _ in parts),
                    block_lengths=tuple(n for _, n, _ in parts),
                    block_tokens=sys_tokens,
                    block_kinds=tuple(k for _, _, k in parts),
                )
            )
            history_tokens += question + output
        yield session


def long_chat_shape(spec, target=None) -> Shape:
    return Shape(lambda hint: _chat_sessions(spec), pmf_mean(CHAT_TURNS_PMF), "closed")


def _chat_sessions(spec) -> Iterator[list[RequestSkeleton]]:
    g = rng(spec.seed, STREAM_SHAPES)
    block = max(1, round(BLOCK_TOKENS * spec.scale))
    shared = list(range(CHAT_SHARED_BLOCKS))
    ids = itertools.count(CHAT_SHARED_BLOCKS)

    def draw(table: tuple[float, ...], scale: float = spec.scale, minimum: int = 1) -> int:
        return int(sample_quantiles(g, table, 1, scale, minimum)[0])

    for number in itertools.count():
        stream = list(shared)  # block ids of the conversation so far
        length = max(draw(CHAT_FIRST_INPUT_Q), len(shared) * block + 1)
        output = 0
        session = []
        for turn in range(int(sample_pmf(g, CHAT_TURNS_PMF, 1)[0])):
            think = 0.0
            if turn:
                length += output + draw(CHAT_NEW_MESSAGE_Q)
                think = float(draw(CHAT_THINK_Q, 1.0, 0))
            count = math.ceil(length / block)
            stream.extend(next(ids) for _ in range(count - len(stream)))
            output = draw(CHAT_OUTPUT_Q)
            session.append(
                RequestSkeleton(
                    index=-1,
                    input_tokens=length,
                    output_tokens=output,
                    session_id=f"long_chat-s{number}",
                    turn=turn,
                    think_time_s=think,
                    think_after_s=think if turn else None,
                    blocks=tuple(stream[:count]),
                    block_tokens=block,
                    block_kinds=("system",) * len(shared) + ("history",) * (count - len(shared)),
                )
            )
        yield session


def offline_batch_shape(spec, target=None) -> Shape:
    def lengths(g, n: int, fixed: int | None, span: tuple[int, int] | None, default: int):
        import numpy as np

        if span is not None:
            values = g.integers(span[0], span[1] + 1, size=n)
        else:
            values = np.full(n, fixed if fixed is not None else default)
        return np.maximum(1, np.rint(values * spec.scale)).astype(np.int64)

    def draw(g, n: int):
        return (
            lengths(g, n, spec.input_tokens, spec.input_range, OFFLINE_INPUT_TOKENS),
            lengths(g, n, spec.output_tokens, spec.output_range, OFFLINE_OUTPUT_TOKENS),
        )

    return Shape(lambda hint: _singles(spec, draw), 1.0, "offline")


def burst_shape(spec, target=None) -> Shape:
    def draw(g, n: int):
        return sample_quantiles(g, BURST_INPUT_Q, n, spec.scale), sample_quantiles(g, BURST_OUTPUT_Q, n, spec.scale)

    return Shape(lambda hint: _singles(spec, draw), 1.0, "gamma", BURST_RATE, BURST_BURSTINESS)


def _singles(spec, draw: Callable) -> Iterator[list[RequestSkeleton]]:
    """One-request sessions without a session id; `draw(g, n)` gives (inputs, outputs)."""
    g = rng(spec.seed, STREAM_SHAPES)
    for _ in itertools.count():
        inputs, outputs = draw(g, _BATCH)
        for inp, out in zip(inputs.tolist(), outputs.tolist()):
            yield [RequestSkeleton(index=-1, input_tokens=inp, output_tokens=out)]


def trace_shape(spec, target=None) -> Shape:
    """Rows keep lengths, sessions and blocks; think time = gap to the session's previous row.
    Session-relative arrival columns are placed (workloads/sessions.py); sessions without block
    ids get their turns' reuse inferred unless spec.session_reuse is "none"."""
    from workloads.sessions import infer_reuse, links_of, session_clock, session_rows, session_starts

    path = spec.name.partition(":")[2]
    trace = read_trace(path, spec.trace_format, spec.skip_bad_lines, spec.trace_map)
    if not trace.has_arrivals and spec.arrival in (None, "trace"):
        raise WorkloadError(
            f"{trace.path} ({trace.format}) has no arrival times; choose --arrival poisson, gamma, closed or offline"
        )
    notes = [*trace.provenance, *trace.dropped]
    if trace.bad_lines:
        shown = "; ".join(trace.bad_lines[:MAX_BAD_LINES_NOTED])
        notes.append(f"{len(trace.bad_lines)} malformed lines skipped (--skip-bad-lines; first "
                     f"{min(len(trace.bad_lines), MAX_BAD_LINES_NOTED)}: {shown})")
    groups = session_rows(trace.rows)
    clock = session_clock(groups)
    starts = None
    if clock.relative and spec.arrival in (None, "trace"):
        starts, how = session_starts(groups, clock, spec.seed)
        notes.append(clock.note(how))
    elif clock.relative:  # the arrival process starts the sessions; turns keep their gaps
        notes.append(clock.note(f"--arrival {spec.arrival} starts the sessions, their turns keep the trace's gaps"))
    sessions = group_sessions(groups, trace.block_tokens, spec.scale, starts)
    with_ids = [s for s in sessions if s[0].session_id is not None]
    if with_ids and not any(r.blocks for r in trace.rows):
        if spec.session_reuse == "none":
            notes.append("session reuse not inferred (--session-reuse none): every turn's prompt is fresh tokens, "
                         "0% prefix reuse between turns")
        else:
            inferred, reuse = infer_reuse(with_ids, links_of([g for g in groups if g[0].session_id is not None]))
            replaced = iter(inferred)
            sessions = [next(replaced) if s[0].session_id is not None else s for s in sessions]
            notes.append(reuse.note())
    return Shape(lambda hint: iter(sessions), len(trace.rows) / len(sessions), "trace", finite=True,
                 notes=tuple(notes))


MAX_BAD_LINES_NOTED = 3  # malformed lines quoted in the run's notes; the count covers the rest


def group_sessions(groups: list[list[TraceRow]], block_tokens: int, scale: float,
                   starts: list[float] | None = None) -> list[list[RequestSkeleton]]:
    """Skeletons of each group; `starts` (session-relative traces) is added to each group's times.
    think_time_s is the gap to the previous row's arrival; think_after_s the gap from the previous
    row's end, when the trace has end times."""
    sessions = []
    for k, rows in enumerate(groups):
        offset = starts[k] if starts is not None else 0.0
        session, previous = [], None
        for row in rows:
            think = think_after = None
            if previous is not None and row.arrival_s is not None and previous.arrival_s is not None:
                think = row.arrival_s - previous.arrival_s
                if previous.end_s is not None:
                    think_after = max(0.0, row.arrival_s - previous.end_s)
            if offset and row.arrival_s is not None:
                row = dataclasses.replace(row, arrival_s=row.arrival_s + offset)
            session.append(scaled(row, block_tokens, scale, len(session), think or 0.0, think_after))
            previous = rows[len(session) - 1]
        sessions.append(session)
    return sessions


def scaled(row: TraceRow, block_tokens: int, scale: float, turn: int, think: float,
           think_after: float | None = None) -> RequestSkeleton:
    inp = max(1, round(row.input_tokens * scale))
    blocks, lengths, kinds = row.blocks, row.block_lengths, row.block_kinds
    if lengths and scale != 1.0:  # components keep their ids; one shrunk to nothing is dropped
        keep = [(b, round(n * scale), k) for b, n, k in zip(blocks, lengths, kinds or ("",) * len(blocks))]
        keep = [part for part in keep if part[1] > 0]
        blocks, lengths = tuple(b for b, _, _ in keep), tuple(n for _, n, _ in keep)
        kinds = tuple(k for _, _, k in keep) if kinds else ()
        inp = max(inp, sum(lengths))
    elif not lengths:
        block_tokens = max(1, round(block_tokens * scale))
        count = math.ceil(inp / block_tokens)
        blocks, kinds = blocks[:count], kinds[:count]
    return RequestSkeleton(
        index=-1,
        input_tokens=inp,
        output_tokens=max(1, round(row.output_tokens * scale)),
        arrival_s=row.arrival_s,
        session_id=row.session_id,
        turn=turn,
        think_time_s=think,
        think_after_s=think_after,
        blocks=blocks,
        block_lengths=lengths,
        block_tokens=block_tokens,
        block_kinds=kinds,
    )

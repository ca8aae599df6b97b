"""Fit the generator constants in workloads/fitted.py from the real traces.

`python -m workloads.fit [TRACES_DIR]` prints the constants as Python; a test checks that
fitted.py still equals this output. Mooncake has no session ids, so sessions are inferred
from prefix chains: a request continues the latest earlier request it shares >= 2 leading
blocks with (block 0 is the system prompt every request shares).
"""

from __future__ import annotations

import collections
import math
import os
import sys
from pathlib import Path
from typing import Any

from workloads.fitted import MAX_THINK_S, QUANTILES
from workloads.traces.common import Trace
from workloads.traces.formats import read_trace


def traces_dir() -> Path:
    default = Path(__file__).resolve().parents[2] / "shared" / "traces"
    return Path(os.environ.get("PWBENCH_TRACES", default))


def quantiles(values: list[float], digits: int = 0) -> tuple[float, ...]:
    import numpy as np

    qs = np.quantile(np.asarray(values, dtype=np.float64), QUANTILES)
    return tuple(int(round(q)) if digits == 0 else round(float(q), digits) for q in qs)


def zipf_exponent(counts: list[int], top: int = 1000) -> float:
    """Least-squares slope of log(frequency) against log(rank) over the `top` most used ids."""
    import numpy as np

    freq = np.sort(np.asarray(counts, dtype=np.float64))[::-1][:top]
    slope = np.polyfit(np.log(np.arange(1, len(freq) + 1)), np.log(freq), 1)[0]
    return round(float(-slope), 3)


def chat_parents(trace: Trace) -> list[int | None]:
    """For each row, the earlier row whose session it continues (None: a new session)."""
    latest: dict[tuple[int, ...], int] = {}
    parents: list[int | None] = []
    for i, row in enumerate(trace.rows):
        parent = None
        for k in range(len(row.blocks), 1, -1):
            parent = latest.get(row.blocks[:k])
            if parent is not None:
                break
        parents.append(parent)
        for k in range(1, len(row.blocks) + 1):
            latest[row.blocks[:k]] = i
    return parents


def fit_chat(trace: Trace) -> dict[str, Any]:
    rows, parents = trace.rows, chat_parents(trace)
    roots: list[int] = []
    for i, parent in enumerate(parents):
        roots.append(i if parent is None else roots[parent])
    turns = collections.Counter(collections.Counter(roots).values())
    multi = {r for r, n in collections.Counter(roots).items() if n >= 2}
    pairs = [(rows[p], rows[i]) for i, p in enumerate(parents) if p is not None]
    new = [c.input_tokens - p.input_tokens - p.output_tokens for p, c in pairs]
    shared = os.path.commonprefix([list(r.blocks) for r in rows])
    return {
        "CHAT_SHARED_BLOCKS": len(shared),
        "CHAT_FIRST_INPUT_Q": quantiles([rows[r].input_tokens for r in sorted(multi)]),
        "CHAT_NEW_MESSAGE_Q": quantiles([n for n in new if n > 0]),
        "CHAT_OUTPUT_Q": quantiles([r.output_tokens for r in rows]),
        "CHAT_THINK_Q": quantiles([c.arrival_s - p.arrival_s for p, c in pairs], digits=1),
        "CHAT_TURNS_PMF": {n: turns[n] for n in sorted(turns) if n >= 2},
    }


def fit_rag(trace: Trace) -> dict[str, Any]:
    rows = trace.rows

    def parts(row, kind):
        return [(b, n) for b, n, k in zip(row.blocks, row.block_lengths, row.block_kinds) if k == kind]

    sys_parts = [parts(r, "sys_prompt") for r in rows]
    variants = collections.Counter(s[0][0] for s in sys_parts)
    sys_variants = []
    for block_id, count in variants.most_common():
        tails = [s[2] for s in sys_parts if s[0][0] == block_id]
        tail_len = collections.Counter(n for _, n in tails).most_common(1)[0][0]
        sys_variants.append((count, tail_len, len({b for b, _ in tails}) == 1))
    second = collections.Counter(s[1][0] for s in sys_parts)
    passage_refs = collections.Counter(b for r in rows for b, _ in parts(r, "passage"))
    passage_len = {b: n for r in rows for b, n in parts(r, "passage")}
    sessions: dict[str, list[float]] = collections.defaultdict(list)
    for r in rows:
        sessions[r.session_id].append(r.arrival_s)
    gaps = [b - a for times in sessions.values() for a, b in zip(times, times[1:]) if b - a <= MAX_THINK_S]
    turns = collections.Counter(len(t) for t in sessions.values())
    first_history = collections.Counter(tuple(parts(r, "history")) for r in rows).most_common(1)[0][0]
    template = [r.input_tokens - sum(r.block_lengths) for r in rows]
    return {
        "RAG_SYS_BLOCK_TOKENS": collections.Counter(n for s in sys_parts for _, n in s[:2]).most_common(1)[0][0],
        "RAG_SYS_VARIANTS": tuple(sys_variants),
        "RAG_SYS_POOL_PER_REQUEST": round(len(second) / len(rows), 4),
        "RAG_SYS_POOL_ZIPF": zipf_exponent(list(second.values())),
        "RAG_PASSAGES_PMF": dict(sorted(collections.Counter(len(parts(r, "passage")) for r in rows).items())),
        "RAG_PASSAGE_LEN_Q": quantiles(list(passage_len.values())),
        "RAG_PASSAGE_POOL_PER_REF": round(len(passage_refs) / sum(passage_refs.values()), 4),
        "RAG_PASSAGE_ZIPF": zipf_exponent(list(passage_refs.values())),
        "RAG_EMPTY_HISTORY_TOKENS": sum(n for _, n in first_history),
        "RAG_WEB_PMF": dict(sorted(collections.Counter(len(parts(r, "web_search")) for r in rows).items())),
        "RAG_WEB_LEN_Q": quantiles([n for r in rows for _, n in parts(r, "web_search")]),
        "RAG_QUESTION_Q": quantiles([n for r in rows for _, n in parts(r, "question")]),
        "RAG_TEMPLATE_TOKENS": (min(template), max(template)),
        "RAG_OUTPUT_Q": quantiles([r.output_tokens for r in rows]),
        "RAG_TURNS_PMF": dict(sorted(turns.items())),
        "RAG_THINK_Q": quantiles(gaps, digits=1),
    }


def fit_burst(trace: Trace) -> dict[str, Any]:
    import numpy as np

    times = np.asarray([r.arrival_s for r in trace.rows])
    gaps = np.diff(times)
    gaps = gaps[gaps > 0]
    # Gamma shape by maximum likelihood (Minka's closed-form approximation); burstiness = 1/shape.
    s = math.log(gaps.mean()) - np.log(gaps).mean()
    shape = (3 - s + math.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
    return {
        "BURST_INPUT_Q": quantiles([r.input_tokens for r in trace.rows]),
        "BURST_OUTPUT_Q": quantiles([r.output_tokens for r in trace.rows]),
        "BURST_RATE": round((len(times) - 1) / float(times[-1] - times[0]), 3),
        "BURST_BURSTINESS": round(1.0 / float(shape), 3),
    }


def fit_all(root: Path) -> dict[str, dict[str, Any]]:
    """Source file (relative to root) -> the constants fitted from it."""
    sources = {
        "mooncake/conversation_trace.jsonl": fit_chat,
        "ragpulse/0_trace.jsonl": fit_rag,
        "azure_llm_2023/AzureLLMInferenceTrace_code.csv": fit_burst,
    }
    return {name: fit(read_trace(root / name)) for name, fit in sources.items()}


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else traces_dir()
    for source, constants in fit_all(root).items():
        print(f"\n# Fitted from {source} (python -m workloads.fit)")
        for name, value in constants.items():
            print(f"{name} = {value!r}")


if __name__ == "__main__":
    main()

"""Bit-width transition windows of engines that change expert precision (pagedweight, full), as
pure functions of steps.parquet and requests.parquet rows.

A step is a *transition step* when a bit-width move started in it (x_promotions or
x_demotions > 0) or a move's copies were in flight while it computed (x_moves_in_flight > 0);
a *window* is a maximal run of consecutive transition steps. Latency is split by where each
inter-token gap ends: token times of in-process engines are the end times of the steps that
produced them (t_s + duration_s), so a gap is *inside* when the step that produced its later
token is a transition step. The per-request record of the widths that served each request is
the engine's `request_bits` table (engines/pagedweight/controller.py).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Any

from harness.metrics import percentile

MOVE_COLUMNS = ("x_promotions", "x_demotions")
ITL_PERCENTILES = (50, 90, 99)
# A token time is the end of the step that produced it up to float rounding of t_s + duration_s.
MATCH_TOLERANCE_S = 1e-6


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _count(row: Mapping[str, Any], key: str) -> float:
    value = row.get(key)
    return float(value) if _present(value) else 0.0


def has_bit_widths(steps: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the steps carry bit-width move extras (an engine that changes expert precision)."""
    return any(_present(s.get(k)) for s in steps for k in MOVE_COLUMNS)


def transition_steps(steps: Sequence[Mapping[str, Any]]) -> set[int]:
    """Indexes (positions in `steps`) of the steps that started a bit-width move or computed
    while one was in flight."""
    return {i for i, s in enumerate(steps)
            if any(_count(s, k) > 0 for k in (*MOVE_COLUMNS, "x_moves_in_flight"))}


def windows(indexes: set[int]) -> int:
    """Maximal runs of consecutive step indexes."""
    return sum(1 for i in indexes if i - 1 not in indexes)


def _itl_ms(gaps: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for q in ITL_PERCENTILES:
        p = percentile(gaps, q)
        out[f"p{q}"] = p * 1e3 if p is not None else None
    return out


def split_gaps(requests: Sequence[Mapping[str, Any]], steps: Sequence[Mapping[str, Any]],
               inside: set[int]) -> tuple[list[float], list[float]]:
    """Inter-token gaps (seconds) of the measured requests, split by whether the step that
    produced the later token is in `inside`. A token time that is no step's end time is left
    out (with the gap that ends at it)."""
    ends = [s["t_s"] + s["duration_s"] for s in steps]
    order = sorted(range(len(ends)), key=ends.__getitem__)
    sorted_ends = [ends[i] for i in order]

    def step_of(t: float) -> int | None:
        k = bisect.bisect_left(sorted_ends, t)
        near = [j for j in (k - 1, k) if 0 <= j < len(sorted_ends)]
        best = min(near, key=lambda j: abs(sorted_ends[j] - t), default=None)
        return order[best] if best is not None and abs(sorted_ends[best] - t) <= MATCH_TOLERANCE_S else None

    gaps_in: list[float] = []
    gaps_out: list[float] = []
    for r in requests:
        if r.get("warmup"):
            continue
        times = list(r.get("token_times_s") if r.get("token_times_s") is not None else [])
        for a, b in zip(times, times[1:]):
            step = step_of(b)
            if step is not None:
                (gaps_in if step in inside else gaps_out).append(b - a)
    return gaps_in, gaps_out


def transition_summary(requests: Sequence[Mapping[str, Any]], steps: Sequence[Mapping[str, Any]],
                       duration_s: float) -> dict[str, Any] | None:
    """Windows, their rate, the bytes moved by transitions and inter-token latency inside vs
    outside the windows; None for a run whose steps carry no bit-width extras."""
    if not has_bit_widths(steps):
        return None
    inside = transition_steps(steps)
    gaps_in, gaps_out = split_gaps(requests, steps, inside)
    n = windows(inside)
    return {
        "windows": n,
        "per_minute": n * 60.0 / duration_s if duration_s > 0 else 0.0,
        "move_bytes": int(sum(_count(s, "x_move_bytes") for s in steps)),
        "itl_ms_inside": _itl_ms(gaps_in),
        "itl_ms_outside": _itl_ms(gaps_out),
        "steps_inside": len(inside),
        "steps_outside": len(steps) - len(inside),
    }

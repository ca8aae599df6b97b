"""Metrics as pure functions of raw records, so any summary can be recomputed from saved files.

Inputs are the rows of requests.parquet and steps.parquet (plain dicts / DataFrames of
timestamps and counts in seconds from run start); outputs are plain dicts with unit
suffixes (`_ms`, `_s`, `_per_s`, `_bytes`). Nothing here reads a clock or an engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

PERCENTILES = (50, 90, 95, 99)
# MLPerf Inference server targets for Mixtral-8x7B: p99 TTFT 2 s, p99 TPOT 200 ms.
DEFAULT_SLO = {"ttft_ms": 2000.0, "tpot_ms": 200.0}

# What the summary's latency numbers mean, written into every run.json: tools differ here, and a
# TPOT compared across tools must be compared by definition.
DEFINITIONS = {
    "token_time": "in-process engines: the end of the step that produced the token; engine openai: when its "
                  "streamed chunk arrived",
    "ttft_ms": "first token time - arrival time (includes queueing)",
    "tpot_ms": "pwbench: (last token time - first token time) / (output tokens - 1), per request; vLLM bench "
               "serve's TPOT is (end-to-end latency - TTFT) / (output tokens - 1), the same when the stream "
               "ends with its last token",
    "itl_ms": "gaps between consecutive tokens (several tokens in one chunk have gaps of 0); vLLM's ITL is "
              "the gap between chunks",
    "e2e_ms": "finish time - arrival time",
}


@dataclass(frozen=True)
class RequestTimes:
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    queue_s: float | None
    itl_s: tuple[float, ...]


def request_times(row: Mapping[str, Any]) -> RequestTimes:
    """Per-request latencies from arrival_s, started_s, token_times_s and finish_s.

    TPOT divides by output_tokens - 1 when the row gives output_tokens: the same as the token
    times' count for pwbench's own runs, and right for imported rows whose times are per
    streamed chunk (a chunk may carry several tokens), as vLLM counts them."""
    arrival = row["arrival_s"]
    tokens = list(row.get("token_times_s") or [])
    started = row.get("started_s")
    ttft = tokens[0] - arrival if tokens else None
    itl = tuple(b - a for a, b in zip(tokens, tokens[1:]))
    n = row.get("output_tokens") or len(tokens)
    tpot = (tokens[-1] - tokens[0]) / (n - 1) if tokens and n > 1 else None
    finish = row.get("finish_s")
    e2e = finish - arrival if finish is not None and not _nan(finish) else None
    queue = started - arrival if started is not None and not _nan(started) else None
    return RequestTimes(ttft, tpot, e2e, queue, itl)


def _nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), None for no values."""
    if not len(values):
        return None
    return _ranked(_sort(values), q)


def _sort(values: Sequence[float]):
    # numpy's sort: a run's millions of inter-token gaps sorted as one float64 array, not a
    # list of Python floats four times their size; the same order, so the same percentiles.
    import numpy as np  # noqa: PLC0415

    return np.sort(np.asarray(values, dtype=np.float64))


def _ranked(xs, q: float) -> float:
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    a, b = float(xs[lo]), float(xs[hi])
    return a + (b - a) * (pos - lo)


def distribution(values: Sequence[float], scale: float = 1e3, in_place: bool = False) -> dict[str, float | None]:
    """mean and p50/p90/p95/p99 of `values` (seconds), times `scale` (default: to ms).
    `in_place`: `values` is a float64 array('d') the caller gives up, sorted where it lies (a
    run's inter-token gaps: no second copy of millions of floats)."""
    n = len(values)
    out: dict[str, float | None] = {"mean": sum(values) / n * scale if n else None}
    if in_place and n:
        import numpy as np  # noqa: PLC0415

        xs = np.frombuffer(values, dtype=np.float64)
        xs.sort()
    else:
        xs = _sort(values) if n else None
    for q in PERCENTILES:
        out[f"p{q}"] = _ranked(xs, q) * scale if n else None
    return out


def meets_slo(t: RequestTimes, slo: Mapping[str, float]) -> bool:
    checks = {"ttft_ms": t.ttft_s, "tpot_ms": t.tpot_s, "e2e_ms": t.e2e_s}
    for key, limit in slo.items():
        value = checks.get(key)
        if key not in checks:
            raise ValueError(f"unknown SLO {key!r}; valid: {', '.join(checks)}")
        # A request with a single output token has no TPOT: it cannot violate that target.
        if value is not None and value * 1e3 > limit:
            return False
    return True


def summarize_requests(rows: Iterable[Mapping[str, Any]], slo: Mapping[str, float] = DEFAULT_SLO) -> dict[str, Any]:
    """Aggregate latency/throughput metrics over the measured (non-warm-up) requests.

    One pass over `rows` (a list, or a result file read a batch at a time): it keeps each
    request's few numbers in float64 arrays, never the rows, so a run of any size fits."""
    from array import array  # noqa: PLC0415

    requests = failed = good = out_tokens = in_tokens = 0
    start: float | None = None
    end: float | None = None
    ttft, tpot, itl, e2e, queue = (array("d") for _ in range(5))
    spans: list[tuple[float, float]] = []  # (sent, finish) of each completed request
    for r in rows:
        if r.get("warmup"):
            continue
        requests += 1
        start = r["arrival_s"] if start is None else min(start, r["arrival_s"])
        if r.get("error"):
            failed += 1
            continue
        finish = r.get("finish_s")
        if finish is None or _nan(finish):
            continue
        end = finish if end is None else max(end, finish)
        t = request_times(r)
        for values, value in ((ttft, t.ttft_s), (tpot, t.tpot_s), (e2e, t.e2e_s), (queue, t.queue_s)):
            if value is not None:
                values.append(value)
        itl.extend(t.itl_s)
        good += meets_slo(t, slo)
        out_tokens += r["output_tokens"]
        in_tokens += r["prompt_tokens"]
        spans.append((r.get("sent_s", r["arrival_s"]), finish))
    start = 0.0 if start is None else start
    duration = max((start if end is None else end) - start, 1e-9)
    done = len(spans)
    return {
        "requests": requests,
        "completed": done,
        "failed": failed,
        "duration_s": duration,
        "requests_per_s": done / duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "input_tokens_per_s": in_tokens / duration,
        "output_tokens_per_s": out_tokens / duration,
        "ttft_ms": distribution(ttft, in_place=True),
        "tpot_ms": distribution(tpot, in_place=True),
        "itl_ms": distribution(itl, in_place=True),
        "e2e_ms": distribution(e2e, in_place=True),
        "queue_ms": distribution(queue, in_place=True),
        "slo": dict(slo),
        "goodput_requests_per_s": good / duration,
        "slo_attainment": good / done if done else None,
        "peak_concurrency": _peak(spans),
    }


def peak_concurrency(rows: Sequence[Mapping[str, Any]]) -> int:
    """Most requests in flight at once (sent and not finished)."""
    return _peak([(r.get("sent_s", r["arrival_s"]), r["finish_s"]) for r in rows])


def _peak(spans: Sequence[tuple[float, float]]) -> int:
    events = []
    for sent, finish in spans:
        events.append((sent, 1))
        events.append((finish, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # a finish at time t frees its slot before a send at t
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def summarize_steps(steps: Sequence[Mapping[str, Any]], output_tokens: int) -> dict[str, Any]:
    """Engine-side throughput and data movement from steps.parquet rows."""
    prefill_steps = [s for s in steps if s["prefill_tokens"] > 0]
    decode_steps = [s for s in steps if s["prefill_tokens"] == 0 and s["decode_tokens"] > 0]
    prefill_time = sum(s["duration_s"] for s in prefill_steps)
    decode_time = sum(s["duration_s"] for s in decode_steps)
    h2d = sum(s["h2d_bytes"] for s in steps)
    d2h = sum(s["d2h_bytes"] for s in steps)
    cached = sum(s.get("cached_prompt_tokens", 0) for s in steps)
    computed = sum(s["prefill_tokens"] for s in steps)
    return {
        "steps": len(steps),
        "busy_s": sum(s["duration_s"] for s in steps),
        # Steps with any prefill count for prefill (decodes riding along included); decode
        # throughput uses decode-only steps, so neither number is diluted by the other phase.
        "prefill_tokens_per_s": (sum(s["prefill_tokens"] for s in prefill_steps) / prefill_time
                                 if prefill_time else None),
        "decode_tokens_per_s": sum(s["decode_tokens"] for s in decode_steps) / decode_time if decode_time else None,
        "h2d_bytes": h2d,
        "d2h_bytes": d2h,
        "h2d_transfers": sum(s["h2d_transfers"] for s in steps),
        "d2h_transfers": sum(s["d2h_transfers"] for s in steps),
        "h2d_bytes_per_output_token": h2d / output_tokens if output_tokens else None,
        "d2h_bytes_per_output_token": d2h / output_tokens if output_tokens else None,
        "experts_hit_per_step_mean": sum(s["experts_hit"] for s in steps) / len(steps) if steps else None,
        "preemptions": sum(s.get("preempted", 0) for s in steps),
        # Prompt tokens served from the prefix cache / all prompt tokens the engine had to
        # provide K/V for (cached + computed, recomputes after preemption included).
        "cached_prompt_tokens": cached,
        "prefix_cache_hit_rate": cached / (cached + computed) if cached + computed else None,
    }


# StepOutput's per-step counters -> steps.parquet columns: every field is a column under its
# own name but these; `extras` become x_<key> columns. New StepOutput fields appear by themselves.
STEP_COLUMN_NAMES = {"num_prefill_tokens": "prefill_tokens", "num_decode_tokens": "decode_tokens",
                     "num_running": "running", "num_waiting": "waiting", "num_preempted": "preempted"}
_NOT_COLUMNS = ("outputs", "started", "extras")


def step_row(out: Any) -> dict[str, Any]:
    """One steps.parquet row (without its timestamps) from a StepOutput."""
    names = _ROW_FIELDS.get(type(out))
    if names is None:  # (field, column) pairs, once per StepOutput type: a simulated run makes ~2,000 rows a second
        names = _ROW_FIELDS[type(out)] = [(f.name, STEP_COLUMN_NAMES.get(f.name, f.name)) for f in fields(out)
                                          if f.name not in _NOT_COLUMNS]
    row = {column: getattr(out, name) for name, column in names}
    row.update({f"x_{k}": v for k, v in out.extras.items()})
    return row


_ROW_FIELDS: dict[type, list[tuple[str, str]]] = {}


def efficiency(steps: Sequence[Mapping[str, Any]], model: Mapping[str, Any],
               peaks: Mapping[str, Any]) -> dict[str, Any]:
    """MBU / MFU of decode-only steps and host->device bandwidth use against the peaks.

    Bytes read per decode step = the weights the step read (its `weight_bytes_read`, at their
    stored size; for an engine that does not report it, dense weights + experts hit x bytes
    per expert) + K/V of every attended token; FLOPs = 2 x active parameters x tokens.
    `model` comes from the engine info (model_stats); `peaks` from `pwbench hw` or the
    datasheet table.
    """
    decode = [s for s in steps if s["prefill_tokens"] == 0 and s["decode_tokens"] > 0]
    out: dict[str, Any] = {"peaks_source": peaks.get("source")}
    if not decode or not model:
        return out
    time = sum(s["duration_s"] for s in decode)
    read = sum(
        (s.get("weight_bytes_read") or model["dense_weight_bytes"] + s["experts_hit"] * model["bytes_per_expert"])
        + s.get("context_tokens", 0) * model["kv_bytes_per_token"]
        for s in decode
    )
    flops = sum(2 * model["active_params_per_token"] * s["decode_tokens"] for s in decode)
    out["decode_bandwidth_bytes_per_s"] = read / time
    out["decode_flops_per_s"] = flops / time
    if peaks.get("memory_bandwidth_bytes_per_s"):
        out["mbu"] = out["decode_bandwidth_bytes_per_s"] / peaks["memory_bandwidth_bytes_per_s"]
    if peaks.get("matmul_flops_per_s"):
        out["mfu"] = out["decode_flops_per_s"] / peaks["matmul_flops_per_s"]
    busy = sum(s["duration_s"] for s in steps)
    h2d = sum(s["h2d_bytes"] for s in steps)
    if busy and peaks.get("h2d_bytes_per_s"):
        out["h2d_link_utilization"] = h2d / busy / peaks["h2d_bytes_per_s"]
    return out


def memory(steps: Sequence[Mapping[str, Any]], model: Mapping[str, Any], peaks: Mapping[str, Any]) -> dict[str, Any]:
    """Device memory against the budget, the expert cache, and the host<->device link.

    Peak device memory is the largest device_weight_bytes + device_kv_bytes after any step.
    The expert cache hit rate counts (layer, expert) uses found resident (x_expert_cache_hits)
    against those copied in at need (x_expert_cache_misses). Achieved link bandwidth is the
    bytes that crossed divided by the time the link spent copying (copy_busy_s); its peak is
    the link model's (CPU) or `pwbench hw`'s measured host->device bandwidth (CUDA).
    """
    out: dict[str, Any] = {"budget_bytes": model.get("device_budget_bytes")}
    if steps:
        peak = max(steps, key=lambda s: s.get("device_weight_bytes", 0) + s.get("device_kv_bytes", 0))
        out["peak_device_bytes"] = peak.get("device_weight_bytes", 0) + peak.get("device_kv_bytes", 0)
        out["peak_kv_bytes"] = max(s.get("device_kv_bytes", 0) for s in steps)
        if out["budget_bytes"]:
            out["peak_share_of_budget"] = out["peak_device_bytes"] / out["budget_bytes"]
    hits = sum(s.get("x_expert_cache_hits", 0) for s in steps)
    misses = sum(s.get("x_expert_cache_misses", 0) for s in steps)
    if hits + misses:
        out.update(expert_cache_hits=hits, expert_cache_misses=misses, expert_cache_hit_rate=hits / (hits + misses))
    issued = sum(s.get("x_prefetch_issued", 0) for s in steps)
    if issued:
        used = sum(s.get("x_prefetch_used", 0) for s in steps)
        out.update(prefetch_issued=issued, prefetch_used=used, prefetch_accuracy=used / issued)
    busy = sum(s.get("copy_busy_s", 0.0) for s in steps)
    if busy:
        stall = sum(s.get("copy_stall_s", 0.0) for s in steps)
        moved = sum(s["h2d_bytes"] + s["d2h_bytes"] for s in steps)
        out.update(copy_busy_s=busy, copy_stall_s=stall, copy_overlap_share=max(0.0, 1 - stall / busy),
                   link_bytes_per_s=moved / busy)
        link_peak = model.get("link_peak_bytes_per_s") or peaks.get("h2d_bytes_per_s")
        if link_peak:
            out["link_peak_bytes_per_s"] = link_peak
            out["link_utilization"] = out["link_bytes_per_s"] / link_peak
    # Engines that stream experts report the expert copies' own link time and wait (x_ columns),
    # apart from copies compute must wait for by nature (activations for host attention).
    expert_busy = sum(s.get("x_expert_copy_busy_s", 0.0) for s in steps)
    if expert_busy:
        expert_stall = sum(s.get("x_expert_copy_stall_s", 0.0) for s in steps)
        out.update(expert_copy_busy_s=expert_busy, expert_copy_stall_s=expert_stall,
                   expert_copy_overlap_share=max(0.0, 1 - expert_stall / expert_busy))
    return out


def expert_precision(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Bit widths of resident experts over the run (engines that change them, x_ columns):
    mean bits after each step (its mean, min, max, first and last), promotions, demotions
    and the bytes their page moves took, quality-feedback checks, the largest relative
    error they measured, fallbacks (experts pinned to higher precision) and what the checks
    cost: rows recomputed, seconds (and their share of the steps' busy time), bytes copied."""
    series = [s["x_mean_bits"] for s in steps if s.get("x_mean_bits") is not None]
    if not series:
        return {}

    def total(key: str) -> float:
        return sum(s.get(key, 0) for s in steps)

    errors = [s["x_feedback_error_max"] for s in steps if s.get("x_feedback_error_max")]
    return {
        "mean_bits": sum(series) / len(series), "min_bits": min(series), "max_bits": max(series),
        "first_bits": series[0], "last_bits": series[-1],
        "promotions": total("x_promotions"), "demotions": total("x_demotions"), "move_bytes": total("x_move_bytes"),
        "feedback_checks": total("x_feedback_checks"), "feedback_error_max": max(errors) if errors else None,
        "fallbacks": total("x_fallbacks"), "feedback_rows": total("x_feedback_rows"),
        "feedback_s": total("x_feedback_s"), "feedback_bytes": total("x_feedback_bytes"),
        "feedback_share_of_busy": total("x_feedback_s") / busy if (busy := total("duration_s")) else None,
    }


def plan_accuracy(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The engine's predicted step times (x_predicted_step_s, engines with a cost model) against
    the measured ones: over every predicted step, and over decode-only steps (medians and the
    ratio of sums)."""
    rows = [s for s in steps if not _nan(s.get("x_predicted_step_s", math.nan)) and s.get("x_predicted_step_s")]
    if not rows:
        return {}
    out: dict[str, Any] = {"steps": len(rows), "predicted_over_measured":
                           sum(s["x_predicted_step_s"] for s in rows) / sum(s["duration_s"] for s in rows)}
    dec = [s for s in rows if s["prefill_tokens"] == 0 and s["decode_tokens"] > 0]
    if dec:
        out.update(decode_steps=len(dec),
                   decode_predicted_step_s_p50=percentile([s["x_predicted_step_s"] for s in dec], 50),
                   decode_measured_step_s_p50=percentile([s["duration_s"] for s in dec], 50),
                   decode_predicted_over_measured=(sum(s["x_predicted_step_s"] for s in dec)
                                                   / sum(s["duration_s"] for s in dec)))
    return out


def answer_correct(output_text: str, answer: str) -> bool:
    """Exact match of a demo task's answer (workloads.demo.tasks.score)."""
    from workloads.demo.tasks import score  # noqa: PLC0415

    return bool(score(output_text, answer))


def task_accuracy(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Exact match per task over requests that carry one (answer vs output_text up to EOS)."""
    from workloads.demo.tasks import score  # noqa: PLC0415

    per: dict[str, list[int]] = {}
    for r in rows:
        if r.get("task") and r.get("answer") is not None and r.get("output_text") is not None and not r.get("error"):
            per.setdefault(r["task"], []).append(int(score(r["output_text"], r["answer"])))
    out: dict[str, Any] = {t: {"correct": sum(v), "total": len(v), "accuracy": sum(v) / len(v)}
                           for t, v in sorted(per.items())}
    total = sum(len(v) for v in per.values())
    if total:
        out["overall"] = {"correct": sum(sum(v) for v in per.values()), "total": total,
                          "accuracy": sum(sum(v) for v in per.values()) / total}
    return out


def summarize(requests: Sequence[Mapping[str, Any]], steps: Sequence[Mapping[str, Any]],
              slo: Mapping[str, float], model: Mapping[str, Any], peaks: Mapping[str, Any]) -> dict[str, Any]:
    """The whole summary of run.json from the raw rows (what `pwbench show` recomputes)."""
    out = summarize_requests(requests, slo)
    out["engine"] = summarize_steps(steps, out["output_tokens"])
    out["efficiency"] = efficiency(steps, model, peaks)
    out["memory"] = memory(steps, model, peaks)
    if precision := expert_precision(steps):
        out["expert_precision"] = precision
    if planned := plan_accuracy(steps):
        out["plan"] = planned
    out["accuracy"] = task_accuracy(requests)
    return out

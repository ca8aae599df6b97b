"""The executive numbers: goodput at the SLO, cost per 1M output tokens, devices for a target
load, accuracy against full precision, peak memory against the budget, and the rule-based
recommendation. Pure functions of loaded runs (reports.runs); every value carries its source.

    cost per 1M output tokens = $/h / (goodput tok/s x 3600) x 10^6
    devices for a load        = ceil(target req/s / (goodput req/s per device x utilisation))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from harness.metrics import meets_slo, request_times
from reports.runs import Run

HOURS_PER_MONTH = 730
# The recommendation's rule: an engine qualifies when it loses at most this many accuracy
# points against full precision and its peak device memory stays within the budget.
ACCURACY_TOLERANCE_POINTS = 1.0
REFERENCE_ENGINE = "moe"  # full precision


@dataclass(frozen=True)
class Prices:
    gpu_hour_usd: float = 4.0
    target_rps: float = 10.0
    utilisation: float = 0.7


@dataclass(frozen=True)
class Value:
    value: float | int | None
    source: str  # "<run folder>: <metric>"
    text: str = ""


def cost_per_million(gpu_hour_usd: float, tokens_per_s: float | None) -> float | None:
    if not tokens_per_s:
        return None
    return gpu_hour_usd / (tokens_per_s * 3600) * 1e6


def devices_needed(target_rps: float, goodput_rps: float | None, utilisation: float) -> int | None:
    if not goodput_rps or utilisation <= 0:
        return None
    return math.ceil(target_rps / (goodput_rps * utilisation) - 1e-9)


def goodput_tokens_per_s(run: Run) -> float | None:
    """Output tokens of the measured requests that met every SLO target, per second of run."""
    s = run.summary
    if not s.get("duration_s"):
        return None
    slo = s.get("slo") or {}
    good = sum(int(r.get("output_tokens") or 0) for r in run.rows("requests")
               if not r.get("warmup") and not r.get("error") and r.get("finish_s") is not None
               and meets_slo(request_times(r), slo))
    return good / s["duration_s"]


def accuracy(run: Run) -> float | None:
    """Correct answers (summary.accuracy) over every measured request that carried a demo task
    (requests.parquet), so a request the engine could not serve counts as not answered: under
    a budget, an engine that cannot hold a long prompt loses that answer. None without tasks."""
    acc = run.summary.get("accuracy") or {}
    correct = acc["overall"]["correct"] if "overall" in acc else sum(a["correct"] for a in acc.values())
    sent = sum(1 for r in run.rows("requests") if r.get("task") is not None and not r.get("warmup"))
    return correct / sent if sent else None


def kv_capacity(run: Run, memory: dict, folder: str) -> Value:
    """KV tokens the run could hold; an engine whose KV lives in host memory (moegen's plan)
    says so, since its pool is not device memory and is not comparable with the others'."""
    tokens = memory.get("kv_capacity_tokens")
    on_host = ((run.run.get("engine") or {}).get("model_stats") or {}).get("plan_kv_on_host") == 1
    source = f"{folder}: summary.memory.kv_capacity_tokens"
    if on_host and tokens is not None:
        return Value(tokens, source + " (engine.model_stats.plan_kv_on_host: in host memory)", f"{tokens:,} (host)")
    return Value(tokens, source)


def executive(runs: list[Run], prices: Prices) -> list[dict[str, Value]]:
    """One dict per run: the executive table's values, each with where it comes from."""
    ref = next((r for r in runs if r.engine == REFERENCE_ENGINE), None)
    ref_acc = accuracy(ref) if ref else None
    out = []
    for r in runs:
        s, m, f = r.summary, r.summary.get("memory") or {}, r.folder.name
        gtok = goodput_tokens_per_s(r)
        acc = accuracy(r)
        delta = (acc - ref_acc) * 100 if acc is not None and ref_acc is not None else None
        out.append({
            "run": Value(None, f"{r.folder}", f),
            "engine": Value(None, f"{f}: engine.name", r.engine),
            "served": Value(s.get("completed"), f"{f}: summary.completed of summary.requests",
                            f"{s.get('completed')}/{s.get('requests')}"),
            "output_tokens_per_s": Value(s.get("output_tokens_per_s"), f"{f}: summary.output_tokens_per_s"),
            "goodput_tokens_per_s": Value(gtok,
                                          f"{f}: requests.parquet, output tokens of requests meeting "
                                          "summary.slo / summary.duration_s"),
            "goodput_rps": Value(s.get("goodput_requests_per_s"), f"{f}: summary.goodput_requests_per_s"),
            "cost_per_1m": Value(cost_per_million(prices.gpu_hour_usd, gtok),
                                 f"{f}: ${prices.gpu_hour_usd:g}/h / (goodput tok/s x 3600) x 1e6"),
            "devices": Value(devices_needed(prices.target_rps, s.get("goodput_requests_per_s"), prices.utilisation),
                             f"{f}: ceil({prices.target_rps:g} req/s / (summary.goodput_requests_per_s x "
                             f"{prices.utilisation:g}))"),
            "kv_capacity_tokens": kv_capacity(r, m, f),
            "peak_concurrency": Value(s.get("peak_concurrency"), f"{f}: summary.peak_concurrency"),
            "accuracy": Value(acc,
                              f"{f}: summary.accuracy.overall.correct / requests.parquet rows with a task "
                              "(unserved = not answered)"),
            "top1_agreement": Value((r.run.get("quality") or {}).get("top1_agreement"),
                                    f"{f}: quality.top1_agreement (teacher-forced, vs the float32 reference)"),
            "accuracy_delta_points": Value(delta, f"{f} vs {ref.folder.name if ref else '-'}: summary.accuracy"),
            "peak_device_bytes": Value(m.get("peak_device_bytes"), f"{f}: summary.memory.peak_device_bytes"),
            "budget_bytes": Value(m.get("budget_bytes"), f"{f}: summary.memory.budget_bytes"),
            "h2d_bytes_per_token": Value((s.get("engine") or {}).get("h2d_bytes_per_output_token"),
                                         f"{f}: summary.engine.h2d_bytes_per_output_token"),
        })
    return out


RULE = (f"Rule: among the comparable runs whose accuracy is within {ACCURACY_TOLERANCE_POINTS:g} point of full "
        f"precision ({REFERENCE_ENGINE}) and whose peak device memory fits the budget, recommend the one with the "
        "highest goodput (requests/s meeting the SLO) per device; savings are the devices it saves at the target "
        f"load x $/h x {HOURS_PER_MONTH} h/month.")


def recommend(rows: list[dict[str, Value]], prices: Prices, excluded: set[str] = frozenset()) -> tuple[str | None, str]:
    """(engine row recommended or None, one plain-language sentence), by RULE."""
    def label(row):
        return row["run"].text

    ref = next((row for row in rows if row["engine"].text == REFERENCE_ENGINE and label(row) not in excluded), None)
    qualifying = []
    for row in rows:
        if label(row) in excluded:
            continue
        delta = row["accuracy_delta_points"].value
        if ref is not None and row is not ref and (delta is None or delta < -ACCURACY_TOLERANCE_POINTS):
            continue
        peak, budget = row["peak_device_bytes"].value, row["budget_bytes"].value
        if budget and peak is not None and peak > budget:
            continue
        if row["goodput_rps"].value:
            qualifying.append(row)
    if not qualifying:
        return None, "No run meets the SLO within the accuracy tolerance and the budget: keep the current setup."
    best = max(qualifying, key=lambda row: row["goodput_rps"].value)
    name = label(best)
    if ref is None:
        return name, (f"{name} has the highest goodput ({best['goodput_rps'].value:.2f} req/s at the SLO); "
                      "no full-precision run to judge its accuracy against.")
    if best is ref:
        return name, (f"Stay with full precision ({name}): no other engine serves more requests per device at the SLO "
                      f"within {ACCURACY_TOLERANCE_POINTS:g} accuracy point.")
    ratio = best["goodput_rps"].value / ref["goodput_rps"].value if ref["goodput_rps"].value else None
    d_best, d_ref = best["devices"].value, ref["devices"].value
    saved = d_ref - d_best if d_best is not None and d_ref is not None else None
    delta = best["accuracy_delta_points"].value
    text = f"{name} serves " + (f"{ratio:.2f}x the requests per device at the SLO" if ratio
                                else "requests at the SLO where full precision serves none")
    text += f" at {delta:+.1f} points accuracy" if delta is not None else ""
    if saved is not None:
        text += (f": at {prices.target_rps:g} req/s, {saved} fewer devices ({d_best} vs {d_ref}), about "
                 f"${saved * prices.gpu_hour_usd * HOURS_PER_MONTH:,.0f} per month")
    return name, text + "."


def fmt(key: str, v: Value) -> str:
    x = v.value
    if key in ("run", "engine", "served"):
        return v.text
    if x is None:
        return "-"
    if key == "kv_capacity_tokens" and v.text:
        return v.text
    if key in ("accuracy", "top1_agreement"):
        return f"{x * 100:.1f}%"
    if key == "accuracy_delta_points":
        return f"{x:+.1f} pt"
    if key in ("peak_device_bytes", "budget_bytes"):
        return f"{x / 2**20:.2f} MiB"
    if key == "cost_per_1m":
        return f"${x:,.2f}"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"


COLUMNS = {
    "run": "run", "engine": "engine", "served": "served", "goodput_tokens_per_s": "goodput tok/s",
    "output_tokens_per_s": "out tok/s", "goodput_rps": "goodput req/s", "cost_per_1m": "$ / 1M tok",
    "devices": "devices", "kv_capacity_tokens": "KV tokens", "peak_concurrency": "peak users", "accuracy": "accuracy",
    "accuracy_delta_points": "vs full", "top1_agreement": "top-1 vs fp32", "peak_device_bytes": "peak mem",
    "budget_bytes": "budget", "h2d_bytes_per_token": "h2d B/tok",
}


# The HTML page's table: the engine name and the budget are said once above it.
PAGE = {k: v for k, v in COLUMNS.items() if k not in ("engine", "budget_bytes")}
# The terminal's shorter table (the suite's summary, `pwbench compare`).
COMPACT = {k: COLUMNS[k] for k in ("run", "served", "goodput_tokens_per_s", "cost_per_1m", "devices",
                                   "kv_capacity_tokens", "accuracy", "accuracy_delta_points", "top1_agreement",
                                   "peak_device_bytes", "h2d_bytes_per_token")}


def table(rows: list[dict[str, Value]], columns: dict[str, str] | None = None) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells (for the terminal, Markdown and HTML)."""
    columns = columns or COLUMNS
    return list(columns.values()), [[fmt(k, row[k]) for k in columns] for row in rows]


def as_dict(rows: list[dict[str, Value]]) -> list[dict[str, Any]]:
    return [{k: (v.text if k in ("run", "engine") else v.value) for k, v in row.items()} for row in rows]

"""The executive numbers, per arm (reports.runs.arms: the repeats of one configuration):
capacity at the SLO, goodput, cost per 1M output tokens, devices for a target load, and
quality kept apart from capacity (share served; accuracy among served requests; fidelity to
full precision; answer flips); the recommendation built on them is reports.verdict. Pure
functions of loaded runs; every value carries its source, and an arm's value is the median of
its repeats with a 95% interval.

    per device        = capacity req/s at the SLO (run.json capacity), else goodput req/s
    cost per 1M output tokens = $/h / (per-device req/s x mean output tokens per served request x 3600) x 10^6
                                (without a capacity search: $/h / (goodput tok/s x 3600) x 10^6)
    devices for a load        = ceil(target req/s / (per-device req/s x utilisation))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from harness.metrics import answer_correct, meets_slo, request_times
from reports import stats
from reports.runs import Arm, Run, arms, describe_config

HOURS_PER_MONTH = 730
# The recommendation's quality tolerance against full precision: accuracy among the requests
# both served within this many points, and no more lost flips per run than full precision's own.
ACCURACY_TOLERANCE_POINTS = 1.0
REFERENCE_ENGINE = "moe"  # full precision
NO_CAPACITY = "(goodput at the offered rate; no capacity search)"


@dataclass(frozen=True)
class Prices:
    gpu_hour_usd: float = 4.0
    target_rps: float = 10.0
    utilisation: float = 0.7


@dataclass(frozen=True)
class Value:
    value: float | int | None  # an arm's median (or pooled share, said in source)
    source: str  # "<run folder(s)>: <metric>"
    text: str = ""
    samples: tuple[float, ...] = field(default=(), repr=False)  # one per repeat
    low: float | None = None  # 95% interval (reports.stats)
    high: float | None = None


def cost_per_million(gpu_hour_usd: float, tokens_per_s: float | None) -> float | None:
    if not tokens_per_s:
        return None
    return gpu_hour_usd / (tokens_per_s * 3600) * 1e6


def devices_needed(target_rps: float, goodput_rps: float | None, utilisation: float) -> int | None:
    if not goodput_rps or utilisation <= 0:
        return None
    return math.ceil(target_rps / (goodput_rps * utilisation) - 1e-9)


def served_rows(run: Run) -> list[dict[str, Any]]:
    """Measured requests the engine served (no error, finished)."""
    return [r for r in run.rows("requests")
            if not r.get("warmup") and not r.get("error") and r.get("finish_s") is not None]


def goodput_tokens_per_s(run: Run) -> float | None:
    """Output tokens of the measured requests that met every SLO target, per second of run."""
    s = run.summary
    if not s.get("duration_s"):
        return None
    slo = s.get("slo") or {}
    good = sum(int(r.get("output_tokens") or 0) for r in served_rows(run) if meets_slo(request_times(r), slo))
    return good / s["duration_s"]


def served_share(run: Run) -> tuple[int, int]:
    """(served, sent) measured requests: capacity, reported apart from quality."""
    s = run.summary
    sent = s.get("requests")
    if sent is None:
        sent = sum(1 for r in run.rows("requests") if not r.get("warmup"))
    served = s.get("completed")
    return (len(served_rows(run)) if served is None else int(served)), int(sent)


def correctness(run: Run) -> dict[str, bool] | None:
    """request_id -> answer correct, for the served requests that carry a demo task: the
    `correct` column where it is set, else the task's exact-match score on output_text.
    None when the run has no task-bearing request."""
    out: dict[str, bool] = {}
    for r in served_rows(run):
        if r.get("task") is None:
            continue
        if r.get("correct") is not None:
            out[str(r["request_id"])] = bool(r["correct"])
        elif r.get("answer") is not None and r.get("output_text") is not None:
            out[str(r["request_id"])] = answer_correct(r["output_text"], r["answer"])
    return out or None


def accuracy(run: Run) -> float | None:
    """Correct answers among the served requests that carried a demo task; a request the engine
    could not serve is capacity (served share), not a wrong answer. None without tasks."""
    c = correctness(run)
    return sum(c.values()) / len(c) if c else None


def fidelity_counts(run: Run) -> tuple[int, int, int, int] | None:
    """(identical, compared, flips lost, flips gained) against the full-precision reference:
    requests.parquet ref_identical/flip when present, else summary.fidelity; None without."""
    rows = served_rows(run)
    checked = [r for r in rows if r.get("ref_identical") is not None]
    if checked:
        flips = [r.get("flip") for r in rows]
        return (sum(1 for r in checked if r["ref_identical"]), len(checked), flips.count("lost"),
                flips.count("gained"))
    f = run.summary.get("fidelity")
    if not f or f.get("compared") is None:
        return None
    return int(f.get("identical") or 0), int(f["compared"]), int(f.get("flips_lost") or 0), \
        int(f.get("flips_gained") or 0)


def stability_flips(run: Run) -> int | None:
    st = run.run.get("stability")
    if not st or not st.get("loads"):
        return None
    return sum(int(x.get("flips") or 0) for x in st["loads"])


def capacity_rps(run: Run) -> float | None:
    cap = run.run.get("capacity")
    return None if not cap else cap.get("requests_per_s")


def mean_output_tokens(runs: list[Run]) -> float | None:
    """Output tokens per served request, pooled over the arm's runs."""
    toks = [int(r.get("output_tokens") or 0) for run in runs for r in served_rows(run)]
    if toks:
        return sum(toks) / len(toks)
    done = sum(run.summary.get("completed") or 0 for run in runs)
    return sum(run.summary.get("output_tokens") or 0 for run in runs) / done if done else None


def kv_capacity(run: Run, memory: dict, folder: str) -> Value:
    """KV tokens the run could hold; an engine whose KV lives in host memory (moegen's plan)
    says so, since its pool is not device memory and is not comparable with the others'."""
    tokens = memory.get("kv_capacity_tokens")
    on_host = ((run.run.get("engine") or {}).get("model_stats") or {}).get("plan_kv_on_host") == 1
    source = f"{folder}: summary.memory.kv_capacity_tokens"
    if on_host and tokens is not None:
        return Value(tokens, source + " (engine.model_stats.plan_kv_on_host: in host memory)", f"{tokens:,} (host)")
    return Value(tokens, source)


def _folders(arm: Arm) -> str:
    return ", ".join(arm.folders)


def _repeated(arm: Arm, samples: list[float | None], source: str) -> Value:
    """An arm's metric: the median of its repeats with their 95% interval (reports.stats)."""
    est = stats.estimate(samples)
    note = (f"median of {est.n} runs, 95% CI (Student t, on logs when positive)" if est.has_interval
            else "one run: no interval" if est.n == 1 else "")
    return Value(est.median, f"{_folders(arm)}: {source}" + (f" [{note}]" if note else ""), "",
                 tuple(float(x) for x in samples if x is not None), est.low, est.high)


def searched(run: Run) -> bool:
    """The run searched its capacity (whatever it found, even none)."""
    cap = run.run.get("capacity")
    return bool(cap) and "points" in cap


def capacity_value(arm: Arm, source: str) -> Value:
    """The arm's capacity: the median of its repeats' found rates; text "lower bound" when a
    search passed at its highest rate (the capacity is at least that), "< R req/s" when no
    repeat passed even the lowest rate R it tried."""
    caps = [capacity_rps(r) for r in arm.runs]
    v = _repeated(arm, caps, source)
    limits = {(r.run.get("capacity") or {}).get("limit") for r in arm.runs}
    if v.value is None:
        tried = [p["rate"] for r in arm.runs for p in (r.run.get("capacity") or {}).get("points") or []]
        return Value(None, v.source + " (no rate tried met the SLO)", f"< {_number(min(tried))}" if tried else "")
    if "above_highest_rate" in limits:
        return Value(v.value, v.source + " (a lower bound: the search passed at its highest rate)", "lower bound",
                     v.samples, v.low, v.high)
    return v


def _per_device(arm: Arm) -> tuple[Value, str]:
    """The per-device req/s that drives devices and cost: capacity when every run searched it."""
    if all(searched(r) for r in arm.runs):
        return capacity_value(arm, "capacity.requests_per_s (highest rate meeting the SLO criterion)"), "capacity"
    good = [r.summary.get("goodput_requests_per_s") for r in arm.runs]
    return _repeated(arm, good, f"summary.goodput_requests_per_s {NO_CAPACITY}"), "goodput"


def _quality_vs_reference(arm: Arm, ref: Arm | None) -> tuple[float | None, int]:
    """Accuracy points of `arm` minus full precision's, on the task requests both served (each
    request's correctness averaged over repeats); (None, 0) without a shared request."""
    if ref is None:
        return None, 0

    def pooled(a: Arm) -> dict[str, float]:
        per: dict[str, list[bool]] = {}
        for run in a.runs:
            for rid, ok in (correctness(run) or {}).items():
                per.setdefault(rid, []).append(ok)
        return {rid: sum(v) / len(v) for rid, v in per.items()}

    mine, theirs = pooled(arm), pooled(ref)
    both = sorted(set(mine) & set(theirs))
    if not both:
        return None, 0
    return (sum(mine[k] for k in both) - sum(theirs[k] for k in both)) / len(both) * 100, len(both)


def reference_arm(all_arms: list[Arm], excluded: set[str] = frozenset()) -> Arm | None:
    return next((a for a in all_arms if a.engine == REFERENCE_ENGINE and not is_excluded(a.label, a.folders, excluded)),
                None)


def is_excluded(label: str, folders: list[str], excluded: set[str]) -> bool:
    return label in excluded or any(f in excluded for f in folders)


def arm_row(arm: Arm, prices: Prices, ref: Arm | None) -> dict[str, Value]:
    f = _folders(arm)
    first = arm.runs[0]
    m = first.summary.get("memory") or {}
    served = [served_share(r) for r in arm.runs]
    n_served, n_sent = sum(s[0] for s in served), sum(s[1] for s in served)
    per_device, basis = _per_device(arm)
    est = stats.estimate(list(per_device.samples))
    mean_out = mean_output_tokens(arm.runs)
    if basis == "capacity":
        def cost(rps):
            return cost_per_million(prices.gpu_hour_usd, rps * mean_out if rps and mean_out else None)
        cost_src = (f"{f}: ${prices.gpu_hour_usd:g}/h / (capacity req/s x {mean_out or 0:.1f} mean output tokens per "
                    "served request x 3600) x 1e6")
        cost_v = Value(cost(est.median), cost_src, "", (), cost(est.high) if est.has_interval else None,
                       cost(est.low) if est.has_interval else None)
    else:
        gtoks = stats.estimate([goodput_tokens_per_s(r) for r in arm.runs])
        cost_v = Value(cost_per_million(prices.gpu_hour_usd, gtoks.median),
                       f"{f}: ${prices.gpu_hour_usd:g}/h / (goodput tok/s x 3600) x 1e6 {NO_CAPACITY}", "", (),
                       cost_per_million(prices.gpu_hour_usd, gtoks.high) if gtoks.has_interval else None,
                       cost_per_million(prices.gpu_hour_usd, gtoks.low) if gtoks.has_interval else None)

    def devices(rps):
        return devices_needed(prices.target_rps, rps, prices.utilisation)

    per = "capacity req/s" if basis == "capacity" else "goodput req/s"
    dev_src = (f"{f}: ceil({prices.target_rps:g} req/s / ({per}"
               f" x {prices.utilisation:g}))" + ("" if basis == "capacity" else f" {NO_CAPACITY}"))
    correct = [correctness(r) for r in arm.runs]
    answered = [c for c in correct if c]
    acc = (sum(sum(c.values()) for c in answered) / sum(len(c) for c in answered)) if answered else None
    delta, both = _quality_vs_reference(arm, ref) if arm is not ref else (0.0 if acc is not None else None, 0)
    fid = [fidelity_counts(r) for r in arm.runs]
    have = [x for x in fid if x]
    compared = sum(x[1] for x in have)
    lost = stats.estimate([x[2] for x in have])
    gained = stats.estimate([x[3] for x in have])
    peaks = [(r.summary.get("memory") or {}).get("peak_device_bytes") for r in arm.runs]
    peaks = [p for p in peaks if p is not None]
    quality = first.run.get("quality") or {}
    return {
        "run": Value(None, f, arm.label),
        "engine": Value(None, f"{f}: engine.name", arm.engine),
        "role": Value(None, f"{f}: config.role", (arm.runs[0].run.get("config") or {}).get("role") or "baseline"),
        "runs": Value(len(arm.runs), f"{f}: runs of one configuration ({describe_config(first.run)})", f),
        "served": Value(n_served / n_sent if n_sent else None,
                        f"{f}: summary.completed / summary.requests, summed over runs (capacity, not quality)",
                        f"{n_served}/{n_sent}"),
        "capacity_rps": (capacity_value(arm, "capacity.requests_per_s (highest offered rate meeting the SLO "
                                             "criterion)")
                         if basis == "capacity" else Value(None, f"{f}: no capacity search in run.json")),
        "output_tokens_per_s": _repeated(arm, [r.summary.get("output_tokens_per_s") for r in arm.runs],
                                         "summary.output_tokens_per_s"),
        "goodput_tokens_per_s": _repeated(arm, [goodput_tokens_per_s(r) for r in arm.runs],
                                          "requests.parquet, output tokens of requests meeting summary.slo / "
                                          "summary.duration_s"),
        "goodput_rps": _repeated(arm, [r.summary.get("goodput_requests_per_s") for r in arm.runs],
                                 "summary.goodput_requests_per_s"),
        "per_device_rps": Value(per_device.value, per_device.source, basis, per_device.samples, per_device.low,
                                per_device.high),
        "cost_per_1m": cost_v,
        "devices": Value(devices(est.median), dev_src, "", (),
                         devices(est.high) if est.has_interval else None,
                         devices(est.low) if est.has_interval else None),
        "kv_capacity_tokens": kv_capacity(first, m, first.folder.name),
        "peak_concurrency": _repeated(arm, [r.summary.get("peak_concurrency") for r in arm.runs],
                                      "summary.peak_concurrency"),
        "accuracy": Value(acc, f"{f}: correct / served requests with a task (requests.parquet correct, else the "
                               "task's exact match on output_text), pooled over runs; unserved requests are "
                               "capacity, not counted"),
        "accuracy_delta_points": Value(delta, f"{f} vs {ref.label if ref else '-'}: accuracy points on the "
                                             f"{both} task requests both served" if arm is not ref
                                       else f"{f}: the full-precision arm itself"),
        "fidelity": Value(sum(x[0] for x in have) / compared if compared else None,
                          f"{f}: share of served requests whose output equals the full-precision reference's "
                          "(requests.parquet ref_identical, else summary.fidelity), pooled over runs"),
        "flips_lost": Value(lost.median, f"{f}: answers right in the reference and wrong here (requests.parquet "
                                         "flip, else summary.fidelity.flips_lost), median per run",
                            "" if lost.median is None else f"{lost.median:g} lost / {gained.median:g} gained"),
        "top1_agreement": Value(quality.get("top1_agreement"),
                                f"{first.folder.name}: quality.top1_agreement (teacher-forced, vs the float32 "
                                "reference)"),
        "peak_device_bytes": Value(max(peaks) if peaks else None,
                                   f"{f}: summary.memory.peak_device_bytes, the highest of the runs"),
        "budget_bytes": Value(m.get("budget_bytes"), f"{first.folder.name}: summary.memory.budget_bytes"),
        "stability_flips": _repeated(arm, [stability_flips(r) for r in arm.runs],
                                     "stability.loads[].flips, summed over the loads (answers flipped against the "
                                     "reference while probed at idle, near and above capacity)"),
        "h2d_bytes_per_token": _repeated(arm, [(r.summary.get("engine") or {}).get("h2d_bytes_per_output_token")
                                               for r in arm.runs], "summary.engine.h2d_bytes_per_output_token"),
    }


def executive(runs: list[Run], prices: Prices, excluded: set[str] = frozenset()) -> list[dict[str, Value]]:
    """One dict per arm (reports.runs.arms order): the executive table's values with sources."""
    all_arms = arms(runs)
    ref = reference_arm(all_arms, excluded)
    return [arm_row(a, prices, ref) for a in all_arms]


def _number(x: float) -> str:
    return f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"


def fmt(key: str, v: Value) -> str:
    x = v.value
    if key in ("run", "engine", "served", "flips_lost"):
        return v.text or ("-" if x is None else str(x))
    if x is None:
        return v.text if key in ("capacity_rps", "per_device_rps") and v.text else "-"
    if key == "kv_capacity_tokens" and v.text:
        return v.text
    if key in ("accuracy", "top1_agreement", "fidelity"):
        return f"{x * 100:.1f}%"
    if key == "accuracy_delta_points":
        return f"{x:+.1f} pt"
    if key in ("peak_device_bytes", "budget_bytes"):
        return f"{x / 2**20:.2f} MiB"
    if key == "cost_per_1m":
        text = f"${x:,.2f}"
        return text + (f" [{v.low:,.2f}-{v.high:,.2f}]" if v.low is not None and v.high is not None else "")
    if key == "devices":
        return f"{x}" + (f" [{v.low}-{v.high}]" if v.low is not None and v.low != v.high else "")
    if isinstance(x, int) or (v.samples and all(float(s).is_integer() for s in v.samples) and float(x).is_integer()):
        text = f"{int(x):,}"
    else:
        text = _number(x)
    if v.low is not None and v.high is not None and v.low != v.high:
        text += f" [{_number(v.low)}-{_number(v.high)}]"
    return (">= " + text) if v.text == "lower bound" else text


COLUMNS = {
    "run": "run", "engine": "engine", "runs": "runs", "served": "served", "capacity_rps": "capacity req/s",
    "goodput_tokens_per_s": "goodput tok/s", "output_tokens_per_s": "out tok/s", "goodput_rps": "goodput req/s",
    "cost_per_1m": "$ / 1M tok", "devices": "devices", "kv_capacity_tokens": "KV tokens",
    "peak_concurrency": "peak users", "accuracy": "accuracy among served",
    "accuracy_delta_points": "vs full (both served)", "fidelity": "identical to full", "flips_lost": "flips",
    "top1_agreement": "top-1 vs fp32", "peak_device_bytes": "peak mem", "budget_bytes": "budget",
    "h2d_bytes_per_token": "h2d B/tok",
}


# The HTML page's table: the engine name and the budget are said once above it.
PAGE = {k: v for k, v in COLUMNS.items() if k not in ("engine", "budget_bytes")}
# The terminal's shorter table (the suite's summary, `pwbench compare`).
COMPACT = {k: COLUMNS[k] for k in ("run", "runs", "served", "capacity_rps", "goodput_rps", "cost_per_1m", "devices",
                                   "accuracy", "fidelity", "flips_lost", "peak_device_bytes", "h2d_bytes_per_token")}


def table(rows: list[dict[str, Value]], columns: dict[str, str] | None = None) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells (for the terminal, Markdown and HTML); a 95% interval, where
    an arm has repeats, follows its median in brackets."""
    columns = columns or COLUMNS
    return list(columns.values()), [[fmt(k, row[k]) for k in columns] for row in rows]


def as_dict(rows: list[dict[str, Value]]) -> list[dict[str, Any]]:
    return [{k: (v.text if k in ("run", "engine", "role") else v.value) for k, v in row.items()} for row in rows]

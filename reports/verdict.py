"""The verdict: which arm to recommend, by a stated rule, and one sentence per technique arm
against the strongest baseline. A winner is named only when it beats every other qualifying
arm beyond noise (the 95% interval of the capacity ratio above 1x, reports.stats); otherwise
the tied arms are named with what separates them; two runs of one configuration are the
environment's difference, never a winner; a comparison without repeats says it has no
interval. Pure functions of reports.roi's executive rows."""

from __future__ import annotations

import math

from reports import stats
from reports.roi import (
    ACCURACY_TOLERANCE_POINTS,
    HOURS_PER_MONTH,
    REFERENCE_ENGINE,
    Prices,
    Value,
    is_excluded,
)

RULE = ("Rule: an arm (the repeats of one configuration) qualifies when its peak device memory fits the budget in "
        f"every run and its quality is within tolerance of full precision ({REFERENCE_ENGINE}): accuracy within "
        f"{ACCURACY_TOLERANCE_POINTS:g} point on the task requests both served, and no more lost answer flips per run "
        "than full precision's own. Among those, the winner is the arm whose capacity at the SLO (else goodput req/s "
        "at the offered rate) beats every other qualifying arm's beyond noise: the 95% interval of the ratio (Welch t "
        "on log values) lies above 1x. Otherwise the arms not beaten beyond noise are a tie, and what separates them "
        "is stated. Savings: devices saved at the target load against full precision x $/h x "
        f"{HOURS_PER_MONTH} h/month.")


def _metric_words(basis: str) -> tuple[str, str]:
    if basis == "capacity":
        return "the requests per device at the SLO", "req/s at the SLO"
    return "the goodput (req/s meeting the SLO at the offered rate; no capacity search)", "goodput req/s"


def _ci(c: stats.Comparison) -> str:
    return f"95% CI {c.low:.2f}-{c.high:.2f}x"


def _range(values: list[float | None], show) -> str | None:
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    lo, hi = min(xs), max(xs)
    return show(lo) if show(lo) == show(hi) else f"{show(lo)}-{show(hi)}"


def _kilo(x: float) -> str:
    return f"{x / 1000:.0f}k" if x >= 10_000 else f"{x:,.0f}"


def separates(rows: list[dict[str, Value]]) -> str:
    """What differs between tied arms: memory, bytes moved, served, quality (ranges of medians;
    a quantity equal across them is left out)."""
    parts = []
    for label, key, show in (("peak memory", "peak_device_bytes", lambda x: f"{x / 2**20:.2f} MiB"),
                             ("h2d bytes/token", "h2d_bytes_per_token", _kilo),
                             ("served", "served", lambda x: f"{x * 100:.0f}%"),
                             ("fidelity", "fidelity", lambda x: f"{x * 100:.0f}%"),
                             ("accuracy among served", "accuracy", lambda x: f"{x * 100:.0f}%")):
        xs = [row[key].value for row in rows if row[key].value is not None]
        if len(xs) > 1 and show(min(xs)) != show(max(xs)):
            parts.append(f"{label} {show(min(xs))}-{show(max(xs))}")
    return ", ".join(parts) or "nothing measured (memory, bytes moved, served, quality are the same)"


def _names(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + f" and {labels[-1]}"


def same_configuration(row: dict[str, Value]) -> str:
    """One arm given several times: its spread is the environment's, never a recommendation."""
    folders = row["runs"].text.split(", ")
    desc = row["runs"].source.split("(", 1)[-1].rstrip(")")
    metric = row["per_device_rps"]
    sp = stats.spread(list(metric.samples))
    diff = "-" if sp is None else ("one served none at the SLO" if math.isinf(sp) else f"{sp:.2f}x")
    return (f"{_names(folders)} are the same configuration ({desc}); their difference ({diff} in "
            f"{_metric_words(metric.text)[1]}) is the environment's (e.g. a busy machine), not the engine's: "
            "no recommendation between them.")


def _qualifies(row: dict[str, Value], ref: dict[str, Value] | None) -> bool:
    peak, budget = row["peak_device_bytes"].value, row["budget_bytes"].value
    if budget and peak is not None and peak > budget:
        return False
    if ref is not None and row is not ref:
        delta = row["accuracy_delta_points"].value
        if delta is not None and delta < -ACCURACY_TOLERANCE_POINTS:
            return False
        lost, ref_lost = row["flips_lost"].value, ref["flips_lost"].value
        if lost is not None and lost > (ref_lost or 0):
            return False
    return bool(row["per_device_rps"].value)


def recommend(rows: list[dict[str, Value]], prices: Prices, excluded: set[str] = frozenset()) -> tuple[str | None, str]:
    """(arm label recommended or None, one plain-language sentence), by RULE. `excluded`:
    arm labels (reports.runs.left_out: unfinished or not comparable) or run folder names left out."""
    def label(row):
        return row["run"].text

    kept = [row for row in rows if not is_excluded(label(row), row["runs"].text.split(", "), excluded)]
    if len(kept) == 1 and (kept[0]["runs"].value or 0) > 1:
        return None, same_configuration(kept[0])
    ref = next((row for row in kept if row["engine"].text == REFERENCE_ENGINE), None)
    qualifying = [row for row in kept if _qualifies(row, ref)]
    if not qualifying:
        return None, "No arm meets the SLO within the quality tolerance and the budget: keep the current setup."
    basis = "capacity" if all(row["per_device_rps"].text == "capacity" for row in qualifying) else "goodput"
    if basis == "goodput":
        qualifying = [row for row in qualifying if row["goodput_rps"].value]
    metric = "per_device_rps" if basis == "capacity" else "goodput_rps"
    words, unit = _metric_words(basis)
    if len(qualifying) == 1:
        only = qualifying[0]
        if only is ref:
            return label(only), (f"Stay with full precision ({label(only)}): no other arm fits the budget within "
                                 "the quality tolerance.")
        return label(only), (f"{label(only)} is the only arm that fits the budget within the quality tolerance "
                             f"({only[metric].value:.2f} {unit}).")

    def versus(a, b) -> stats.Comparison:
        return stats.ratio(list(a[metric].samples), list(b[metric].samples))

    single = [label(row) for row in qualifying if len(row[metric].samples) < 2]
    if single:
        top = max(qualifying, key=lambda row: row[metric].value)
        second = max((row for row in qualifying if row is not top), key=lambda row: row[metric].value)
        c = versus(top, second)
        why = stats.NO_INTERVAL if len(single) == len(qualifying) else \
            f"{_names(single)} ran once: no interval; use --repeat 3"
        point = f"{c.point:.2f}x" if c.point else "-"
        return None, (f"{label(top)} has the highest {unit} ({top[metric].value:.2f}, {point} {label(second)}), but "
                      f"the comparison has no interval ({why}), so it cannot be told from noise: no recommendation.")
    beaten = {label(b) for a in qualifying for b in qualifying if a is not b and versus(a, b).beyond_noise}
    standing = [row for row in qualifying if label(row) not in beaten]
    if len(standing) == 1 and all(versus(standing[0], b).beyond_noise for b in qualifying if b is not standing[0]):
        return label(standing[0]), _winner(standing[0], qualifying, ref, versus, prices, words)
    if len(standing) == 1:
        top = standing[0]
        standing = [top] + [b for b in qualifying if b is not top and not versus(top, b).beyond_noise]
        standing = [row for row in qualifying if row in standing]
    noise = [stats.estimate(list(row[metric].samples)).relative_half_width() for row in standing]
    noise = [x for x in noise if x is not None]
    spread = _range([row[metric].value for row in standing], lambda x: f"{x:.2f}")
    text = (f"{_names([label(row) for row in standing])} are within noise of each other: {spread} {unit}"
            + (f" (+-{max(noise) * 100:.0f}%)" if noise else ""))
    if what := separates(standing):
        text += f"; what separates them: {what}"
    return None, text + "."


def _winner(best, qualifying, ref, versus, prices: Prices, words: str) -> str:
    name = best["run"].text
    others = [row for row in qualifying if row is not best]
    closest = min(others, key=lambda row: versus(best, row).point or math.inf)
    c = versus(best, closest)
    least = "at least " if best["capacity_rps"].text == "lower bound" else ""
    text = (f"{name} serves {least}{c.point:.2f}x {words} ({_ci(c)}) vs {closest['run'].text}, the closest "
            "qualifying arm")
    if best["fidelity"].value is not None:
        text += f", with {best['fidelity'].value * 100:.1f}% of answers identical to full precision"
    delta = best["accuracy_delta_points"].value
    if delta is not None and best is not ref:
        text += f", {delta:+.1f} accuracy points on the requests both served"
    base = ref if ref is not None and ref is not best else None
    d_best, d_base = best["devices"].value, base["devices"].value if base else None
    if base is not None and d_best is not None and d_base is not None and d_base != d_best:
        saved = d_base - d_best
        text += (f": at {prices.target_rps:g} req/s, {abs(saved)} {'fewer' if saved > 0 else 'more'} devices than full "
                 f"precision ({d_best} vs {d_base}), about ${abs(saved) * prices.gpu_hour_usd * HOURS_PER_MONTH:,.0f} "
                 f"per month {'saved' if saved > 0 else 'more'}")
    return text + "."


def technique_sentences(rows: list[dict[str, Value]], prices: Prices, excluded: set[str] = frozenset()) -> list[str]:
    """One sentence per technique arm (run.json config.role) against the strongest baseline arm by median
    per-device req/s; clauses whose data is absent are left out."""
    kept = [row for row in rows if not is_excluded(row["run"].text, row["runs"].text.split(", "), excluded)]
    basis = "capacity" if all(row["per_device_rps"].text == "capacity" for row in kept) else "goodput"
    metric = "per_device_rps" if basis == "capacity" else "goodput_rps"
    words = _metric_words(basis)[0]
    baselines = [row for row in kept if row["role"].text != "technique" and row[metric].value is not None]
    base = max(baselines, key=lambda row: row[metric].value) if baselines else None
    out = []
    for row in kept:
        if row["role"].text != "technique":
            continue
        name = row["run"].text
        text = f"{name}: "
        c = None
        if base is not None and row[metric].value is not None:
            c = stats.ratio(list(row[metric].samples), list(base[metric].samples))
            point = f"{c.point:.2f}x" if c.point else "-"
            if row["capacity_rps"].text == "lower bound":
                point = f"at least {point}"
            if c.tie:
                text += f"within noise of {base['run'].text} on {words} ({point}, {_ci(c)})"
            elif c.has_interval:
                text += f"{point} {words} ({_ci(c)}) vs {base['run'].text}"
            else:
                text += f"{point} {words} vs {base['run'].text} ({c.why_no_interval()})"
        else:
            text += f"{row[metric].value or 0:.2f} {_metric_words(basis)[1]}"
        clauses = []
        if row["fidelity"].value is not None:
            clause = f"{row['fidelity'].value * 100:.1f}% of answers identical to full precision"
            if base is not None and base["fidelity"].value is not None:
                clause += f" ({base['run'].text}: {base['fidelity'].value * 100:.1f}%)"
            clauses.append(clause)
        if (flips := row["stability_flips"].value) is not None:
            clauses.append(f"{flips:g} flip{'' if flips == 1 else 's'} under load")
        if clauses:
            text += ", with " + ", ".join(clauses)
        d, db = row["devices"].value, base["devices"].value if base else None
        if d is not None and db is not None:
            n = db - d
            if c is not None and c.tie and n:  # the devices follow the rate: a tie on one is on both
                text += f"; {d} vs {db} devices at {prices.target_rps:g} req/s, within noise"
            elif c is not None and not c.has_interval and n:
                text += f"; {d} vs {db} devices at {prices.target_rps:g} req/s (no interval)"
            elif n:
                text += (f"; {abs(n)} {'fewer' if n > 0 else 'more'} device{'s' * (abs(n) != 1)} at "
                         f"{prices.target_rps:g} req/s")
            else:
                text += f"; the same devices at {prices.target_rps:g} req/s ({d})"
        out.append(text + ".")
    return out

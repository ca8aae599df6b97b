"""`pwbench report`: one self-contained HTML file from result folders.

The first screen is the verdict (reports.roi and reports.verdict, per arm = the repeats of one configuration):
one sentence per technique against the strongest baseline, the recommendation (a winner only
beyond noise, else the tie), then the executive table. Below it the engineering pages: latency
CDFs, bar charts (median per arm, whiskers = 95% interval where an arm has repeats) of
capacity, throughput, bytes moved per token against the link peak, memory against the budget;
fidelity, capacity and accuracy against peak memory (Pareto), output stability under load,
precision (ITL inside vs outside transition windows, fidelity against mean bits), throughput
against request rate (sweeps), telemetry timelines, expert bits and selection heatmaps, and
every run's configuration and environment.
plotly.js is embedded once in <head>, so the page opens offline. Every string taken from a
run (names, configs, notes) goes through html.escape; figure JSON is made script-safe.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any

from harness.metrics import request_times
from reports import roi, stats, verdict
from reports.runs import Arm, Run, arms, left_out, simulated_on

E = html.escape
CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:1400px}
h1{margin:.2em 0}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:3px 6px;font-size:.95em;
text-align:right;white-space:nowrap}td:first-child,th:first-child,td:nth-child(2),th:nth-child(2){text-align:left}th{white-space:normal}th{background:#f0f0f0}
.rec{font-size:1.15em;background:#eef7ee;border-left:5px solid #3a3;padding:.6em 1em;margin:.8em 0}
.warn{background:#fff4e0;border-left:5px solid #e90;padding:.5em 1em}.small{font-size:.85em;color:#555}
.tag{font-size:.8em;background:#ddd;padding:1px 5px;border-radius:3px}pre{background:#f7f7f7;padding:.5em;
overflow:auto;font-size:.8em}.chart{min-height:360px}"""


def _figure_div(fig_id: str, data: list[dict], layout: dict[str, Any]) -> str:
    # "</" inside the JSON would end the <script> element: escape it.
    spec = json.dumps({"data": data, "layout": {"height": 380, "margin": {"t": 40}, **layout}}, default=str)
    spec = spec.replace("</", "<\\/").replace("<!--", "<\\!--")
    return (f'<div id="{fig_id}" class="chart plotly-chart"></div>\n<script>(function(){{var f={spec};'
            f'Plotly.newPlot("{fig_id}",f.data,f.layout,{{responsive:true,displaylogo:false}});}})();</script>')


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def _latency_charts(groups: list[Arm]) -> list[str]:
    out = []
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "end-to-end")):
        data = []
        for arm in groups:
            values = []
            for row in (row for r in arm.runs for row in r.rows("requests")):
                if row.get("warmup") or row.get("error"):
                    continue
                t = request_times(row)
                if key == "itl":
                    values.extend(x * 1e3 for x in t.itl_s)
                elif (v := getattr(t, f"{key}_s")) is not None:
                    values.append(v * 1e3)
            if values:
                xs, ys = _cdf(values)
                data.append({"type": "scatter", "mode": "lines", "name": E(arm.label), "x": xs, "y": ys})
        slo = (groups[0].runs[0].summary.get("slo") or {}).get(f"{key}_ms") if groups else None
        shapes = [{"type": "line", "x0": slo, "x1": slo, "y0": 0, "y1": 1,
                   "line": {"dash": "dot", "color": "red"}}] if slo else []
        out.append(_figure_div(f"cdf-{key}", data,
                               {"title": {"text": f"{label} CDF (ms), requests of all repeats"
                                                  f"{' - dotted: SLO' if slo else ''}"},
                                "xaxis": {"title": {"text": "ms"}, "type": "log"},
                                "yaxis": {"title": {"text": "share of requests"}}, "shapes": shapes}))
    return out


def _bar(fig_id: str, title: str, groups: list[Arm], samples: list[list[float | None]], unit: str,
         line: float | None = None, line_label: str = "") -> str:
    """One bar per arm at the median of its repeats; error bars (asymmetric) from the 95%
    interval where an arm has repeats."""
    ests = [stats.estimate(xs) for xs in samples]
    layout: dict[str, Any] = {"title": {"text": title}, "yaxis": {"title": {"text": unit}}}
    if line:
        layout["shapes"] = [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": line, "y1": line,
                             "line": {"dash": "dot", "color": "red"}}]
        layout["title"]["text"] += f" - dotted: {line_label}"
    trace: dict[str, Any] = {"type": "bar", "x": [E(a.label) for a in groups], "y": [e.median or 0 for e in ests]}
    if any(e.has_interval for e in ests):
        trace["error_y"] = {"type": "data", "symmetric": False, "visible": True,
                            "array": [max(e.high - e.median, 0) if e.has_interval else 0 for e in ests],
                            "arrayminus": [max(e.median - e.low, 0) if e.has_interval else 0 for e in ests]}
        layout["title"]["text"] += " - bars: median of repeats, whiskers: 95% CI"
    return _figure_div(fig_id, [trace], layout)


def _scatter(fig_id: str, title: str, points: list[tuple[float, float, str]], xtitle: str, ytitle: str) -> str:
    return _figure_div(fig_id, [{"type": "scatter", "mode": "markers+text", "x": [p[0] for p in points],
                                 "y": [p[1] for p in points], "text": [E(p[2]) for p in points],
                                 "textposition": "top center"}],
                       {"title": {"text": title}, "xaxis": {"title": {"text": xtitle}},
                        "yaxis": {"title": {"text": ytitle}}})


def _memory(run: Run, key: str) -> Any:
    return (run.summary.get("memory") or {}).get(key)


def _per_run(arm: Arm, get) -> list[float | None]:
    return [get(r) for r in arm.runs]


def _stability(groups: list[Arm]) -> list[str]:
    """run.json stability: the probe set answered at three loads, per run."""
    header = ["run", "load", "rate req/s", "unique completions / probe", "probes varying", "flips",
              "first divergence (token)"]
    cells, findings = [], []
    for arm in groups:
        for r in arm.runs:
            st = r.run.get("stability")
            if not st:
                continue
            for load in st.get("loads") or []:
                cells.append([r.folder.name, str(load.get("name")), _num(load.get("rate")),
                              _num(load.get("unique_completions_mean")), _num(load.get("probes_varying")),
                              _num(load.get("flips")), _num(load.get("first_divergence_min"))])
            if st.get("finding"):
                findings.append(f"<li><b>{E(r.folder.name)}</b>: {E(str(st['finding']))}</li>")
    if not cells:
        return []
    return ["<h2 id='stability'>Output stability under load (measured)</h2>",
            "<p class='small'>A fixed probe set, greedy, answered several times at each background load; unique "
            "completions per probe (1 = always the same answer), probes with more than one completion, answers "
            "flipped against the full-precision reference, and the first token where a completion diverged.</p>",
            _html_table(header, cells), f"<ul class='small'>{''.join(findings)}</ul>"]


def _precision(groups: list[Arm]) -> list[str]:
    """summary.transitions (ITL inside vs outside bit-width transition windows) and fidelity
    against each request's mean expert bits (requests.parquet bits_mean, ref_identical)."""
    header = ["run", "transition windows", "per minute", "bytes moved", "ITL p50 inside / outside ms",
              "ITL p99 inside / outside ms"]
    cells = []
    for arm in groups:
        for r in arm.runs:
            tr = r.summary.get("transitions")
            if not tr:
                continue
            inside, outside = tr.get("itl_ms_inside") or {}, tr.get("itl_ms_outside") or {}
            label = arm.label if len(arm.runs) == 1 else f"{arm.label} ({r.folder.name})"
            cells.append([label, _num(tr.get("windows")), _num(tr.get("per_minute")),
                          _num(tr.get("move_bytes")),
                          f"{_num(inside.get('p50'))} / {_num(outside.get('p50'))}",
                          f"{_num(inside.get('p99'))} / {_num(outside.get('p99'))}"])
    data = []
    for arm in groups:
        bins: dict[float, list[bool]] = {}
        for row in (row for r in arm.runs for row in roi.served_rows(r)):
            if row.get("bits_mean") is not None and row.get("ref_identical") is not None:
                bins.setdefault(round(float(row["bits_mean"]) * 2) / 2, []).append(bool(row["ref_identical"]))
        if bins:
            xs = sorted(bins)
            data.append({"type": "scatter", "mode": "markers", "name": E(arm.label), "x": xs,
                         "y": [sum(bins[x]) / len(bins[x]) * 100 for x in xs],
                         "text": [f"{len(bins[x])} requests" for x in xs],
                         "marker": {"size": [6 + 2 * min(len(bins[x]), 10) for x in xs]}})
    if not cells and not data:
        return []
    out = ["<h2 id='precision'>Precision and transitions (measured)</h2>"]
    if cells:
        out += ["<p class='small'>Inter-token latency of steps inside a bit-width transition window against steady "
                "state (summary.transitions).</p>", _html_table(header, cells)]
    if data:
        out.append(_figure_div("fidelity-bits", data, {
            "title": {"text": "fidelity vs mean expert bits per request (requests binned by 0.5 bit; size: count)"},
            "xaxis": {"title": {"text": "mean bits of the experts that computed the request"}},
            "yaxis": {"title": {"text": "% identical to full precision"}}}))
    return out


def _num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"


def _engineering(runs: list[Run], groups: list[Arm], rows: list[dict[str, roi.Value]]) -> list[str]:
    parts = ["<h2>Latency</h2>", *_latency_charts(groups)]
    parts.append("<h2>Capacity and throughput</h2>")
    basis = rows[0]["per_device_rps"].text if rows else "goodput"
    parts.append(_bar("per-device", "capacity at the SLO, req/s per device (measured by the capacity search)"
                      if all(row["per_device_rps"].text == "capacity" for row in rows)
                      else f"goodput req/s at the offered rate ({basis} where searched)", groups,
                      [list(row["per_device_rps"].samples) for row in rows], "req/s"))
    parts.append(_bar("out-tokens", "output tokens/s (measured)", groups,
                      [list(row["output_tokens_per_s"].samples) for row in rows], "tokens/s"))
    parts.append("<h2>Bytes moved and memory</h2>")
    link_peak = max(((r.summary.get("memory") or {}).get("link_peak_bytes_per_s") or 0 for r in runs), default=0)
    parts.append(_bar("h2d-per-token", "host->device bytes per output token (measured)", groups,
                      [list(row["h2d_bytes_per_token"].samples) for row in rows], "bytes / token"))
    parts.append(_bar("link-rate", "host<->device link bytes/s achieved (measured)", groups,
                      [_per_run(a, lambda r: _memory(r, "link_bytes_per_s")) for a in groups],
                      "bytes/s", line=link_peak or None, line_label="link peak"))
    budgets = [row["budget_bytes"].value for row in rows if row["budget_bytes"].value]
    parts.append(_bar("peak-memory", "peak device memory (measured)", groups,
                      [_per_run(a, lambda r: ((r.summary.get("memory") or {}).get("peak_device_bytes") or 0) / 2**20)
                       for a in groups], "MiB",
                      line=(min(budgets) / 2**20) if budgets else None, line_label="device budget"))
    parts.append(_bar("kv-capacity", "KV cache capacity under the budget", groups,
                      [_per_run(a, lambda r: _memory(r, "kv_capacity_tokens")) for a in groups],
                      "tokens"))
    parts.append(_bar("prefix-cache", "prefix-cache hit rate (share of prompt tokens from cache)", groups,
                      [_per_run(a, lambda r: ((r.summary.get("engine") or {}).get("prefix_cache_hit_rate") or 0) * 100)
                       for a in groups], "%"))
    parts.append("<h2>Quality, capacity and memory (Pareto: up and left is better)</h2>")
    mem = [(row["peak_device_bytes"].value or 0) / 2**20 for row in rows]
    fid = [(m, row["fidelity"].value * 100, a.label) for m, row, a in zip(mem, rows, groups)
           if row["fidelity"].value is not None and row["peak_device_bytes"].value]
    parts.append(_scatter("pareto-fidelity", "fidelity (answers identical to full precision) vs peak device memory",
                          fid, "peak device MiB", "% identical to full precision"))
    cap = [(m, row["per_device_rps"].value, a.label) for m, row, a in zip(mem, rows, groups)
           if row["per_device_rps"].value is not None and row["peak_device_bytes"].value]
    parts.append(_scatter("pareto-capacity", "per-device req/s at the SLO (median) vs peak device memory", cap,
                          "peak device MiB", "req/s"))
    acc = [(m, row["accuracy"].value * 100, a.label) for m, row, a in zip(mem, rows, groups)
           if row["accuracy"].value is not None and row["peak_device_bytes"].value]
    parts.append(_scatter("pareto", "accuracy among served requests vs peak device memory", acc, "peak device MiB",
                          "accuracy %"))
    parts.extend(_stability(groups))
    parts.extend(_precision(groups))
    rates = [(r.run.get("config") or {}).get("workload", {}).get("rate") for r in runs]
    if len({x for x in rates if x is not None}) > 1:
        by_engine: dict[str, list[tuple[float, float, float]]] = {}
        for r, rate in zip(runs, rates):
            if rate is not None:
                by_engine.setdefault(r.engine, []).append((rate, r.summary["output_tokens_per_s"],
                                                           r.summary["goodput_requests_per_s"]))
        data = []
        for name, p in by_engine.items():
            p.sort()
            data.append({"type": "scatter", "mode": "lines+markers", "name": E(name) + " goodput req/s",
                         "x": [x[0] for x in p], "y": [x[2] for x in p]})
        parts.append(_figure_div("rate-sweep", data, {"title": {"text": "goodput vs request rate (sweep)"},
                                                       "xaxis": {"title": {"text": "offered req/s"}}}))
    parts.append("<h2 id='timeline'>Timeline</h2><p class='small'>The first run of each arm, on its own clock "
                 "(seconds since its measured run started); CPU is the process's share of all cores.</p>")
    for arm, r in ((a, a.runs[0]) for a in groups):
        steps = r.rows("steps")
        tel = r.rows("telemetry")
        data = []
        if tel:
            for col in ("process_cpu_percent", "gpu_util_percent", "gpu_power_w"):
                if col in tel[0]:
                    data.append({"type": "scatter", "mode": "lines", "name": col, "x": [t["t_s"] for t in tel],
                                 "y": [t[col] for t in tel]})
        if steps:
            xs = [s["t_s"] for s in steps]
            data.append({"type": "scatter", "mode": "lines", "name": "requests running", "x": xs,
                         "y": [s["running"] for s in steps], "yaxis": "y2"})
            data.append({"type": "scatter", "mode": "lines", "name": "device KV MiB", "yaxis": "y2", "x": xs,
                         "y": [(s.get("device_kv_bytes") or 0) / 2**20 for s in steps]})
            data.append({"type": "scatter", "mode": "lines", "name": "h2d KiB per step", "yaxis": "y2", "x": xs,
                         "y": [(s.get("h2d_bytes") or 0) / 2**10 for s in steps]})
        parts.append(_figure_div(f"timeline-{len(parts)}", data, {
            "title": {"text": f"{E(_first(arm))}: utilisation, memory, link traffic and requests in flight"},
            "xaxis": {"title": {"text": "s since the run's start"}},
            "yaxis": {"title": {"text": "% (CPU: of all cores)"}, "range": [0, 100]},
            "yaxis2": {"overlaying": "y", "side": "right", "title": {"text": "requests / MiB / KiB"}}}))
    parts.extend(_expert_heatmaps([(_first(a), a.runs[0]) for a in groups]))
    return parts


def _first(arm: Arm) -> str:
    """The arm's label, with its first run's folder when it has repeats (the charts draw that run)."""
    return arm.label if len(arm.runs) == 1 else f"{arm.label} ({arm.runs[0].folder.name})"


def _expert_heatmaps(runs: list[tuple[str, Run]]) -> list[str]:
    out = []
    for i, (label, r) in enumerate(runs):
        bits = r.rows("expert_bits")
        if bits:
            keys = sorted({(b["layer"], b["expert"]) for b in bits})
            steps = sorted({b["engine_step"] for b in bits})
            grid = {(b["engine_step"], b["layer"], b["expert"]): b["bits"] for b in bits}
            z = [[grid.get((s, layer, e)) for s in steps] for layer, e in keys]
            out.append(_figure_div(f"bits-{i}",
                                   [{"type": "heatmap", "z": z, "x": steps, "y": [f"L{a} E{b}" for a, b in keys],
                                                  "colorscale": "Viridis", "colorbar": {"title": {"text": "bits"}}}],
                                   {"title": {"text": f"{E(label)}: bits per expert over engine steps"},
                                    "height": 500}))
        usage = r.rows("expert_usage")
        if usage:
            layers = sorted({u["layer"] for u in usage})
            experts = sorted({u["expert"] for u in usage})
            grid = {(u["layer"], u["expert"]): u["tokens"] for u in usage}
            z = [[grid.get((layer, e), 0) for e in experts] for layer in layers]
            out.append(_figure_div(f"usage-{i}",
                                   [{"type": "heatmap", "z": z, "x": experts, "y": layers, "colorscale": "Blues"}],
                                   {"title": {"text": f"{E(label)}: expert selection (tokens routed)"},
                                    "xaxis": {"title": {"text": "expert"}}, "yaxis": {"title": {"text": "layer"}}}))
    if out:
        out.insert(0, "<h2>Experts</h2>")
    return out


def _html_table(header: list[str], cells: list[list[str]], titles: list[list[str]] | None = None) -> str:
    head = "".join(f"<th>{E(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(cells):
        tds = "".join(f'<td title="{E(titles[i][j])}">{E(c)}</td>' if titles else f"<td>{E(c)}</td>"
                      for j, c in enumerate(row))
        body.append(f"<tr>{tds}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _simulated_banner(runs: list[Run]) -> str:
    """The first screen's statement that its numbers are simulated: on which hardware profile,
    with which cost model and routing, and that quality was not simulated ('' when measured)."""
    sims = [r.run["simulated"] for r in runs if simulated_on(r.run)]
    if not sims:
        return ""
    profiles = ", ".join(sorted({f"{s.get('hardware')} ({s.get('hardware_description', '')})" for s in sims}))
    versions = ", ".join(sorted({str(s.get("cost_model_version")) for s in sims}))
    routing = sorted({", ".join(f"{k}={v}" for k, v in (s.get("routing") or {}).items()
                                if k in ("kind", "skew", "locality", "path", "source")) for s in sims})
    return ('<div class="warn" id="simulated"><b>Simulated, not measured.</b> Every number below comes from '
            f"pwbench's cost model (version {E(versions)}) for the hardware profile {E(profiles)}, with the engines' "
            "real control code (scheduler, KV cache, budgets, expert residency) on a virtual clock. Expert routing: "
            f"{E('; '.join(routing))}. Quality is not simulated: the recommendation assumes every arm answers as "
            "well as full precision; measure quality on the real model before acting on it. Every assumption and "
            "its source: each run.json's <code>simulated</code>.</div>")


def render(runs: list[Run], prices: roi.Prices) -> str:
    import plotly.offline

    groups = arms(runs)
    flagged = left_out(runs)
    rows = roi.executive(runs, prices, set(flagged))
    recommended, sentence = verdict.recommend(rows, prices, set(flagged))
    techniques = verdict.technique_sentences(rows, prices, set(flagged))
    header, cells = roi.table(rows, roi.PAGE)
    keys = list(roi.PAGE)
    titles = [[row[k].source for k in keys] for row in rows]
    for cell_row, a in zip(cells, groups):
        if a.label in flagged:
            cell_row[0] += f" ({flagged[a.label].kind})"
        elif a.label == recommended:
            cell_row[0] += " (recommended)"
    sources = "".join(f"<li><b>{E(h)}</b>: {E(rows[0][k].source.split(': ', 1)[-1])}</li>"
                      for k, h in zip(keys, header)) if rows else ""
    first = runs[0].run if runs else {}
    wl = first.get("workload") or {}
    env = first.get("environment") or {}
    slo = ", ".join(f"{k} <= {v:g}" for k, v in ((first.get("summary") or {}).get("slo") or {}).items())
    budgets = sorted({row["budget_bytes"].value for row in rows if row["budget_bytes"].value})
    budget = ", ".join(f"{b / 2**20:.2f} MiB" for b in budgets) or "none"
    engines = ", ".join(f"{row['run'].text} = {row['engine'].text} x {row['runs'].value}" for row in rows)
    warn = ""
    if flagged:
        warn = ('<div class="warn" id="left-out"><b>Runs left out of the recommendation: unfinished, or not '
                "comparable with the first complete run:</b><ul>"
                + "".join(f"<li>{E(k)} ({E(v.kind)}): {E(v.why)}</li>" for k, v in flagged.items()) + "</ul></div>")
    sentences = ("<ul id='techniques'>" + "".join(f"<li>{E(t)}</li>" for t in techniques) + "</ul>") if techniques \
        else ""
    repeats = max((row["runs"].value or 0 for row in rows), default=0)
    banner, machine = _simulated_banner(runs), str(env.get("gpu") or env.get("cpu_model"))
    if banner:
        machine = ", ".join(sorted({f"simulated {s}" for r in runs if (s := simulated_on(r.run))}))
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>pwbench ROI report</title>",
        f"<style>{CSS}</style><script>{plotly.offline.get_plotlyjs()}</script></head><body>",
        '<section id="executive"><h1>Can these engines serve more on the same devices?</h1>',
        banner, sentences,
        f'<div class="rec" id="recommendation"><b>Recommendation:</b> {E(sentence)}<br>'
        f'<span class="small">{E(verdict.RULE)}</span></div>',
        f'<p class="small">Workload <b>{E(str(wl.get("name")))}</b> ({E(str(wl.get("requests")))} requests, '
        f'{E(str(wl.get("arrival")))} arrivals, seed {E(str(first.get("seed")))}) on '
        f'{E(machine)}; '
        f'SLO {E(slo)}; device budget <b>{E(budget)}</b>; arms (engine x runs) {E(engines)}. '
        f'Inputs: <b>${prices.gpu_hour_usd:g} per device-hour</b>, target load <b>{prices.target_rps:g} req/s</b>, '
        f'utilisation <b>{prices.utilisation:g}</b> (change with --gpu-hour-usd, --target-rps, --utilisation). '
        f'Hover a cell for its run folders and metric.</p>',
        warn, _html_table(header, cells, titles),
        '<p class="small">One row per arm: the runs of one configuration (engine, model, options, workload and seed, '
        'SLO). A number is the median of the arm\'s runs; [low-high] is the 95% interval (Student t; of the '
        'geometric mean when every value is positive)'
        + ("" if repeats > 1 else "; with one run per arm there is no interval (use --repeat 3)")
        + '. served: requests completed of those sent (capacity). accuracy among served: correct answers among the '
        'served requests that carried a task (an unserved request is capacity, not a wrong answer). vs full (both '
        'served): accuracy points against full precision on the task requests both served. identical to full: '
        'share of served requests whose output equals the full-precision reference\'s greedy output. flips: answers '
        'right in the reference and wrong here (lost) or the reverse (gained), median per run. top-1 vs fp32: '
        'teacher-forced agreement with the float32 reference after the run.</p>',
        '<p class="small">Where each column comes from (per arm):</p>'
        f'<ul class="small">{sources}</ul></section>',
        '<section id="engineering"><h1>Engineering detail</h1>',
        *_engineering(runs, groups, rows),
        "<h2>Runs: configuration and environment</h2>",
    ]
    for r in runs:
        detail = {k: r.run.get(k) for k in ("status", "config", "engine", "workload", "environment", "quality",
                                            "capacity", "stability", "engine_notes")}
        parts.append(f"<details><summary>{E(r.label)} <span class='tag'>{E(str(r.folder))}</span></summary>"
                     f"<pre>{E(json.dumps(detail, indent=1, default=str))}</pre></details>")
    parts.append("<p class='small'>Measured: the runs' own numbers (throughput, goodput, capacity found by the search, "
                 "memory, bytes, answers). Derived: medians and intervals across repeats, ratios between arms. "
                 "Projected: cost and devices apply the stated prices and target load to the measured capacity "
                 "(else goodput).</p></section></body></html>")
    return "\n".join(parts)


def write_report(runs: list[Run], prices: roi.Prices, output: Path) -> Path:
    """Write atomically: a half-written report never sits under the final name."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.partial-{os.getpid()}"
    try:
        tmp.write_text(render(runs, prices), encoding="utf-8")
        tmp.replace(output)
    finally:
        tmp.unlink(missing_ok=True)
    return output

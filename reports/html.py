"""`pwbench report`: one self-contained HTML file from result folders.

The first screen is the executive summary (reports.roi); below it the engineering pages:
latency CDFs, bytes moved per token against the link peak, memory against the budget,
accuracy against peak memory, throughput against request rate (sweeps), telemetry timelines,
expert bits and selection heatmaps, and every run's configuration and environment.
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
from reports import roi
from reports.runs import Run, incomparable

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


def _latency_charts(runs: list[Run]) -> list[str]:
    out = []
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "end-to-end")):
        data = []
        for r in runs:
            values = []
            for row in r.rows("requests"):
                if row.get("warmup") or row.get("error"):
                    continue
                t = request_times(row)
                if key == "itl":
                    values.extend(x * 1e3 for x in t.itl_s)
                elif (v := getattr(t, f"{key}_s")) is not None:
                    values.append(v * 1e3)
            if values:
                xs, ys = _cdf(values)
                data.append({"type": "scatter", "mode": "lines", "name": E(r.label), "x": xs, "y": ys})
        slo = (runs[0].summary.get("slo") or {}).get(f"{key}_ms") if runs else None
        shapes = [{"type": "line", "x0": slo, "x1": slo, "y0": 0, "y1": 1,
                   "line": {"dash": "dot", "color": "red"}}] if slo else []
        out.append(_figure_div(f"cdf-{key}", data,
                               {"title": {"text": f"{label} CDF (ms){' - dotted: SLO' if slo else ''}"},
                                                     "xaxis": {"title": {"text": "ms"}, "type": "log"},
                                                     "yaxis": {"title": {"text": "share of requests"}},
                                "shapes": shapes}))
    return out


def _bar(fig_id: str, title: str, runs: list[Run], values: list[float | None], unit: str, line: float | None = None,
         line_label: str = "") -> str:
    labels = [E(r.label) for r in runs]
    layout: dict[str, Any] = {"title": {"text": title}, "yaxis": {"title": {"text": unit}}}
    if line:
        layout["shapes"] = [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": line, "y1": line,
                             "line": {"dash": "dot", "color": "red"}}]
        layout["title"]["text"] += f" - dotted: {line_label}"
    return _figure_div(fig_id, [{"type": "bar", "x": labels, "y": [v or 0 for v in values]}], layout)


def _engineering(runs: list[Run], rows: list[dict[str, roi.Value]]) -> list[str]:
    parts = ["<h2>Latency</h2>", *_latency_charts(runs)]
    parts.append("<h2>Bytes moved and memory</h2>")
    link_peak = max(((r.summary.get("memory") or {}).get("link_peak_bytes_per_s") or 0 for r in runs), default=0)
    parts.append(_bar("h2d-per-token", "host->device bytes per output token (measured)", runs,
                      [row["h2d_bytes_per_token"].value for row in rows], "bytes / token"))
    parts.append(_bar("link-rate", "host<->device link bytes/s achieved (measured)", runs,
                      [(r.summary.get("memory") or {}).get("link_bytes_per_s") for r in runs], "bytes/s",
                      line=link_peak or None, line_label="link peak"))
    budgets = [row["budget_bytes"].value for row in rows if row["budget_bytes"].value]
    parts.append(_bar("peak-memory", "peak device memory (measured)", runs,
                      [(row["peak_device_bytes"].value or 0) / 2**20 for row in rows], "MiB",
                      line=(min(budgets) / 2**20) if budgets else None, line_label="device budget"))
    parts.append(_bar("kv-capacity", "KV cache capacity under the budget", runs,
                      [row["kv_capacity_tokens"].value for row in rows], "tokens"))
    parts.append(_bar("prefix-cache", "prefix-cache hit rate (share of prompt tokens from cache)", runs,
                      [((r.summary.get("engine") or {}).get("prefix_cache_hit_rate") or 0) * 100 for r in runs], "%"))
    parts.append("<h2>Quality, throughput and budget</h2>")
    pts = [(row["peak_device_bytes"].value, row["accuracy"].value, r) for row, r in zip(rows, runs)
           if row["accuracy"].value is not None and row["peak_device_bytes"].value]
    parts.append(_figure_div("pareto", [{"type": "scatter", "mode": "markers+text", "x": [p[0] / 2**20 for p in pts],
                                         "y": [p[1] * 100 for p in pts], "text": [E(p[2].label) for p in pts],
                                         "textposition": "top center"}],
                             {"title": {"text": "accuracy vs peak device memory (Pareto: up and left is better)"},
                              "xaxis": {"title": {"text": "peak device MiB"}},
                              "yaxis": {"title": {"text": "accuracy %"}}}))
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
    parts.append("<h2>Timeline</h2>")
    for r in runs:
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
            "title": {"text": f"{E(r.label)}: utilisation, memory, link traffic and requests in flight"},
            "xaxis": {"title": {"text": "s"}}, "yaxis": {"title": {"text": "%"}},
            "yaxis2": {"overlaying": "y", "side": "right", "title": {"text": "requests / MiB / KiB"}}}))
    parts.extend(_expert_heatmaps(runs))
    return parts


def _expert_heatmaps(runs: list[Run]) -> list[str]:
    out = []
    for i, r in enumerate(runs):
        bits = r.rows("expert_bits")
        if bits:
            keys = sorted({(b["layer"], b["expert"]) for b in bits})
            steps = sorted({b["engine_step"] for b in bits})
            grid = {(b["engine_step"], b["layer"], b["expert"]): b["bits"] for b in bits}
            z = [[grid.get((s, layer, e)) for s in steps] for layer, e in keys]
            out.append(_figure_div(f"bits-{i}",
                                   [{"type": "heatmap", "z": z, "x": steps, "y": [f"L{a} E{b}" for a, b in keys],
                                                  "colorscale": "Viridis", "colorbar": {"title": {"text": "bits"}}}],
                                   {"title": {"text": f"{E(r.label)}: bits per expert over engine steps"},
                                    "height": 500}))
        usage = r.rows("expert_usage")
        if usage:
            layers = sorted({u["layer"] for u in usage})
            experts = sorted({u["expert"] for u in usage})
            grid = {(u["layer"], u["expert"]): u["tokens"] for u in usage}
            z = [[grid.get((layer, e), 0) for e in experts] for layer in layers]
            out.append(_figure_div(f"usage-{i}",
                                   [{"type": "heatmap", "z": z, "x": experts, "y": layers, "colorscale": "Blues"}],
                                   {"title": {"text": f"{E(r.label)}: expert selection (tokens routed)"},
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


def render(runs: list[Run], prices: roi.Prices) -> str:
    import plotly.offline

    rows = roi.executive(runs, prices)
    flagged = incomparable(runs)
    recommended, sentence = roi.recommend(rows, prices, set(flagged))
    header, cells = roi.table(rows, roi.PAGE)
    keys = list(roi.PAGE)
    titles = [[row[k].source for k in keys] for row in rows]
    for cell_row, r in zip(cells, runs):
        if r.label in flagged:
            cell_row[0] += " (not comparable)"
        elif r.label == recommended:
            cell_row[0] += " (recommended)"
    sources = "".join(f"<li><b>{E(h)}</b>: {E(rows[0][k].source.split(': ', 1)[-1])}</li>"
                      for k, h in zip(keys, header)) if rows else ""
    first = runs[0].run if runs else {}
    wl = first.get("workload") or {}
    env = first.get("environment") or {}
    slo = ", ".join(f"{k} <= {v:g}" for k, v in ((first.get("summary") or {}).get("slo") or {}).items())
    budgets = sorted({row["budget_bytes"].value for row in rows if row["budget_bytes"].value})
    budget = ", ".join(f"{b / 2**20:.2f} MiB" for b in budgets) or "none"
    engines = ", ".join(f"{row['run'].text} = {row['engine'].text}" for row in rows)
    warn = ""
    if flagged:
        warn = ('<div class="warn"><b>Runs that cannot be compared with the first run '
                f"({E(runs[0].label)}); left out of the recommendation:</b><ul>"
                + "".join(f"<li>{E(k)}: {E(v)}</li>" for k, v in flagged.items()) + "</ul></div>")
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>pwbench ROI report</title>",
        f"<style>{CSS}</style><script>{plotly.offline.get_plotlyjs()}</script></head><body>",
        '<section id="executive"><h1>Can these engines serve more on the same devices?</h1>',
        f'<p class="small">Workload <b>{E(str(wl.get("name")))}</b> ({E(str(wl.get("requests")))} requests, '
        f'{E(str(wl.get("arrival")))} arrivals, seed {E(str(first.get("seed")))}) on '
        f'{E(str(env.get("gpu") or env.get("cpu_model")))}; '
        f'SLO {E(slo)}; device budget <b>{E(budget)}</b>; engines {E(engines)}. Inputs: <b>${prices.gpu_hour_usd:g} '
        f'per device-hour</b>, target load <b>{prices.target_rps:g} req/s</b>, '
        f'utilisation <b>{prices.utilisation:g}</b> (change with --gpu-hour-usd, --target-rps, --utilisation). '
        f'All numbers measured on this machine; hover a cell for its run folder and metric.</p>',
        f'<div class="rec" id="recommendation"><b>Recommendation:</b> {E(sentence)}<br>'
        f'<span class="small">{E(roi.RULE)}</span></div>',
        warn, _html_table(header, cells, titles),
        '<p class="small">served: requests completed of those sent; a request an engine could not serve (e.g. a prompt '
        'longer than the KV cache its budget leaves) counts as not answered in accuracy. vs full: accuracy points '
        'against the full-precision run; top-1 vs fp32: teacher-forced agreement with the float32 reference after '
        'the run.</p>',
        '<p class="small">Where each column comes from (per run folder):</p>'
        f'<ul class="small">{sources}</ul></section>',
        '<section id="engineering"><h1>Engineering detail</h1>',
        *_engineering(runs, rows),
        "<h2>Runs: configuration and environment</h2>",
    ]
    for r in runs:
        detail = {k: r.run.get(k) for k in ("status", "config", "engine", "workload", "environment", "quality",
                                            "engine_notes")}
        parts.append(f"<details><summary>{E(r.label)} <span class='tag'>{E(str(r.folder))}</span></summary>"
                     f"<pre>{E(json.dumps(detail, indent=1, default=str))}</pre></details>")
    parts.append("<p class='small'>Measured: every number above comes from the run folders. Projected: cost and "
                 "devices apply the stated prices and target load to the measured goodput.</p></section></body></html>")
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

"""The summary table `pwbench run` and `pwbench show` print (rich, plain text when piped), and
`show_run`: a result folder checked (harness/result_checks.py), its summary recomputed from
requests.parquet and steps.parquet by harness.metrics, printed with any difference from run.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.errors import HarnessError


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def rows(run: dict[str, Any]) -> list[tuple[str, str]]:
    s = run["summary"]
    out = [
        ("status", run["status"] + (f" ({run['error']})" if run.get("error") else "")),
        ("workload",
         f"{run['workload']['name']} ({run['workload']['arrival']}, {run['workload']['requests']} requests)"),
        ("engine", f"{run['engine']['name']} on {run['engine']['device']} ({run['engine']['dtype']})"),
        ("requests", f"{s['completed']} completed, {s['failed']} failed, {_fmt(s['duration_s'], 2)} s"),
        ("throughput",
         f"{_fmt(s['requests_per_s'], 2)} req/s, in {_fmt(s['input_tokens_per_s'])} tok/s, out "
         f"{_fmt(s['output_tokens_per_s'])} tok/s"),
        ("engine steps",
         f"prefill {_fmt(s['engine']['prefill_tokens_per_s'])} tok/s, decode "
         f"{_fmt(s['engine']['decode_tokens_per_s'])} tok/s, {s['engine']['steps']} steps"),
    ]
    for key, label in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("itl_ms", "ITL ms"), ("e2e_ms", "E2E ms")):
        d = s[key]
        out.append((label, f"mean {_fmt(d['mean'])}  p50 {_fmt(d['p50'])}  p90 {_fmt(d['p90'])}  p99 {_fmt(d['p99'])}"))
    slo = ", ".join(f"{k}<={v:g}" for k, v in s["slo"].items())
    out.append(("goodput",
                f"{_fmt(s['goodput_requests_per_s'], 2)} req/s meet {slo} ({_fmt((s['slo_attainment'] or 0) * 100)}%)"))
    e = s["engine"]
    gone = (run.get("engine") or {}).get("unavailable") or {}  # metrics the engine cannot see (remote)
    out.append(("host<->device", "unavailable" if "transfers" in gone else f"h2d {_fmt(e['h2d_bytes'])} B, d2h "
                f"{_fmt(e['d2h_bytes'])} B, {_fmt(e['h2d_bytes_per_output_token'])} h2d B/token"))
    out.append(("experts hit", "unavailable" if "experts" in gone else
                f"{_fmt(e['experts_hit_per_step_mean'])} per step, {e['preemptions']} preemptions"))
    eff = s.get("efficiency", {})
    if "mbu" in eff or "mfu" in eff:
        out.append(("efficiency",
                    f"MBU {_fmt(eff.get('mbu', 0) * 100)}%, MFU {_fmt(eff.get('mfu', 0) * 100)}% "
                    f"({eff['peaks_source']})"))
    for task, a in s.get("accuracy", {}).items():
        out.append((f"accuracy {task}", f"{a['accuracy'] * 100:.1f}% ({a['correct']}/{a['total']})"))
    q = run.get("quality")
    if q and "kl_mean" in q:
        out.append(("quality vs fp32",
                    f"KL {q['kl_mean']:.4f} nats/token, top-1 agreement {q['top1_agreement'] * 100:.1f}%, "
                                       f"ppl {q['perplexity']:.2f} (ref {q['reference_perplexity']:.2f})"))
    elif q:
        out.append(("quality vs fp32", q.get("skipped", "-")))
    f = s.get("fidelity") or {}
    if "fidelity" in f:
        out.append(("vs full precision", f"{f['identical']}/{f['compared']} answers identical "
                                         f"({f['fidelity'] * 100:.1f}%), {f['flips_lost']} lost / "
                                         f"{f['flips_gained']} gained flips, token match "
                                         f"{f['token_match_mean'] * 100:.1f}%"))
    elif run.get("fidelity_skipped"):
        out.append(("vs full precision", f"not compared: {run['fidelity_skipped']}"))
    cap = run.get("capacity")
    if cap:
        rate = cap.get("requests_per_s")
        found = (f"{'>= ' if cap.get('limit') == 'above_highest_rate' else ''}{_fmt(rate, 2)} req/s" if rate
                 else "none (below the lowest rate tried)")
        slo = ", ".join(f"{k}<={v:g}" for k, v in (cap.get("slo") or {}).items())
        out.append(("capacity at SLO", f"{found} with {cap.get('attainment', 0) * 100:g}% of requests within {slo} "
                                       f"({len(cap.get('points') or [])} points)"))
    st = run.get("stability")
    if st and "loads" in st:
        loads = ", ".join(f"{x['name']} {x['probes_varying']} varying / {x['flips']} flips" for x in st["loads"])
        out.append(("stability", f"{st['probes']} probes x {st['repeats']}: {loads}"))
    tr = s.get("transitions")
    if tr:
        inside, outside = tr.get("itl_ms_inside") or {}, tr.get("itl_ms_outside") or {}
        out.append(("bit transitions", f"{tr['windows']} windows ({_fmt(tr['per_minute'])}/min), ITL p99 "
                                       f"{_fmt(inside.get('p99'))} ms inside vs {_fmt(outside.get('p99'))} ms outside"))
    m = s.get("memory", {})
    if "weight_bytes" in m and "memory" not in gone:
        out.append(("memory",
                    f"weights {_fmt(m['weight_bytes'] / 2**20)} MiB, KV cache {_fmt(m['kv_cache_bytes'] / 2**20)} MiB "
                              f"({_fmt(m.get('kv_capacity_tokens'))} tokens)"))
    if m.get("budget_bytes") and "peak_device_bytes" in m:
        out.append(("device budget",
                    f"{_fmt(m['budget_bytes'] / 2**20, 2)} MiB, peak use {_fmt(m['peak_device_bytes'] / 2**20, 2)} MiB "
                                     f"({_fmt(m['peak_share_of_budget'] * 100)}%)"))
    if "expert_cache_hit_rate" in m:
        prefetch = f", prefetch {m['prefetch_used']}/{m['prefetch_issued']} used" if "prefetch_issued" in m else ""
        out.append(("expert cache", f"hit rate {_fmt(m['expert_cache_hit_rate'] * 100)}% "
                                    f"({m['expert_cache_hits']:,} hits, "
                                    f"{m['expert_cache_misses']:,} misses){prefetch}"))
    if "link_bytes_per_s" in m:
        peak = f" of {_fmt(m['link_peak_bytes_per_s'] / 1e9, 2)} GB/s peak" if m.get("link_peak_bytes_per_s") else ""
        out.append(("link",
                    f"{_fmt(m['link_bytes_per_s'] / 1e9, 2)} GB/s achieved{peak}, "
                    f"{_fmt(m['copy_busy_s'], 3)} s copying, "
                            f"{_fmt(m['copy_overlap_share'] * 100)}% overlapped compute"))
    p = s.get("expert_precision")
    if p:
        out.append(("expert bits",
                    f"mean {_fmt(p['mean_bits'], 2)} (min {_fmt(p['min_bits'], 2)}, max {_fmt(p['max_bits'], 2)}, "
                    f"last {_fmt(p['last_bits'], 2)}), {p['promotions']:,} promotions, "
                    f"{p['demotions']:,} demotions, {_fmt(p['move_bytes'] / 2**20, 2)} MiB moved"))
        cost = (f"; cost {p['feedback_rows']:,} rows, {_fmt(p['feedback_s'], 3)} s "
                f"({_fmt((p['feedback_share_of_busy'] or 0) * 100, 2)}% of busy), "
                f"{_fmt(p['feedback_bytes'] / 2**10)} KiB"
                if "feedback_s" in p else "")
        out.append(("quality feedback", f"{p['feedback_checks']:,} checks, max relative error "
                                        f"{_fmt(p['feedback_error_max'], 4)}, {p['fallbacks']} fallbacks{cost}"))
    if e.get("prefix_cache_hit_rate") is not None and e.get("cached_prompt_tokens"):
        out.append(("prefix cache", f"{_fmt(e['prefix_cache_hit_rate'] * 100)}% of prompt tokens from cache "
                                    f"({e['cached_prompt_tokens']:,} tokens)"))
    return out


def _read(path: Path):
    import pandas as pd

    try:
        return pd.read_parquet(path)
    except Exception as exc:  # noqa: BLE001  (pyarrow raises several types for a bad file)
        raise HarnessError(f"{path}: not a readable parquet file ({type(exc).__name__}); rerun the run") from None


def table_rows(folder: Path) -> list[tuple[str, str]]:
    """Lines for the engine's own tables in a result folder, when it wrote them (pagedweight:
    expert_usage, expert_bits, fallbacks)."""
    out: list[tuple[str, str]] = []
    try:
        return _table_rows(folder, out)
    except (KeyError, AttributeError, TypeError, ValueError) as exc:
        raise HarnessError(f"{folder}: an engine table ({', '.join(n for n, _ in out) or 'expert_usage'} or the "
                           f"next) lacks the expected columns ({type(exc).__name__}: {exc}); rerun the run") from None


def _table_rows(folder: Path, out: list[tuple[str, str]]) -> list[tuple[str, str]]:
    if (path := folder / "expert_usage.parquet").exists():
        usage = _read(path)
        for layer, part in usage.groupby("layer"):
            shares = part.sort_values("expert")["tokens"] / max(1, part["tokens"].sum())
            out.append((f"experts layer {layer}", "selected " + " / ".join(f"{v:.0%}" for v in shares)
                        + f" of {int(part['tokens'].sum()):,} token choices (expert 0, 1, ...)"))
    if (path := folder / "expert_bits.parquet").exists():
        bits = _read(path)
        if len(bits):
            per = bits.groupby(["engine_step", "layer"])["bits"].mean().unstack("layer")
            steps = per.index
            text = "; ".join(f"layer {layer} mean {col.mean():.1f} (min {col.min():.1f} at step {int(col.idxmin())})"
                             for layer, col in per.items())
            out.append(("bits matrix", f"{len(steps)} snapshots, steps {int(steps.min())}-{int(steps.max())}: {text}"))
    if (path := folder / "fallbacks.parquet").exists():
        events = _read(path)
        refused = events[events["refused_bits"] > 0] if "refused_bits" in events else events.iloc[:0]
        pins = events.drop(refused.index)
        if len(pins):
            first = "; ".join(f"step {int(r.engine_step)} layer {int(r.layer)} expert {int(r.expert)} "
                              f"{int(r.from_bits)} -> floor {int(r.floor_bits)} bits"
                              for r in pins.head(3).itertuples())
            out.append(("fallbacks", f"{len(pins)} events: {first}{' ...' if len(pins) > 3 else ''}"))
        if len(refused):
            out.append(("fallbacks refused", f"{len(refused)} pins not made: the requests in flight need the KV "
                                             "room the higher floors would take"))
    return out


def print_summary(run: dict[str, Any], folder: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for name, text in rows(run) + table_rows(folder):
        table.add_row(name, text)
    console = Console()
    console.print(table)
    for note in run["workload"].get("notes", []):
        console.print(f"note: {note}", style="dim")
    for note in run.get("engine_notes") or []:
        console.print(f"engine: {note}")
    unavailable = (run.get("engine") or {}).get("unavailable") or {}
    if unavailable:
        console.print("unavailable: " + "; ".join(f"{k} ({v})" for k, v in unavailable.items()), style="dim")
    console.print(f"results: {folder}")


def recompute(run: dict[str, Any], folder: Path) -> tuple[dict[str, Any], list[str]]:
    """(the summary recomputed from the folder's requests and steps tables, the summary keys
    where run.json's stored one differs). An imported run keeps its stored summary: its rates
    use the source file's own duration, which the rows do not hold."""
    from harness.fidelity import fidelity_summary
    from harness.metrics import summarize
    from harness.precision import transition_summary
    from reports.runs import Run

    stored = run["summary"]
    if run.get("imported"):
        return stored, []
    r = Run(folder, run)
    requests, steps = r.rows("requests"), r.rows("steps")
    info = run["engine"]
    try:
        summary = summarize(requests, steps, stored["slo"], info.get("model_stats") or {},
                            (run.get("environment") or {}).get("peaks") or {})
        summary["memory"].update({k: info[k] for k in ("weight_bytes", "kv_cache_bytes", "kv_capacity_tokens")
                                  if k in info})
        if fidelity := fidelity_summary(requests):
            summary["fidelity"] = fidelity
        if (transitions := transition_summary(requests, steps, summary["duration_s"])) is not None:
            summary["transitions"] = transitions
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise HarnessError(f"{folder}: cannot recompute the summary from requests.parquet and steps.parquet "
                           f"({type(exc).__name__}: {exc}); the files are damaged, rerun the run") from None
    summary = json.loads(json.dumps(summary, default=float))  # as run.json holds it (tuples as lists)
    return summary, sorted(k for k in set(summary) | set(stored) if summary.get(k) != stored.get(k))


def show_run(folder: Path, as_json: bool = False) -> None:
    """`pwbench show`: the folder checked, its summary recomputed from its files and printed;
    keys where run.json's stored summary differs are named on stderr."""
    import typer

    from harness.result_checks import check_folder

    run = check_folder(folder)
    summary, differs = recompute(run, folder)
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        print_summary({**run, "summary": summary}, folder)
    if differs:
        typer.echo(f"note: recomputed from the files; run.json's stored summary differs in {', '.join(differs)}",
                   err=True)

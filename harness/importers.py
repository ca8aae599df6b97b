"""`pwbench import`: results of other benchmark tools -> pwbench result folders.

vLLM (`vllm bench serve --save-result --save-detailed`): one JSON object with per-request
lists `input_lens`, `output_lens` (the server's usage counts), `ttfts` (s), `itls` (s, gaps
between streamed chunks), `errors`, and in newer versions `start_times` (perf_counter s),
next to its aggregates (`duration`, `mean_ttft_ms`, `median_tpot_ms`, `p99_itl_ms`, ...).
Each request becomes a requests.parquet row: first token at start + ttft, then one time per
chunk, finish at the last chunk (vLLM's latency); output_tokens from output_lens, so TPOT is
(latency - ttft) / (output_lens - 1) exactly as vLLM defines it. The summary is recomputed by
harness.metrics from those rows; the duration-based rates use the file's own `duration`
(vLLM's clock for the whole benchmark). What the file cannot say is recorded as unavailable;
its own aggregates are kept verbatim under `imported.source_summary`.

GuideLLM (`guidellm benchmark --output-path report.json`): `benchmarks[i].requests` holds
`successful` / `errored` / `incomplete` request records; the importer reads their serialized
computed fields, which every GuideLLM version writes: start (`request_start_time`, older
`start_time`), `time_to_first_token_ms`, `inter_token_latency_ms` ((last - first token) /
(output tokens - 1): pwbench's TPOT), `request_latency`, `prompt_tokens`, `output_tokens`.
GuideLLM's own `time_per_output_token_ms` ((last token - start) / output tokens, TTFT
included) has no pwbench twin and stays in the source; only first and last token times
exist, so ITL is unavailable.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from engines.base import EngineInfo, unseen_metrics
from harness.errors import HarnessError
from harness.metrics import DEFAULT_SLO, DEFINITIONS, summarize
from harness.results import SCHEMA_VERSION, check_output, new_run_id, write_run

VLLM_DETAIL = ("input_lens", "output_lens", "ttfts", "itls")


def _load_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise HarnessError(f"{path} is not a file")
    text = path.read_text(errors="replace").strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        lines = [line for line in text.splitlines() if line.strip()]
        if len(lines) > 1:  # vLLM appends one object per run to a .jsonl file
            raise HarnessError(f"{path} holds {len(lines)} JSON lines (several runs); "
                               "split it and import one") from None
        raise HarnessError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise HarnessError(f"{path}: expected one JSON object (a vllm bench serve result)")
    return data


def _row(request_id: str, arrival: float, prompt_tokens: int, output_tokens: int, times: list[float],
         finish: float | None, error: str | None) -> dict[str, Any]:
    """One requests.parquet row, with the columns pwbench's own runs write."""
    return {
        "request_id": request_id, "session_id": None, "turn": 0, "arrival_s": arrival, "prompt_tokens": prompt_tokens,
        "max_new_tokens": output_tokens, "sent_s": arrival, "started_s": None,
        "first_token_s": times[0] if times else None, "finish_s": None if error else finish,
        "finish_reason": None if error else "length", "error": error, "token_times_s": times, "output_ids": [],
        "task": None, "answer": None, "output_tokens": 0 if error else output_tokens, "output_text": None,
    }


def vllm_rows(data: dict[str, Any], path: Path) -> tuple[list[dict[str, Any]], bool]:
    """requests.parquet rows from the per-request lists; also whether start times were known."""
    missing = [k for k in VLLM_DETAIL if not isinstance(data.get(k), list)]
    if missing:
        raise HarnessError(f"{path} has no per-request details ({', '.join(missing)} missing): save the vllm bench "
                           "serve run with --save-result --save-detailed")
    n = len(data["ttfts"])
    errors = data.get("errors") or [""] * n
    starts = data.get("start_times")
    lists = {k: data[k] for k in VLLM_DETAIL} | {"errors": errors} | ({"start_times": starts} if starts else {})
    bad = [k for k, v in lists.items() if len(v) != n]
    if bad:
        raise HarnessError(f"{path}: per-request lists differ in length "
                           f"({', '.join(f'{k} {len(lists[k])}' for k in bad)}"
                           f" vs ttfts {n})")
    t0 = min(starts) if starts else 0.0
    rows = []
    for i in range(n):
        arrival = (starts[i] - t0) if starts else 0.0
        failed = bool(errors[i])
        times: list[float] = []
        if not failed:
            t = arrival + float(data["ttfts"][i])
            times.append(t)
            for gap in data["itls"][i] or ():
                t += float(gap)
                times.append(t)
        rows.append(_row(f"vllm-{i}", arrival, int(data["input_lens"][i]), int(data["output_lens"][i]), times,
                         times[-1] if times else None, str(errors[i]) if failed else None))
    return rows, bool(starts)


def _with_duration(summary: dict[str, Any], duration: float) -> dict[str, Any]:
    """Rates over the source's own benchmark duration instead of first arrival -> last finish."""
    done = summary["completed"]
    good = summary["goodput_requests_per_s"] * summary["duration_s"]
    return {**summary, "duration_s": duration, "requests_per_s": done / duration,
            "input_tokens_per_s": summary["input_tokens"] / duration,
            "output_tokens_per_s": summary["output_tokens"] / duration, "goodput_requests_per_s": good / duration}


def import_vllm(path: str | Path, output: str | None = None, results_dir: str = "results",
                slo: dict[str, float] | None = None) -> tuple[Path, dict[str, Any]]:
    path = Path(path)
    data = _load_json(path)
    rows, timed = vllm_rows(data, path)
    duration = data.get("duration")
    if not isinstance(duration, (int, float)) or duration <= 0:
        raise HarnessError(f"{path}: 'duration' (seconds) is missing or not positive")
    model = data.get("model_id") or data.get("model")
    run_id = new_run_id(f"vllm-{data.get('dataset_name') or path.stem}", "vllm")
    folder = Path(output) if output else Path(results_dir) / run_id
    check_output(folder)
    slo = dict(slo or DEFAULT_SLO)
    summary = _with_duration(summarize(rows, [], slo, {}, {}), float(duration))
    if not timed:
        summary["peak_concurrency"] = None  # every request was placed at t=0
    unavailable = unseen_metrics("imported from vllm bench serve")
    unavailable["accuracy"] = "imported from vllm bench serve: no task answers"
    notes = ["imported from vllm bench serve: token times are per streamed chunk (vLLM's ITL); TPOT uses the "
             "server's usage token counts"]
    if not timed:
        unavailable["arrival_s"] = "this vllm version saved no start_times: every request is placed at t=0"
        unavailable["peak_concurrency"] = "no start_times in the file"
    info = EngineInfo(name="vllm", model=model, architecture=None, device="remote", dtype="unknown", vocab_size=0,
                      max_model_len=0, config={"backend": data.get("backend")}, unavailable=unavailable)
    source = {k: v for k, v in data.items() if not isinstance(v, list)}
    run = {
        "schema_version": SCHEMA_VERSION, "run_id": folder.name, "status": "complete", "error": None,
        "started_at_unix": None, "seed": None,
        "config": {"workload": {"name": data.get("dataset_name")}, "engine": "vllm", "model": model,
                   "engine_options": {}, "slo": slo, "source_file": str(path)},
        "engine": asdict(info),
        "workload": {"name": f"vllm:{data.get('dataset_name') or 'unknown'}",
                     "arrival": f"request rate {data.get('request_rate')}", "requests": len(rows),
                     "concurrency": data.get("max_concurrency"), "notes": notes, "demo_tasks": False},
        "environment": {}, "telemetry": {}, "summary": summary, "definitions": dict(DEFINITIONS),
        "engine_notes": [], "quality": None,
        "imported": {"tool": "vllm bench serve", "file": str(path), "duration_from_source": True,
                     "source_summary": source},
    }
    write_run(folder, run, rows, [], [])
    return folder, run


def _dig(value: Any, *keys: str) -> Any:
    """value[k1][k2]... or None where a level is missing or not an object."""
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _guidellm_rows(records: list[dict[str, Any]], error: str | None) -> list[dict[str, Any]]:
    rows = []
    for r in records:
        start = r.get("request_start_time", r.get("start_time"))
        ttft, latency = r.get("time_to_first_token_ms"), r.get("request_latency")
        n = int(r.get("output_tokens") or 0)
        times: list[float] = []
        if error is None and None not in (start, ttft, latency):
            times.append(ttft / 1e3)
            if n > 1 and r.get("inter_token_latency_ms") is not None:
                times.append(times[0] + r["inter_token_latency_ms"] / 1e3 * (n - 1))  # the last token
        rows.append({"start": start, "request_id": str(r.get("request_id")),
                     "prompt_tokens": int(r.get("prompt_tokens") or 0),
                     "output_tokens": n, "times": times, "latency": latency, "error": error})
    return rows


def import_guidellm(path: str | Path, output: str | None = None, results_dir: str = "results",
                    slo: dict[str, float] | None = None, index: int | None = None) -> tuple[Path, dict[str, Any]]:
    path = Path(path)
    data = _load_json(path)
    benchmarks = data.get("benchmarks")
    if not isinstance(benchmarks, list) or not benchmarks:
        raise HarnessError(f"{path} has no 'benchmarks' list: is it a GuideLLM report (--output-path report.json)?")
    if index is None and len(benchmarks) > 1:
        raise HarnessError(f"{path} holds {len(benchmarks)} benchmarks (a sweep); choose one with --index "
                           f"0..{len(benchmarks) - 1}")
    i = index or 0
    if not 0 <= i < len(benchmarks):
        raise HarnessError(f"--index {i} is out of range: {path} holds {len(benchmarks)} benchmarks")
    bench = benchmarks[i]
    requests = bench.get("requests") if isinstance(bench, dict) else None
    if not isinstance(requests, dict) or not isinstance(requests.get("successful"), list):
        raise HarnessError(f"{path}: benchmark {i} has no per-request records (requests.successful)")
    raw = (_guidellm_rows(requests.get("successful") or [], None)
           + _guidellm_rows(requests.get("errored") or [], "errored (GuideLLM)")
           + _guidellm_rows(requests.get("incomplete") or [], "incomplete (GuideLLM)"))
    starts = [r["start"] for r in raw if r["start"] is not None]
    t0 = min(starts, default=0.0)
    rows = []
    for k, r in enumerate(raw):
        arrival = (r["start"] - t0) if r["start"] is not None else 0.0
        times = [arrival + t for t in r["times"]]
        ok = r["error"] is None and bool(times)
        rows.append(_row(r["request_id"] or f"guidellm-{k}", arrival, r["prompt_tokens"], r["output_tokens"], times,
                         arrival + r["latency"] if ok else None,
                         None if ok else (r["error"] or "no timings in the GuideLLM record")))
    slo = dict(slo or DEFAULT_SLO)
    summary = summarize(rows, [], slo, {}, {})
    summary["itl_ms"] = {key: None for key in summary["itl_ms"]}  # only first and last token times exist
    unavailable = unseen_metrics("imported from GuideLLM")
    unavailable["itl_ms"] = "imported from GuideLLM: only first and last token times are recorded per request"
    unavailable["accuracy"] = "imported from GuideLLM: no task answers"
    model = _dig(bench, "benchmarker", "backend", "model")
    kind = _dig(bench, "scheduler", "strategy", "type_") or _dig(bench, "args", "strategy", "type_")
    folder = Path(output) if output else Path(results_dir) / new_run_id(f"guidellm-{kind or i}", "guidellm")
    check_output(folder)
    info = EngineInfo(name="guidellm", model=model, architecture=None, device="remote", dtype="unknown", vocab_size=0,
                      max_model_len=0, unavailable=unavailable)
    source = {k: v for k, v in bench.items() if k not in ("requests",)}
    run = {
        "schema_version": SCHEMA_VERSION, "run_id": folder.name, "status": "complete", "error": None,
        "started_at_unix": t0 if starts else None, "seed": None,
        "config": {"workload": {"name": f"guidellm:{kind or i}"}, "engine": "guidellm", "model": model,
                   "engine_options": {}, "slo": slo, "source_file": str(path)},
        "engine": asdict(info),
        "workload": {"name": f"guidellm:{kind or i}", "arrival": str(kind), "requests": len(rows), "concurrency": None,
                     "notes": ["imported from GuideLLM: TPOT is GuideLLM's inter_token_latency_ms; GuideLLM's "
                               "time_per_output_token_ms includes TTFT and stays in the source"], "demo_tasks": False},
        "environment": {}, "telemetry": {}, "summary": summary, "definitions": dict(DEFINITIONS),
        "engine_notes": [], "quality": None,
        "imported": {"tool": "guidellm", "file": str(path), "benchmark_index": i, "duration_from_source": False,
                     "source_summary": source},
    }
    write_run(folder, run, rows, [], [])
    return folder, run

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
            raise HarnessError(f"{path} holds {len(lines)} JSON lines (several runs); split it and import one") from None
        raise HarnessError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise HarnessError(f"{path}: expected one JSON object (a vllm bench serve result)")
    return data


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
        raise HarnessError(f"{path}: per-request lists differ in length ({', '.join(f'{k} {len(lists[k])}' for k in bad)}"
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
        rows.append({
            "request_id": f"vllm-{i}", "session_id": None, "turn": 0, "arrival_s": arrival,
            "prompt_tokens": int(data["input_lens"][i]), "max_new_tokens": int(data["output_lens"][i]),
            "sent_s": arrival, "started_s": None, "first_token_s": times[0] if times else None,
            "finish_s": times[-1] if times else None, "finish_reason": None if failed else "length",
            "error": str(errors[i]) if failed else None, "token_times_s": times, "output_ids": [],
            "task": None, "answer": None, "output_tokens": 0 if failed else int(data["output_lens"][i]),
            "output_text": None,
        })
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

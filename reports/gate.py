"""`pwbench gate`: candidate runs against a baseline, metric by metric, under a policy.

- deterministic metrics (tokens, per-request output digests, accuracy counts, bytes moved
  per token, KV capacity, prefix-cache hits, mean bits) must be equal (policy
  `deterministic_tolerance`, relative, default 0);
- timing metrics are compared on medians of the repeated runs on each side; a metric
  regresses only when it is worse by more than max(`timing_tolerance`, `sigmas` x the
  relative standard error of the difference of the medians' samples); it is not judged
  with fewer than `--repeat` samples a side, and a p99 not with fewer than
  `min_p99_samples` requests a run.
A side is result folders (several = repeats) or a baseline JSON (BASELINE_SCHEMA). Every
folder is checked first (harness/result_checks.py: run.json types, requests/steps tables); an unfinished
run (interrupted, failed) is not judgeable: one failing `run_status` verdict says why; the sides
must be runs of one workload, seed and model (`identity`) unless the caller allows otherwise.
Verdicts go to the terminal, JUnit XML and Markdown. Exit: 0 pass, 1 regression, 2 unusable input.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

from harness.errors import HarnessError, read_toml
from harness.result_checks import unfinished
from reports.runs import Run, load_runs

BASELINE_SCHEMA = "pwbench-gate-baseline/1"
# name -> (path in run.json summary, better: +1 higher / -1 lower)
TIMING = {
    "output_tokens_per_s": (("output_tokens_per_s",), +1),
    "requests_per_s": (("requests_per_s",), +1),
    "goodput_requests_per_s": (("goodput_requests_per_s",), +1),
    "decode_tokens_per_s": (("engine", "decode_tokens_per_s"), +1),
    "prefill_tokens_per_s": (("engine", "prefill_tokens_per_s"), +1),
    "ttft_ms_p50": (("ttft_ms", "p50"), -1), "tpot_ms_p50": (("tpot_ms", "p50"), -1),
    "e2e_ms_p50": (("e2e_ms", "p50"), -1), "ttft_ms_p99": (("ttft_ms", "p99"), -1),
    "tpot_ms_p99": (("tpot_ms", "p99"), -1),
}
DETERMINISTIC = {
    "completed": ("completed",), "failed": ("failed",), "output_tokens": ("output_tokens",),
    "h2d_bytes_per_output_token": ("engine", "h2d_bytes_per_output_token"),
    "d2h_bytes_per_output_token": ("engine", "d2h_bytes_per_output_token"),
    "cached_prompt_tokens": ("engine", "cached_prompt_tokens"),
    "kv_capacity_tokens": ("memory", "kv_capacity_tokens"),
    "mean_bits": ("expert_precision", "mean_bits"),
}


@dataclass(frozen=True)
class Policy:
    deterministic_tolerance: float = 0.0
    timing_tolerance: float = 0.05
    sigmas: float = 3.0
    min_p99_samples: int = 300
    repeat: int = 1


def load_policy(path: str | Path | None, repeat: int = 1) -> Policy:
    if path is None:
        return Policy(repeat=repeat)
    known = [f.name for f in fields(Policy) if f.name != "repeat"]
    data = read_toml(path, "policy", known)
    for key, value in data.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise HarnessError(f"{path}: {key} must be a number >= 0, got {value!r}")
    return Policy(**{k: (int(v) if k == "min_p99_samples" else float(v)) for k, v in data.items()}, repeat=repeat)


def _get(summary: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(summary, dict) or key not in summary:
            return None
        summary = summary[key]
    return summary


def run_metrics(run: Run) -> dict[str, Any]:
    """One run's gate metrics: {"deterministic": {name: value}, "timing": {name: value},
    "requests": measured request count}."""
    s = run.summary
    det = {name: _get(s, path) for name, path in DETERMINISTIC.items()}
    for task, a in (s.get("accuracy") or {}).items():
        det[f"accuracy_{task}_correct"] = a["correct"]
    outputs = sorted((str(r["request_id"]), r.get("output_ids") or []) for r in run.rows("requests")
                     if not r.get("warmup"))
    det["output_digest"] = hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]
    timing = {name: _get(s, path) for name, (path, _) in TIMING.items()}
    return {"deterministic": {k: v for k, v in det.items() if v is not None},
            "timing": {k: v for k, v in timing.items() if v is not None}, "requests": s.get("completed") or 0}


def identity(run: dict[str, Any]) -> dict[str, Any]:
    """What must agree for a gate to compare two runs: the workload as configured (seed,
    requests, rate, ... included) and the model folder's name (paths differ across machines)."""
    config = run.get("config") or {}
    workload = dict(config.get("workload") or {"name": run["workload"]["name"]})
    workload.setdefault("seed", run.get("seed"))
    sim = run.get("simulated")
    return {"workload": workload, "model": Path(str(config["model"])).name if config.get("model") else None,
            "simulated": sim.get("hardware") if isinstance(sim, dict) else None}


def differences(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[str]:
    """`b`'s identity against `a`'s, one phrase per field that differs ([] when either is unknown)."""
    if a is None or b is None:
        return []
    out = [f"{k}={b['workload'].get(k)!r} (vs {a['workload'].get(k)!r})"
           for k in sorted(set(a["workload"]) | set(b["workload"])) if a["workload"].get(k) != b["workload"].get(k)]
    if a.get("model") != b.get("model"):
        out.append(f"model={b.get('model')!r} (vs {a.get('model')!r})")
    if a.get("simulated") != b.get("simulated"):  # measured and simulated numbers never gate each other
        def what(side: dict[str, Any]) -> str:
            return f"simulated on {side['simulated']}" if side.get("simulated") else "measured"

        out.append(f"{what(b)} (vs {what(a)})")
    return out


@dataclass(frozen=True)
class Side:
    source: str
    deterministic: dict[str, Any]
    timing: dict[str, list[float]]
    requests: int  # fewest measured requests in one run
    identity: dict[str, Any] | None = None  # None: a baseline JSON written before identities were kept
    unfinished: tuple[str, ...] = ()  # "folder: status ..." for each run that did not complete


def load_side(paths: list[str], what: str) -> Side:
    if len(paths) == 1 and paths[0].endswith(".json"):
        path = Path(paths[0])
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise HarnessError(f"{path}: no such {what} file; write one with --update-baseline") from None
        except json.JSONDecodeError as exc:
            raise HarnessError(f"{path}: invalid JSON at line {exc.lineno}") from None
        if not isinstance(data, dict) or data.get("schema") != BASELINE_SCHEMA:
            raise HarnessError(f"{path}: not a pwbench gate baseline (schema {BASELINE_SCHEMA!r}); write "
                               "one with --update-baseline")
        try:
            ident = data.get("identity")
            if ident is not None and not (isinstance(ident, dict) and isinstance(ident.get("workload"), dict)):
                raise TypeError("identity must be an object with a workload object")
            return Side(str(path), dict(data["deterministic"]),
                        {k: [float(x) for x in v] for k, v in data.get("timing", {}).items()},
                        int(data.get("requests", 0)), ident)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise HarnessError(f"{path}: malformed baseline ({type(exc).__name__}: {exc}); write a new "
                               "one with --update-baseline") from None
    runs = load_runs(paths)
    ident = identity(runs[0].run)
    for r in runs[1:]:
        if diff := differences(ident, identity(r.run)):
            raise HarnessError(f"{what}: repeated runs are of different workloads or models ({r.folder} vs "
                               f"{runs[0].folder}: {', '.join(diff)}); repeats must be runs of one configuration")
    gone = tuple(f"{r.folder}: {why}" for r in runs if (why := unfinished(r.run)))
    if gone:
        return Side(", ".join(str(r.folder) for r in runs), {}, {}, 0, ident, gone)
    ms = [run_metrics(r) for r in runs]
    det = ms[0]["deterministic"]
    for r, m in zip(runs[1:], ms[1:]):
        if m["deterministic"] != det:
            diff = sorted(k for k in set(det) | set(m["deterministic"]) if det.get(k) != m["deterministic"].get(k))
            raise HarnessError(f"{what}: repeated runs disagree on deterministic metrics {diff} "
                               f"({runs[0].folder} vs {r.folder}); "
                               "repeats must be runs of one configuration")
    timing = {k: [m["timing"][k] for m in ms if k in m["timing"]] for k in TIMING}
    return Side(", ".join(str(r.folder) for r in runs), det, {k: v for k, v in timing.items() if v},
                min(m["requests"] for m in ms), ident)


@dataclass(frozen=True)
class Verdict:
    metric: str
    kind: str  # deterministic | timing
    baseline: Any
    candidate: Any
    status: str  # pass | fail | not judged
    detail: str


def _rel_se(b: list[float], c: list[float], ref: float) -> float:
    """Relative standard error of median(c) - median(b) (normal approximation, sd/sqrt(n))."""
    var = sum(statistics.variance(x) / len(x) for x in (b, c) if len(x) > 1)
    return math.sqrt(var) / abs(ref) if ref else math.inf


def compare(base: Side, cand: Side, policy: Policy) -> list[Verdict]:
    """Verdicts metric by metric; a side holding an unfinished run gets one failing
    `run_status` verdict instead (its numbers are not a whole run's, nothing else is judged)."""
    if base.unfinished or cand.unfinished:
        return [Verdict("run_status", "deterministic", "; ".join(base.unfinished) or "complete",
                        "; ".join(cand.unfinished) or "complete", "fail",
                        "an unfinished run is not judgeable; rerun it to completion")]
    out = []
    for name in sorted(set(base.deterministic) | set(cand.deterministic)):
        b, c = base.deterministic.get(name), cand.deterministic.get(name)
        if b is None or c is None:
            out.append(Verdict(name, "deterministic", b, c, "not judged", "missing on one side"))
            continue
        if isinstance(b, (int, float)) and isinstance(c, (int, float)):
            tol = policy.deterministic_tolerance * abs(b)
            ok = abs(c - b) <= tol + 1e-9 * max(1.0, abs(b))
            detail = f"change {c - b:+g}, tolerance {tol:g}"
        else:
            ok, detail = b == c, "must be equal"
        out.append(Verdict(name, "deterministic", b, c, "pass" if ok else "fail", detail))
    for name, (_, better) in TIMING.items():
        b, c = base.timing.get(name), cand.timing.get(name)
        if not c:
            continue
        if not b:
            out.append(Verdict(name, "timing", None, statistics.median(c), "not judged",
                               "no timing samples in the baseline"))
            continue
        mb, mc = statistics.median(b), statistics.median(c)
        if len(b) < policy.repeat or len(c) < policy.repeat:
            out.append(Verdict(name, "timing", mb, mc, "not judged",
                               f"needs {policy.repeat} runs a side (--repeat), has {len(b)} / {len(c)}"))
            continue
        if name.endswith("_p99") and min(base.requests, cand.requests) < policy.min_p99_samples:
            out.append(Verdict(name, "timing", mb, mc, "not judged",
                               f"a p99 needs {policy.min_p99_samples} requests a run, has "
                               f"{min(base.requests, cand.requests)}"))
            continue
        if not mb:
            out.append(Verdict(name, "timing", mb, mc, "not judged", "baseline median is 0"))
            continue
        worse = (mb - mc) / abs(mb) if better > 0 else (mc - mb) / abs(mb)
        noise = policy.sigmas * _rel_se(b, c, mb)
        tol = max(policy.timing_tolerance, noise)
        out.append(Verdict(name, "timing", mb, mc, "fail" if worse > tol else "pass",
                           f"{-worse if better > 0 else worse:+.1%} (median of {len(b)} vs {len(c)}), tolerance "
                           f"max({policy.timing_tolerance:.1%}, {policy.sigmas:g} sigma = {noise:.1%})"))
    return out


def baseline_json(side: Side, timing: bool = True) -> dict[str, Any]:
    return {"schema": BASELINE_SCHEMA, "source": side.source, "requests": side.requests, "identity": side.identity,
            "deterministic": side.deterministic, "timing": side.timing if timing else {}}


def write_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.partial-{os.getpid()}"
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def show(v: Any) -> str:
    return f"{v:,.4g}" if isinstance(v, float) else str(v)


def junit(verdicts: list[Verdict]) -> str:
    suite = ET.Element("testsuite", name="pwbench gate", tests=str(len(verdicts)),
                       failures=str(sum(v.status == "fail" for v in verdicts)), errors="0",
                       skipped=str(sum(v.status == "not judged" for v in verdicts)))
    for v in verdicts:
        case = ET.SubElement(suite, "testcase", classname=f"gate.{v.kind}", name=v.metric)
        message = f"baseline {show(v.baseline)}, candidate {show(v.candidate)}: {v.detail}"
        if v.status == "fail":
            ET.SubElement(case, "failure", message=message)
        elif v.status == "not judged":
            ET.SubElement(case, "skipped", message=message)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def markdown(verdicts: list[Verdict], base: Side, cand: Side) -> str:
    failed = [v for v in verdicts if v.status == "fail"]
    head = f"**pwbench gate: {'FAIL' if failed else 'PASS'}** ({len(failed)} regressions, " \
           f"{sum(v.status == 'not judged' for v in verdicts)} not judged)\n\n" \
           f"baseline `{base.source}`, candidate `{cand.source}`\n"
    lines = ["| metric | kind | baseline | candidate | verdict | detail |", "|---|---|---|---|---|---|"]
    lines += [f"| {v.metric} | {v.kind} | {show(v.baseline)} | {show(v.candidate)} | {v.status} | {v.detail} |"
              for v in verdicts]
    return head + "\n" + "\n".join(lines) + "\n"

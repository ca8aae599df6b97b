"""`pwbench run`: build the workload for the engine's model, drive the engine, write results.

Order: start the engine (its info sizes the workload), build the workload (demo tasks in
rag_long / long_chat when the model speaks the demo language), warm up, run with telemetry,
score task answers, measure quality against the float32 reference, write the result folder.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from engines.base import Engine, EngineInfo
from engines.registry import REFERENCE_ENGINE, REFERENCE_OPTIONS, create_engine, engine_class, engine_role
from harness.calibration import create_calibrated
from harness.capacity import CapacitySettings
from harness.demo_model import DEMO_DEFAULTS, DEMO_TASK_STYLES, demo_synthesizer, uses_demo_language
from harness.metrics import DEFAULT_SLO, DEFINITIONS, summarize
from harness.offline import cut_at_eos
from harness.precision import transition_summary
from harness.results import REQUESTS_STREAM, SCHEMA_VERSION, PartialRun, estimate_bytes, new_run_id, parquet_rows
from harness.runner import RequestRecord, RunLimits, Runner, RunRecords
from workloads.registry import ModelTarget, WorkloadSpec, build_workload


@dataclass(frozen=True)
class RunArgs:
    workload: WorkloadSpec
    given: frozenset[str] = frozenset()  # workload options the user set (demo defaults skip them)
    engine: str = "moe"
    model: str | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)
    output: str | None = None
    results_dir: str = "results"
    slo: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_SLO))
    warmup: int = 2
    telemetry_hz: float = 10.0
    quality: bool = True  # teacher-forced quality and per-request fidelity against the float32 reference
    reference_cache: str | None = None  # folder caching the reference's outputs (the suite's reference/)
    capacity: CapacitySettings | None = None  # also search the capacity at the SLO (harness/capacity.py)
    stability_probes: int | None = None  # also probe output stability under load with this many prompts
    row: str | None = None  # the suite row this run is one repeat of
    repeat: int | None = None  # 1-based repeat index within the suite


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(info: EngineInfo, peaks: dict[str, Any], telemetry: dict[str, Any]) -> dict[str, Any]:
    import importlib.metadata as md  # noqa: PLC0415

    from harness.hw import cpu_model  # noqa: PLC0415

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    return {
        "pwbench": version("pwbench"), "git_commit": git_commit(), "python": sys.version.split()[0],
        "torch": version("torch"), "triton": version("triton"), "transformers": version("transformers"),
        "platform": platform.platform(), "cpu_model": cpu_model(), "device": info.device,
        "gpu": telemetry.get("gpu"), "driver": telemetry.get("driver"), "peaks": peaks,
    }


def build(args: RunArgs, info: EngineInfo, demo: bool):
    spec = args.workload
    base = spec.name.partition(":")[0]
    applied = {k: v for k, v in DEMO_DEFAULTS.get(base, {}).items() if k not in args.given} if demo else {}
    if applied:
        spec = replace(spec, **applied)
    synthesizer = demo_synthesizer(base, spec.seed) if demo else None
    target = ModelTarget(info.vocab_size, info.max_model_len, tuple(info.eos_token_ids))
    workload = build_workload(spec, target, synthesizer)
    if applied:
        note = "demo-model defaults applied: " + ", ".join(f"{k}={v}" for k, v in applied.items())
        workload = replace(workload, notes=(*workload.notes, note))
    return spec, workload


WARMUP_SEED_OFFSET = 7919  # warm-up traffic: the same workload under another seed, never the measured requests
CAPACITY_SEED_OFFSET = 104729  # capacity points' traffic (when they draw their own requests)


def warmup_requests(args: RunArgs, info: EngineInfo, demo: bool) -> list:
    """`args.warmup` requests of the run's workload drawn under another seed, ids prefixed."""
    if args.warmup <= 0:
        return []
    return drawn(args, info, demo, WARMUP_SEED_OFFSET, args.warmup)


def drawn(args: RunArgs, info: EngineInfo, demo: bool, seed_offset: int, count: int) -> list:
    """`count` requests of the run's workload drawn under seed + `seed_offset`: traffic of the
    same shape that is never the measured requests (warm-up, capacity points)."""
    spec = replace(args.workload, seed=args.workload.seed + seed_offset, requests=count)
    return list(build(replace(args, workload=spec), info, demo)[1].requests[:count])


def execute(args: RunArgs, make_runner: Callable[[Runner], None] = lambda r: None,
            on_step: Callable[[RunRecords], None] | None = None,
            on_start: Callable[[], None] | None = None,
            say: Callable[[str], None] = lambda line: None) -> tuple[Path, dict[str, Any]]:
    """Run and write the result folder; returns (folder, run.json). `make_runner` lets the CLI
    keep a handle to each runner (for Ctrl-C: the measured run's, then each capacity point's)
    before it runs; `on_start` is called once warm-up is done, just before the measured run's
    clock starts; `say` gets a progress line per capacity point and stability load.

    The output folder is checked before the engine loads; each request's row is appended to
    the partial folder once it is final (harness/results.py: PartialRun), so what was measured
    survives a crash; a run ended by an exception keeps that folder when it holds a request and
    says where on stderr."""
    run_id = new_run_id(args.workload.name, args.engine)
    folder = Path(args.output) if args.output else Path(args.results_dir) / run_id
    # First of all, even before the engine's module is imported (torch: seconds).
    stream = PartialRun.open(folder, estimate_bytes(args.workload.requests))
    try:
        cls = engine_class(args.engine)  # an unknown engine name fails before anything loads
        model = args.model
        if model is None and cls.needs_model:
            from engines.common.demo import demo_model_path  # noqa: PLC0415

            model = str(demo_model_path())
        return _execute(args, model, stream, make_runner, on_step, on_start, say)
    except BaseException as exc:
        kept = stream.abandon(f"{type(exc).__name__}: {exc}")
        if kept is not None and str(kept) not in str(exc):  # said once, by the error itself or here
            print(f"run: stopped by {type(exc).__name__}; the {stream.requests} measured requests are kept in "
                  f"{kept / REQUESTS_STREAM} (incomplete)", file=sys.stderr)
        raise


def _execute(args: RunArgs, model: str | None, stream: PartialRun, make_runner: Callable[[Runner], None],
             on_step: Callable[[RunRecords], None] | None, on_start: Callable[[], None] | None,
             say: Callable[[str], None]) -> tuple[Path, dict[str, Any]]:
    from harness.hw import peaks_for  # noqa: PLC0415
    from harness.telemetry import TelemetrySampler  # noqa: PLC0415

    folder = stream.target
    engine = create_calibrated(args.engine, {"model": model, **args.engine_options})
    engine.start()
    try:
        info = engine.info()
        demo = uses_demo_language(model, info)
        spec, workload = build(args, info, demo)
        make_row = _row_maker(model)
        written = 0  # steps appended to the stream so far

        def stepped(records: RunRecords) -> None:
            nonlocal written
            if not stream.add_steps(records.steps[written:]):
                runner.stop()  # a full disk: nothing more measured could be kept
            written = len(records.steps)
            if on_step is not None:
                on_step(records)

        def record(rec: RequestRecord) -> None:
            if not stream.add_request(make_row(rec)):
                runner.stop()

        # Final records go to disk and are dropped: memory stays bounded however long the run.
        runner = Runner(engine, workload.requests, workload.closed_loop, workload.concurrency,
                        RunLimits(spec.requests, spec.duration_s), on_step=stepped, on_record=record,
                        keep_records=False)
        make_runner(runner)
        runner.warmup(warmup_requests(args, info, demo))
        sampler = TelemetrySampler(runner.now, args.telemetry_hz)
        simulation = getattr(engine, "simulation", None)  # a simulated run: no machine to sample

        def started() -> None:
            if simulation is None:
                sampler.start()
            if on_start is not None:
                on_start()

        try:
            records = runner.run(on_start=started)
        finally:
            sampler.stop()
        stream.add_steps(records.steps[written:])
        stream.check_written()
        tables = dict(engine.tables())
        notes = list(engine.notes())
        path = stream.write_requests(_added_columns(tables.get("request_bits")))
        fidelity, rows = _fidelity(args, model, info, runner.requests, path)
        if rows is not None:
            stream.replace_requests(rows)
        requests = parquet_rows(path)  # read from the file a batch at a time by every summary below
        # The peaks of the device the engine ran on: a `--device cpu` run on a GPU host is
        # measured against the CPU, not the GPU NVML sees.
        peaks = (simulation.peaks() if simulation is not None
                 else peaks_for(sampler.gpu_name if info.device.startswith("cuda") else _cpu_name()))
        summary = summarize(requests, records.steps, args.slo, info.model_stats, peaks)
        summary["memory"].update(weight_bytes=info.weight_bytes, kv_cache_bytes=info.kv_cache_bytes,
                                 kv_capacity_tokens=info.kv_capacity_tokens)
        if "skipped" not in fidelity:  # a pure function of requests.parquet, like the rest of the summary
            summary["fidelity"] = fidelity
        if (transitions := transition_summary(requests, records.steps, summary["duration_s"])) is not None:
            summary["transitions"] = transitions
        extra: dict[str, Any] = {}
        if records.status == "complete" and args.capacity is not None:
            extra["capacity"] = _capacity(args, engine, info, demo, workload, runner.requests, records,
                                          _served(path), make_runner, say)
        if records.status == "complete" and args.stability_probes:
            rate = (extra.get("capacity") or {}).get("requests_per_s")
            extra["stability"] = _stability(args, engine, model, info, runner.requests, rate, say)
        status = "interrupted" if (extra.get("capacity") or {}).get("status") == "interrupted" else records.status
        quality = _quality(args, engine, model, info) if status == "complete" else None
    finally:
        engine.stop()
    run = {
        "schema_version": SCHEMA_VERSION,
        "run_id": folder.name,
        "status": status,
        "error": records.error,
        "started_at_unix": records.wall_start,
        "seed": spec.seed,
        "config": {"workload": asdict(spec), "engine": args.engine, "role": engine_role(args.engine), "model": model,
                   "engine_options": args.engine_options, "slo": args.slo, "warmup": args.warmup,
                   "telemetry_hz": args.telemetry_hz,
                   **({"row": args.row, "repeat": args.repeat} if args.row is not None else {})},
        "engine": asdict(info),
        "workload": {"name": workload.name, "arrival": workload.arrival, "requests": len(workload.requests),
                     "concurrency": workload.concurrency, "notes": list(workload.notes),
                     "demo_tasks": demo and spec.name.partition(":")[0] in DEMO_TASK_STYLES},
        "environment": environment(info, peaks, sampler.describe()),
        "telemetry": sampler.describe(),
        "summary": summary,
        "definitions": dict(DEFINITIONS),
        "engine_notes": notes,
        "quality": quality,
        **({"fidelity_skipped": fidelity["skipped"]} if "skipped" in fidelity else {}),
        **({"simulated": simulation.describe()} if simulation is not None else {}),
        **extra,
    }
    stream.finish(run, records.steps, sampler.samples, tables)
    return folder, run


def _cpu_name() -> str:
    from harness.hw import cpu_model  # noqa: PLC0415

    return cpu_model()


def _row_maker(model: str | None) -> Callable[[RequestRecord], dict[str, Any]]:
    """record -> its requests.parquet row (output_text: a task's answer up to the first EOS)."""
    from engines.common.tokenizer import load_tokenizer  # noqa: PLC0415

    tokenizer = load_tokenizer(model) if model else None
    eos = set()
    if tokenizer is not None:
        eos = {tokenizer.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<|im_end|>")
               if tokenizer.token_to_id(t) is not None}

    def row(r: RequestRecord) -> dict[str, Any]:
        # Shallow: asdict() deep-copies every token-time list.
        out = {f.name: getattr(r, f.name) for f in fields(r)}
        out["output_tokens"] = r.output_tokens
        use = tokenizer is not None and r.task is not None
        out["output_text"] = tokenizer.decode(cut_at_eos(r.output_ids, eos)) if use else None
        return out

    return row


def _request_rows(records: RunRecords, model: str | None) -> list[dict[str, Any]]:
    row = _row_maker(model)
    return [row(r) for r in records.requests]


def _served(path: Path) -> int:
    """Requests of requests.parquet that finished without an error."""
    import pyarrow.compute as pc  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    if pq.read_metadata(path).num_rows == 0:
        return 0
    table = pq.read_table(path, columns=["finish_s", "error"])
    return pc.sum(pc.and_(table["finish_s"].is_valid(), table["error"].is_null())).as_py() or 0


def _capacity(args: RunArgs, engine: Engine, info: EngineInfo, demo: bool, workload, requests: list,
              records: RunRecords, served: int, make_runner: Callable[[Runner], None],
              say: Callable[[str], None]) -> dict[str, Any]:
    """The highest rate meeting the SLO (harness/capacity.py) on the same started engine, at most
    n / the TTFT target (n requests a point: beyond that rate they all arrive within one TTFT
    target, and every higher rate is the same burst). Points
    replay the measured requests, or `settings.requests` of the workload drawn under another
    seed (a point judges a percentile: it may need more requests than the run). Unless given,
    the search starts at half the rate the measured run's busy time suggests (requests served /
    seconds of engine steps), at least the workload's own rate: a light offered rate would
    spend minutes on points far below the capacity."""
    from harness.capacity import find_capacity, workload_rate  # noqa: PLC0415

    settings = args.capacity
    if settings.requests is not None and settings.requests != len(requests):
        requests = drawn(args, info, demo, CAPACITY_SEED_OFFSET, settings.requests)
    if settings.max_rate is None and args.slo.get("ttft_ms"):
        # Above n / TTFT target the whole point arrives within one TTFT target: every higher rate
        # is the same burst, so the search stops there (a capacity found there is a lower bound).
        settings = replace(settings, max_rate=len(requests) / (args.slo["ttft_ms"] / 1e3))
    if settings.start_rate is None:
        busy = sum(s["duration_s"] for s in records.steps)
        estimate = served / busy / 2 if busy > 0 and served else None
        start = max(filter(None, (estimate, workload_rate(requests))), default=None)
        settings = replace(settings, start_rate=start)

    def point(p) -> None:
        say(f"capacity: {p.rate:,.2f} req/s, {p.attainment:.0%} within the SLO: {'pass' if p.passed else 'fail'} "
            f"({p.duration_s:.1f} s)")

    found = find_capacity(engine, requests, args.slo, settings, closed_loop=workload.closed_loop,
                          on_point=point, on_runner=make_runner, keep_records=False)
    out = found.to_dict()
    if settings.max_rate is not None:
        out["max_rate"] = settings.max_rate
    if found.status != "complete":
        out.update(status=found.status, error=found.error)
    rate = f"{found.requests_per_s:,.2f} req/s" if found.requests_per_s else "none"
    say(f"capacity: {rate} at the SLO ({found.limit.replace('_', ' ')})")
    return out


def _stability(args: RunArgs, engine: Engine, model: str | None, info: EngineInfo, background: list,
               capacity_rps: float | None, say: Callable[[str], None]) -> dict[str, Any]:
    """Probes answered at three loads (harness/stability.py) against the float32 reference."""
    from harness.capacity import workload_rate  # noqa: PLC0415
    from harness.fidelity import reference_outputs  # noqa: PLC0415
    from harness.stability import measure_stability, probes_for  # noqa: PLC0415

    if model is None:
        return {"skipped": "no local model folder to run the float32 reference on"}
    rate = capacity_rps or workload_rate(background)
    if not rate:
        return {"skipped": "no rate to load the probes at: add --find-capacity or give an open-loop --rate"}
    probes = probes_for(model, info, args.stability_probes, seed=args.workload.seed)
    cache = Path(args.reference_cache) if args.reference_cache else None
    reference = reference_outputs(model, [p.request() for p in probes.probes], cache, info.eos_token_ids)
    result = measure_stability(engine, probes, reference, rate, background, seed=args.workload.seed,
                               on_load=lambda x: say(f"stability: {x.name} ({x.rate:,.2f} req/s): "
                                                     f"{x.probes_varying} probes varying, {x.flips} flips"))
    say(f"stability: {result.finding}")
    return result.to_dict()


def _added_columns(bits: list[dict[str, Any]] | None) -> Callable[[list[dict]], dict[str, list]]:
    """rows -> the columns requests.parquet adds to the streamed rows: for an engine that
    changes bit widths (its `request_bits` table) each request's token-weighted mean and
    minimum expert bits and whether a transition happened during it; then the fidelity
    columns, empty (filled by _fidelity when a reference runs)."""
    from harness.fidelity import COLUMNS  # noqa: PLC0415

    by_id = {b["request_id"]: b for b in bits} if bits is not None else None

    def columns(rows: list[dict]) -> dict[str, list]:
        out: dict[str, list] = {}
        if by_id is not None:
            found = [by_id.get(r["request_id"], {}) for r in rows]
            out.update({name: [b.get(name) for b in found] for name in ("bits_mean", "bits_min", "in_transition")})
        out.update({name: [None] * len(rows) for name in COLUMNS})
        return out

    return columns


def _fidelity(args: RunArgs, model: str | None, info: EngineInfo, sent: list,
              path: Path) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    """The fidelity summary (harness/fidelity.py) and requests.parquet's rows with their
    fidelity columns filled (None when skipped: the columns stay empty). Any engine whose model
    is a local folder the reference can load: in-process engines, and engine openai given
    `--model DIR` (the served model's own folder)."""
    if not args.quality:
        return {"skipped": "--no-quality"}, None
    if model is None or not (Path(model) / "config.json").is_file():  # engine openai: a served model's name
        return {"skipped": "no local model folder to run the float32 reference on (give --model DIR)"}, None
    import pyarrow.parquet as pq  # noqa: PLC0415

    # The float32 reference replays every served request, so these rows fit in memory too.
    rows = pq.read_table(path).to_pylist()
    if not rows:
        return {"skipped": "no request was served"}, None
    return _fidelity_rows(args, model, info, sent, rows), rows


def _fidelity_rows(args: RunArgs, model: str, info: EngineInfo, sent: list,
                   rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-request fidelity columns added to `rows` in place; the summary."""
    from engines.base import EngineError, EngineRequest  # noqa: PLC0415
    from engines.common.tokenizer import load_tokenizer  # noqa: PLC0415
    from harness.fidelity import COLUMNS, fidelity_summary, reference_outputs, request_columns  # noqa: PLC0415

    for row in rows:
        row.update(dict.fromkeys(COLUMNS))
    served = {r["request_id"] for r in rows if not r.get("error") and r.get("finish_s") is not None}
    asked = [EngineRequest(r.request_id, tuple(r.prompt_ids), r.max_new_tokens, ignore_eos=r.ignore_eos)
             for r in sent if r.request_id in served]
    try:
        reference = reference_outputs(model, asked, Path(args.reference_cache) if args.reference_cache else None,
                                      info.eos_token_ids)
    except EngineError as exc:
        return {"skipped": f"the float32 reference could not run: {exc}"}
    tokenizer = load_tokenizer(model)
    for row in rows:
        ref = reference.get(row["request_id"])
        text = tokenizer.decode(ref) if tokenizer is not None and ref is not None and row.get("answer") else None
        row.update(request_columns(row, ref, info.eos_token_ids, text))
    return fidelity_summary(rows) or {"skipped": "no request was served"}


def _quality(args: RunArgs, engine: Engine, model: str | None, info: EngineInfo) -> dict[str, Any] | None:
    cls = type(engine)
    if not args.quality or model is None or not cls.prompt_logits:
        return None
    from harness.quality import measure_quality  # noqa: PLC0415  (imports torch: only when measured)

    if args.repeat is not None and args.repeat > 1:  # the same prompts on the same engine: once is enough
        return {"skipped": "teacher-forced quality is measured on repeat 1 of this row"}
    # The reference is `moe` in float32 on the CPU with default options: an engine that is
    # exactly that (e.g. `--device cpu` given explicitly) would only be compared with itself.
    if (cls.float32_reference and info.dtype == "float32" and info.device == "cpu"
            and not set(args.engine_options) - set(REFERENCE_OPTIONS)):
        return {"skipped": "this engine is the float32 reference itself"}
    reference = create_engine(REFERENCE_ENGINE, {"model": model, **REFERENCE_OPTIONS})
    reference.start()
    try:
        return measure_quality(engine, reference).to_dict()
    finally:
        reference.stop()


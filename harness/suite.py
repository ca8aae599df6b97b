"""The PoC suite: `pwbench run --workload rag_long` with no `--engine` runs every row of
SUITE (harness/suite.toml: row -> engine and options) under one device budget, the same
workload and seed, one result folder each inside a suite folder; the CLI command then writes
the HTML report there (reports import the harness, never the other way round).

Each row runs `repeat` times, interleaved (A B C ... A B C ...) so drift over the session (a
busy machine, thermal state) spreads over every engine; with repeats a row's folders are
`<row>/r1`, `<row>/r2`, ... and each run.json names its row and repeat (config.row, .repeat),
which is how the reports group repeats into one arm with an interval. The float32 reference's
answers (per-request fidelity) are computed once, into `reference/`, and reused by every run.

The default budget for a model is dense weights + BUDGET_SHARE x (full-precision experts + the
KV of KV_TOKENS tokens): below full precision + peak KV, so KV and experts compete. It is
derived from the engine's own sizes (EngineInfo.model_stats), not from the run.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from harness.errors import HarnessError
from harness.results import check_output, new_run_id
from harness.run import RunArgs, execute


def _rows(path: Path) -> Mapping[str, tuple[str, dict[str, Any]]]:
    """suite.toml's tables, in file order: row name -> (engine, options)."""
    tables = tomllib.loads(path.read_text())
    return MappingProxyType({row: (t["engine"], dict(t.get("options", {}))) for row, t in tables.items()})


# Row name -> (engine, options). Engine names live in data (like a sweep grid's), not in code:
# the harness never names engines (tests/unit/test_layout.py).
SUITE = _rows(Path(__file__).with_name("suite.toml"))
BUDGET_SHARE = 0.4
KV_TOKENS = 3000  # ~4 of rag_long's demo prompts (~690 tokens) with their answers
# Demo-model traffic for the suite, applied only to options the user did not give: few
# requests (the suite must end in minutes on 2 cores), bursty arrivals so KV demand ebbs and
# flows, and half direct closed-book questions, where expert precision shows in accuracy.
SUITE_DEMO_DEFAULTS = {"requests": 20, "rate": 0.5, "arrival": "gamma", "burstiness": 4.0, "direct_share": 0.5}
DEMO_REPEATS = 3  # the demo suite's repeats (--repeat): enough for a 95% interval; else 1


@dataclass(frozen=True)
class SuiteResult:
    folder: Path
    runs: dict[str, Path]  # "<row>" or "<row>/r<k>" -> result folder
    failed: dict[str, str]  # row -> why it did not run
    budget_bytes: int


def default_budget(model: str | None, options: dict[str, Any]) -> int:
    """dense + BUDGET_SHARE x (experts + KV_TOKENS of KV), from the model's sizes in `moe`."""
    from engines.registry import create_engine  # noqa: PLC0415

    engine = create_engine("moe", {"model": model, **{k: v for k, v in options.items() if k in ("device", "dtype")}})
    engine.start()
    try:
        info = engine.info()
    finally:
        engine.stop()
    stats = info.model_stats
    dense = int(stats["dense_weight_bytes"])
    experts = info.weight_bytes - dense
    return int(dense + BUDGET_SHARE * (experts + KV_TOKENS * int(stats["kv_bytes_per_token"])))


def run_suite(args: RunArgs, is_demo: bool, on_run: Callable[[str, RunArgs], dict] | None = None,
              say: Callable[[str], None] = print, repeat: int | None = None) -> SuiteResult:
    """Run every SUITE row `repeat` times (default: DEMO_REPEATS on the demo model, else 1),
    interleaved, with `args` (engine replaced); the caller writes the report."""
    from engines.common.demo import demo_model_path  # noqa: PLC0415

    model = args.model or str(demo_model_path())
    folder = Path(args.output) if args.output else Path(args.results_dir) / new_run_id(args.workload.name, "suite")
    check_output(folder)
    spec = args.workload
    if is_demo:
        applied = {k: v for k, v in SUITE_DEMO_DEFAULTS.items() if k not in args.given}
        spec = replace(spec, **applied)
        if applied:
            say("suite: demo defaults " + ", ".join(f"{k}={v}" for k, v in applied.items()))
    from engines.common.sizes import parse_size  # noqa: PLC0415

    given = args.engine_options.get("budget_bytes")
    budget = parse_size(given, "--budget") if given is not None else default_budget(model, args.engine_options)
    repeat = repeat or (DEMO_REPEATS if is_demo else 1)
    if repeat < 1:
        raise HarnessError(f"--repeat must be >= 1, got {repeat}")
    say(f"suite: {len(SUITE)} engines x {repeat} repeat{'s' * (repeat > 1)}, interleaved, under a device budget of "
        f"{_bytes(budget)} -> {folder}")
    runs: dict[str, Path] = {}
    failed: dict[str, str] = {}
    for k in range(1, repeat + 1):
        for row, (engine, options) in SUITE.items():
            if row in failed:
                continue  # what could not run once will not run on the next repeat either
            name = f"{row}/r{k}" if repeat > 1 else row
            one = replace(args, workload=spec, engine=engine, model=model, output=str(folder / name),
                          engine_options={**args.engine_options, **options, "budget_bytes": budget},
                          reference_cache=str(folder / "reference"), row=row, repeat=k,
                          stability_probes=args.stability_probes if k == 1 else None)  # probes: once a row
            say(f"suite: {name} ({engine}{''.join(f' {k2}={v}' for k2, v in options.items())})")
            try:
                out, run = on_run(name, one) if on_run else execute(one)
            except Exception as exc:  # noqa: BLE001  (one engine that cannot run does not stop the suite)
                failed[row] = f"{type(exc).__name__}: {exc}"
                say(f"suite: {name} did not run: {failed[row]}")
                continue
            if run["status"] == "complete":
                runs[name] = Path(out)
            else:
                failed[row] = f"status {run['status']}: {run.get('error')}"
    return SuiteResult(folder, runs, failed, int(budget))


def _bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MiB ({n:,} B)"

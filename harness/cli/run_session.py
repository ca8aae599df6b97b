"""The body of `pwbench run`: options -> RunArgs, progress bar, Ctrl-C, exit code.

First Ctrl-C: stop admitting and stepping, save everything measured, mark the run
`interrupted`, exit 130. Second Ctrl-C: exit at once.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import typer

from engines.registry import parse_set_options
from harness.errors import HarnessError
from harness.metrics import DEFAULT_SLO
from harness.run import RunArgs, execute
from harness.runner import Runner, RunRecords
from reports.summary_table import print_summary
from workloads.base import WorkloadError
from workloads.registry import WorkloadSpec, parse_length_range


def parse_slo(text: str | None) -> dict[str, float]:
    if text is None:
        return dict(DEFAULT_SLO)
    slo: dict[str, float] = {}
    for key, value in parse_set_options([p for p in text.split(",") if p.strip()]).items():
        if key not in ("ttft_ms", "tpot_ms", "e2e_ms"):
            raise HarnessError(f"--slo: unknown target {key!r}; valid: ttft_ms, tpot_ms, e2e_ms")
        try:
            slo[key] = float(value)
        except ValueError:
            raise HarnessError(f"--slo {key} expects a number of milliseconds, got {value!r}") from None
    return slo or dict(DEFAULT_SLO)


def _lengths(text: str | None, what: str) -> dict[str, Any]:
    if text is None:
        return {}
    if "-" in text:
        try:
            return {f"{what}_range": parse_length_range(text)}
        except WorkloadError as exc:
            raise HarnessError(f"--{what}-len: {exc}") from None
    try:
        return {f"{what}_tokens": int(text)}
    except ValueError:
        raise HarnessError(f"--{what}-len expects N or A-B, got {text!r}") from None


def to_run_args(o: dict[str, Any]) -> RunArgs:
    spec_options = dict(
        seed=o["seed"], requests=o["requests"], duration_s=o["duration"], rate=o["rate"],
        concurrency=o["concurrency"], time_scale=o["time_scale"], arrival=o["arrival"],
        burstiness=o["burstiness"], context=o["context"], direct_share=o.get("direct_share"),
        trace_format=o["trace_format"],
        **_lengths(o["input_len"], "input"), **_lengths(o["output_len"], "output"),
    )
    spec_options["scale"] = o["scale"]
    spec_options["trace_map"] = o.get("trace_map")
    spec_options["skip_bad_lines"] = o.get("skip_bad_lines") or None  # False is the default: leave it out
    spec_options["session_reuse"] = o.get("session_reuse")
    spec_options["turns"] = o.get("turns")
    spec_options = {k: v for k, v in spec_options.items() if v is not None}
    spec = WorkloadSpec(o["workload"], **spec_options)  # validates before the engine loads
    engine_options = {"device": o["device"], "dtype": o["dtype"], "budget_bytes": o.get("budget"),
                      "simulate": o.get("simulate"), "routing": o.get("routing"),
                      **parse_set_options(o["set_"] or [])}
    if o.get("routing") and not o.get("simulate"):
        raise typer.BadParameter("--routing chooses a simulated run's expert choices; add --simulate HARDWARE")
    return RunArgs(
        workload=spec, given=frozenset(spec_options), engine=o["engine"], model=o["model"],
        engine_options={k: v for k, v in engine_options.items() if v is not None},
        output=o["output"], slo=parse_slo(o["slo"]), warmup=o["warmup"], telemetry_hz=o["telemetry_hz"],
        # Quality is not simulated: a simulated run has no logits (docs/simulation.md).
        quality=o["quality"] and not o.get("simulate"), capacity=_capacity_settings(o),
        stability_probes=o.get("stability_probes") if o.get("stability") else None,
    )


def _capacity_settings(o: dict[str, Any]):
    from harness.capacity import CapacitySettings

    if not o.get("find_capacity"):
        return None
    settings = CapacitySettings(attainment=o.get("attainment", 0.99))
    settings.check()
    return settings


class _Progress:
    """Progress on stderr, fed from the runner's step callback (throttled to 10 Hz).

    On a terminal: a rich progress bar. Otherwise (a log, CI, a pipe) plain lines, which a
    live bar cannot give there: `run: measuring N requests ...` once warm-up is done and the
    clock starts, then `run: D/N requests done, X out tok/s, T s` each time another tenth of
    the requests has finished or PLAIN_PERIOD_S has passed since the last line.
    """

    PLAIN_PERIOD_S = 10.0

    def __init__(self, quiet: bool, plain: bool | None = None) -> None:
        self.quiet, self.bar, self.task, self.last, self.runner = quiet, None, None, 0.0, None
        self.plain = (not sys.stderr.isatty()) if plain is None else plain
        self.next_mark, self.last_line = 0, 0.0
        self.seen_steps, self.tokens = 0, 0  # the attached runner's steps summed so far

    def start(self) -> None:
        if self.quiet or not self.plain or self.runner is None:
            return
        total = len(self.runner.requests)
        self.next_mark, self.last_line = max(1, -(-total // 10)), 0.0
        typer.echo(f"run: measuring {total} requests (Ctrl-C stops and saves what was measured)", err=True)

    def attach(self, runner: Runner) -> None:
        """The runner Ctrl-C stops: the measured run's, then each capacity point's (one bar)."""
        self.runner = runner
        self.seen_steps, self.tokens = 0, 0
        if self.quiet or self.plain or self.bar is not None:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("[bold]run"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[tps]}"),
                            TimeElapsedColumn(), transient=True)
        self.task = self.bar.add_task("run", total=len(runner.requests), tps="")
        self.bar.start()

    def update(self, records: RunRecords) -> None:
        now = time.perf_counter()
        if self.quiet or (self.bar is None and not self.plain) or now - self.last < 0.1:
            return
        self.last = now
        elapsed = max(self.runner.now(), 1e-9)
        # Only the steps since the last update: a long run has ~100k of them.
        self.tokens += sum(records.steps[i]["decode_tokens"] for i in range(self.seen_steps, len(records.steps)))
        self.seen_steps = len(records.steps)
        tokens = self.tokens
        done = self.runner.completed()
        if self.bar is not None:
            self.bar.update(self.task, completed=done, tps=f"{tokens / elapsed:,.0f} out tok/s")
            return
        if done >= self.next_mark or elapsed - self.last_line >= self.PLAIN_PERIOD_S:
            total = len(self.runner.requests)
            step = max(1, -(-total // 10))
            self.next_mark = (done // step + 1) * step
            self.last_line = elapsed
            typer.echo(f"run: {done}/{total} requests done, {tokens / elapsed:,.0f} out tok/s, {elapsed:,.1f} s",
                       err=True)

    def say(self, line: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.console.print(line, markup=False, highlight=False)
        else:
            typer.echo(line, err=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def run_command(options: dict[str, Any]) -> int:
    if (options.get("repeat") or 1) > 1:
        raise HarnessError("--repeat runs the suite's engines several times (pwbench run --workload rag_long with "
                           "no --engine); for one engine, run it again into another --output and compare the folders")
    args = to_run_args(options)
    progress = _Progress(options["quiet"] or options["as_json"])
    state: dict[str, Any] = {"interrupts": 0}

    def on_sigint(signum: int, frame: Any) -> None:
        state["interrupts"] += 1
        if state["interrupts"] > 1 or progress.runner is None:
            raise KeyboardInterrupt
        typer.echo("stopping: saving what was measured (Ctrl-C again to quit at once)", err=True)
        progress.runner.stop()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        folder, run = execute(args, make_runner=progress.attach, on_step=progress.update, on_start=progress.start,
                              say=progress.say)
    finally:
        progress.close()
        signal.signal(signal.SIGINT, previous)
    if options["as_json"]:
        typer.echo(json.dumps({"run_dir": str(folder), "status": run["status"], **run["summary"]}))
    else:
        print_summary(run, Path(folder))
    if run["status"] == "failed":
        typer.echo(f"error: the run failed: {run['error']}", err=True)
        return 1
    return 130 if run["status"] == "interrupted" else 0


def suite_command(options: dict[str, Any]) -> int:
    """The PoC suite (harness/suite.py): each engine's run with the plain progress lines, then
    the report's path and the executive table."""
    from engines.common.demo import bundled_name
    from harness.suite import run_suite
    from reports.compare import print_comparison
    from reports.html import write_report
    from reports.roi import Prices
    from reports.runs import load_runs

    args = to_run_args({**options, "engine": "moe"})

    def one(row: str, run_args: RunArgs):
        progress = _Progress(options["quiet"], plain=True)
        return execute(run_args, make_runner=progress.attach, on_step=progress.update, on_start=progress.start,
                       say=progress.say)

    result = run_suite(args, demo=bundled_name(options["model"]), on_run=one,
                       say=lambda line: typer.echo(line, err=True), repeat=options.get("repeat"),
                       slo_given=options["slo"] is not None)
    report = None
    if result.runs:
        runs = load_runs(list(result.runs.values()))
        report = write_report(runs, Prices(), result.folder / "report.html")
        print_comparison(runs, Prices(), compact=True)
    for row, why in result.failed.items():
        typer.echo(f"suite: {row} did not run: {why}", err=True)
    if report is not None:
        typer.echo(f"report: {report}")
    typer.echo(f"results: {result.folder}")
    return 0 if result.runs and not result.failed else 1

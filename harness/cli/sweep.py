"""`pwbench sweep`: engines x budgets x rates (x repeats), one result folder per cell, run by an
executor (serial, local, ray), resumable with the same settings (sweep.json), then the report
(harness/sweep.py, docs/sweeps.md)."""

from __future__ import annotations

from typing import Annotated

import typer

from harness.cli.apps import app
from harness.cli.common import user_errors


def _list(text: str | None) -> list[str] | None:
    return [p.strip() for p in text.split(",") if p.strip()] if text else None


@app.command("sweep")
@user_errors
def sweep(
    output: Annotated[str, typer.Option(help="Sweep folder; rerun with the same folder to resume.")],
    config: Annotated[str | None,
                      typer.Option(help="TOML grid: workload, engines, budgets, rates, requests, seed, [set].")] = None,
    workload: Annotated[str | None, typer.Option(help="Workload (default rag_long).")] = None,
    engines: Annotated[str | None, typer.Option(help="Comma-separated engines, e.g. moe,pagedweight.")] = None,
    budgets: Annotated[str | None, typer.Option(help="Comma-separated device budgets, e.g. 2MiB,3MiB.")] = None,
    rates: Annotated[str | None, typer.Option(help="Comma-separated request rates (req/s).")] = None,
    requests: Annotated[int | None, typer.Option(help="Requests per point.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for every point.")] = None,
    model: Annotated[str | None,
                     typer.Option(help="Model folder, or bundled/preset name (default: the demo model).")] = None,
    simulate: Annotated[str | None,
                        typer.Option(help="Simulate every point on this hardware profile (`pwbench hw list`) or "
                                          "TOML file instead of measuring (docs/simulation.md).")] = None,
    routing: Annotated[str | None, typer.Option(help="--simulate: expert routing (see `pwbench run --help`).")] = None,
    repeats: Annotated[int | None, typer.Option(help="Run every point this many times, interleaved.")] = None,
    executor: Annotated[str, typer.Option(help="serial (here, one at a time) | local (worker processes: one per GPU, "
                                               "else the cores) | ray (a Ray cluster; pip install -e '.[ray]').")
                        ] = "serial",
    workers: Annotated[int | None, typer.Option(help="--executor local: worker processes (default: one per GPU, "
                                                     "else one per core; never more).")] = None,
    measured_parallel: Annotated[int, typer.Option(help="Measured CPU cells allowed at once on one machine (default 1: "
                                                        "each alone). Simulated cells always run as wide as allowed.")
                                 ] = 1,
    ray_address: Annotated[str | None, typer.Option(help="--executor ray: auto | host:port (the head's GCS) | "
                                                         "ray://host:10001 (Ray Client); default: start a local "
                                                         "cluster.")] = None,
    ray_results: Annotated[str, typer.Option(help="--executor ray: shared (cells write into --output, a path every "
                                                  "node sees) | driver (cells send their folder back here).")
                           ] = "shared",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print each cell's `pwbench run` command and where it "
                                                            "would run; run nothing.")] = False,
    quality: Annotated[bool, typer.Option(help="Measure KL / top-1 agreement at each point.")] = True,
    force: Annotated[bool,
                     typer.Option("--force",
                                  help="When --output holds a sweep of other settings, start a new sweep in "
                                       "<output>-2 (-3, ...) instead of refusing.")] = False,
) -> None:
    """Run a grid of cells (skipping those already complete), then write the report. Rerun with the
    same settings to resume: complete cells are skipped, failed or interrupted ones run again;
    other settings are refused (see --force). Exit 1 when a cell failed."""
    from pathlib import Path

    from harness.sweep import dry_run as plan_lines
    from harness.sweep import load_grid, open_sweep, run_sweep
    from harness.sweep_exec import make_executor

    if routing and not simulate:
        raise typer.BadParameter("--routing chooses a simulated run's expert choices; add --simulate HARDWARE")
    if workers is not None and executor != "local":
        raise typer.BadParameter("--workers sizes --executor local's pool; add --executor local")
    if (ray_address is not None or ray_results != "shared") and executor != "ray":
        raise typer.BadParameter("--ray-address and --ray-results are for --executor ray")
    extra = {k: v for k, v in (("simulate", simulate), ("routing", routing)) if v}
    grid = load_grid(config, workload=workload, engines=_list(engines), budgets=_list(budgets), rates=_list(rates),
                     requests=requests, seed=seed, model=model, repeats=repeats, options=extra)
    runner = make_executor(executor, workers, measured_parallel, ray_address, ray_results)
    if dry_run:
        for line in plan_lines(grid, Path(output), quality, runner):
            typer.echo(line)
        return

    def say(line: str) -> None:
        typer.echo(line, err=True)

    from reports.html import write_report
    from reports.roi import Prices
    from reports.runs import load_runs

    folder = open_sweep(grid, Path(output), quality, force, say)
    result = run_sweep(grid, folder, quality, say, runner)
    typer.echo(f"sweep: {len(result.ran)} points run, {len(result.skipped)} already complete"
               + (f" ({', '.join(result.skipped)})" if result.skipped else "")
               + (f", {len(result.failed)} failed ({', '.join(result.failed)})" if result.failed else ""))
    if result.ran or result.skipped:
        report = write_report(load_runs([folder]), Prices(), folder / "report.html")
        typer.echo(f"report: {report}")
    if result.failed:
        typer.echo(f"sweep: {len(result.failed)} cells failed (sweep.json has each error); rerun the same command "
                   "to run them again", err=True)
        raise typer.Exit(1)

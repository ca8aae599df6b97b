"""`pwbench sweep`: engines x budgets x rates, one result folder per point, resumable with the
same settings (sweep.json), then the report (harness/sweep.py)."""

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
    quality: Annotated[bool, typer.Option(help="Measure KL / top-1 agreement at each point.")] = True,
    force: Annotated[bool,
                     typer.Option("--force",
                                  help="When --output holds a sweep of other settings, start a new sweep in "
                                       "<output>-2 (-3, ...) instead of refusing.")] = False,
) -> None:
    """Run a grid of points (skipping those already complete), then write the report. Rerun with the
    same settings to resume; other settings are refused (see --force)."""
    from pathlib import Path

    from harness.sweep import load_grid, open_sweep, run_sweep
    from reports.html import write_report
    from reports.roi import Prices
    from reports.runs import load_runs

    if routing and not simulate:
        raise typer.BadParameter("--routing chooses a simulated run's expert choices; add --simulate HARDWARE")
    extra = {k: v for k, v in (("simulate", simulate), ("routing", routing)) if v}
    grid = load_grid(config, workload=workload, engines=_list(engines), budgets=_list(budgets), rates=_list(rates),
                     requests=requests, seed=seed, model=model, options=extra)

    def say(line: str) -> None:
        typer.echo(line, err=True)

    folder = open_sweep(grid, Path(output), quality, force, say)
    ran, skipped = run_sweep(grid, folder, quality, say)
    typer.echo(f"sweep: {len(ran)} points run, {len(skipped)} already complete"
               + (f" ({', '.join(skipped)})" if skipped else ""))
    report = write_report(load_runs([folder]), Prices(), folder / "report.html")
    typer.echo(f"report: {report}")

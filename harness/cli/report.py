"""`pwbench report` (the HTML ROI report) and `pwbench compare` (the same numbers as a terminal
table or Markdown). Both read result folders only (reports/), never an engine."""

from __future__ import annotations

from typing import Annotated

import typer

from harness.cli.apps import app
from harness.cli.common import user_errors

PATHS_HELP = "Result folders, or suite/sweep folders holding them."


def _prices(gpu_hour_usd: float, target_rps: float, utilisation: float):
    from harness.errors import HarnessError
    from reports.roi import Prices

    if gpu_hour_usd < 0 or target_rps <= 0 or not 0 < utilisation <= 1:
        raise HarnessError("--gpu-hour-usd must be >= 0, --target-rps > 0 and --utilisation in (0, 1]")
    return Prices(gpu_hour_usd, target_rps, utilisation)


@app.command("report")
@user_errors
def report(
    paths: Annotated[list[str], typer.Argument(help=PATHS_HELP)],
    output: Annotated[str | None, typer.Option(help="HTML file (default: report.html in the first folder).")] = None,
    gpu_hour_usd: Annotated[float, typer.Option(help="Price of one device-hour, USD.")] = 4.0,
    target_rps: Annotated[float, typer.Option(help="Target load, requests/s, for the device count.")] = 10.0,
    utilisation: Annotated[float, typer.Option(help="Share of a device's goodput planned for (0-1].")] = 0.7,
) -> None:
    """Write one self-contained HTML report (executive ROI page + engineering detail)."""
    from pathlib import Path

    from reports.html import write_report
    from reports.runs import load_runs

    runs = load_runs(paths)
    target = Path(output) if output else Path(paths[0]) / "report.html"
    write_report(runs, _prices(gpu_hour_usd, target_rps, utilisation), target)
    typer.echo(f"report: {target}")


@app.command("compare")
@user_errors
def compare(
    paths: Annotated[list[str], typer.Argument(help=PATHS_HELP)],
    markdown: Annotated[bool,
                        typer.Option("--markdown",
                                     help="Print a Markdown table (for a pull-request comment).")] = False,
    gpu_hour_usd: Annotated[float, typer.Option(help="Price of one device-hour, USD.")] = 4.0,
    target_rps: Annotated[float, typer.Option(help="Target load, requests/s, for the device count.")] = 10.0,
    utilisation: Annotated[float, typer.Option(help="Share of a device's goodput planned for (0-1].")] = 0.7,
) -> None:
    """Compare runs side by side: goodput, cost, devices, accuracy, memory, bytes moved."""
    from reports.compare import print_comparison
    from reports.runs import load_runs

    print_comparison(load_runs(paths), _prices(gpu_hour_usd, target_rps, utilisation), markdown)

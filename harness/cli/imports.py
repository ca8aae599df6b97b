"""`pwbench import vllm|guidellm FILE`: another tool's benchmark result -> a pwbench result folder."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from harness.cli.common import user_errors

import_app = typer.Typer(help="Read other tools' benchmark results into pwbench result folders.", no_args_is_help=True)


@import_app.command("vllm")
@user_errors
def import_vllm_cmd(
    file: Annotated[str, typer.Argument(help="JSON written by `vllm bench serve --save-result --save-detailed`.")],
    output: Annotated[str | None, typer.Option(help="Result folder (default: results/<run_id>).")] = None,
    slo: Annotated[str,
                   typer.Option(help="Latency targets for goodput, e.g. "
                                     "ttft_ms=2000,tpot_ms=200.")] = "ttft_ms=2000,tpot_ms=200",
    as_json: Annotated[bool,
                       typer.Option("--json", help="Print the summary as one JSON object as the last line.")] = False,
) -> None:
    """Import a vllm bench serve result (per-request details) into a pwbench result folder."""
    from harness.cli.run_session import parse_slo
    from harness.importers import import_vllm

    _show(*import_vllm(file, output, slo=parse_slo(slo)), as_json)


@import_app.command("guidellm")
@user_errors
def import_guidellm_cmd(
    file: Annotated[str, typer.Argument(help="JSON report written by `guidellm benchmark --output-path`.")],
    output: Annotated[str | None, typer.Option(help="Result folder (default: results/<run_id>).")] = None,
    index: Annotated[int | None,
                     typer.Option(help="Which benchmark of a sweep (0-based; needed when there are several).")] = None,
    slo: Annotated[str,
                   typer.Option(help="Latency targets for goodput, e.g. "
                                     "ttft_ms=2000,tpot_ms=200.")] = "ttft_ms=2000,tpot_ms=200",
    as_json: Annotated[bool,
                       typer.Option("--json", help="Print the summary as one JSON object as the last line.")] = False,
) -> None:
    """Import one benchmark of a GuideLLM report into a pwbench result folder."""
    from harness.cli.run_session import parse_slo
    from harness.importers import import_guidellm

    _show(*import_guidellm(file, output, slo=parse_slo(slo), index=index), as_json)


def _show(folder: Any, run: dict[str, Any], as_json: bool) -> None:
    from pathlib import Path

    from reports.summary_table import print_summary

    if as_json:
        typer.echo(json.dumps({"run_dir": str(folder), **run["summary"]}))
    else:
        print_summary(run, Path(folder))

"""The typer apps the command modules register on (kept apart so modules import no cycle)."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="pwbench",
    help="Benchmark MoE serving techniques on your own traffic: run workloads against engines, "
    "compare results, gate regressions.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
ls_app = typer.Typer(help="List what pwbench knows about: engines, workloads.", no_args_is_help=True)
demo_app = typer.Typer(help="The bundled demo MoE model: train it, evaluate it.", no_args_is_help=True)

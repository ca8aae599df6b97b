"""The `pwbench` command line: one module per command group, each command a thin call into a
library function.

Commands import their heavy dependencies inside the function body, so `pwbench --help` and
`pwbench ls engines` never import torch. A user error (EngineError and friends) becomes one
line on stderr and exit code 2; Ctrl-C exits with 130.
"""

from __future__ import annotations

# isort: off
# Each module registers its commands on import, in the order `pwbench --help` lists them.
from harness.cli import run, report, gate, sweep, generate, serve, evals, hw, plan, ls, demo  # noqa: F401
# isort: on
from harness.cli.apps import app, demo_app, ls_app
from harness.cli.imports import import_app
from harness.cli.quantize import quantize
from harness.cli.trace import trace_app

app.add_typer(ls_app, name="ls")
app.add_typer(trace_app, name="trace")
app.add_typer(demo_app, name="demo")
app.add_typer(import_app, name="import")
app.command("quantize")(quantize)


def main() -> None:
    app()

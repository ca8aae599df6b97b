"""`pwbench ls engines|workloads`: what pwbench knows about (imports no engine module)."""

from __future__ import annotations

from harness.cli.apps import ls_app
from harness.cli.common import print_columns


@ls_app.command("engines")
def ls_engines() -> None:
    """List the registered engines, one per line."""
    from engines.registry import list_engines

    print_columns(list_engines())


@ls_app.command("workloads")
def ls_workloads() -> None:
    """List the named workloads, one per line."""
    from workloads.registry import list_workloads

    print_columns(list_workloads())

"""Shared pieces of the pwbench commands: one-line user errors and plain column output."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import typer

from engines.base import EngineError
from engines.common.folders import engine_for_folder
from harness.errors import HarnessError
from workloads.base import WorkloadError

# Errors a user can fix: shown as one `error:` line with exit code 2, never a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (EngineError, WorkloadError, HarnessError)


BUDGET_HELP = ("Device memory for dense weights + expert weights + KV blocks together, e.g. 6MiB, 40GB "
               "(engines moe, static-*, offload, moegen; default: no bound).")


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn user errors into a one-line message instead of a traceback; Ctrl-C exits 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
            raise fail(str(exc)) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


def print_columns(rows: list[tuple[str, str]]) -> None:
    """Two aligned columns: a name and its text."""
    width = max(len(name) for name, _ in rows)
    for name, text in rows:
        typer.echo(f"{name.ljust(width)}  {text}")


def engine_for(engine: str | None, model: str | None) -> str:
    """The engine named, else the one that serves the folder (static-<method> for a quantized
    folder, said in one line on stderr)."""
    if engine is not None:
        return engine
    name, note = engine_for_folder(model)
    if note:
        typer.echo(f"note: {note}", err=True)
    return name

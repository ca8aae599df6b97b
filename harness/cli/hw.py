"""`pwbench hw`: measure this machine's bandwidths and FLOP/s and cache them for efficiency metrics."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from harness.cli.apps import app
from harness.cli.common import user_errors


@app.command("hw")
@user_errors
def hw(
    device: Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N (default: cuda if present).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line.")] = False,
) -> None:
    """Measure this machine's memory bandwidth, matmul FLOP/s and host<->device bandwidth; cache them."""
    from engines.common.device import resolve_device
    from harness.hw import datasheet_for, measure, save_cached

    dev = str(resolve_device(device))
    result = measure(dev)
    save_cached(result)
    sheet = datasheet_for(result.get("device_name"))
    if as_json:
        typer.echo(json.dumps({"measured": result, "datasheet": sheet[1] if sheet else None}))
        return
    typer.echo(f"{result['device_name']} ({dev})")
    for key, value in result.items():
        if key.endswith("_per_s"):
            ref = sheet[1].get(key) if sheet else None
            note = f"   datasheet {ref / 1e9:,.0f} G" if ref else ""
            typer.echo(f"  {key:38s} {value / 1e9:12,.1f} G{note}")

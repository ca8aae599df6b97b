"""`pwbench hw`: measure this machine's bandwidths and FLOP/s and cache them for efficiency metrics;
`pwbench hw list` / `pwbench hw show NAME_OR_TOML`: the hardware profiles `--simulate` runs on."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from harness.cli.apps import app
from harness.cli.common import fail, user_errors

hw_app = typer.Typer(
    help="Measure this machine's memory bandwidth, matmul FLOP/s and host<->device bandwidth; cache them. "
    "`hw list` / `hw show NAME` print the hardware profiles --simulate uses.",
    invoke_without_command=True,
    no_args_is_help=False,
)


@hw_app.callback()
@user_errors
def hw(
    ctx: typer.Context,
    device: Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N (default: cuda if present).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line.")] = False,
) -> None:
    """Measure this machine's memory bandwidth, matmul FLOP/s and host<->device bandwidth; cache them."""
    if ctx.invoked_subcommand is not None:
        return
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


def _row(p: Any) -> dict[str, Any]:
    return {"name": p.name, "memory_gb": p.memory_bytes / 1e9, "memory_tb_per_s": p.memory_bytes_per_s / 1e12,
            "tflops": p.flops() / 1e12, "dtype": p.default_dtype, "link_gb_per_s": p.link_pinned_bytes_per_s / 1e9,
            "description": p.description}


@hw_app.command("list")
@user_errors
def hw_list(as_json: Annotated[bool, typer.Option("--json", help="Print one JSON list as the last line.")] = False
            ) -> None:
    """The hardware profiles --simulate knows (engines/sim/profiles; `cpu` is this machine)."""
    from engines.sim.hardware import list_profiles

    try:
        rows = [_row(p) for p in list_profiles()]
    except ValueError as exc:
        raise fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(rows))
        return
    typer.echo(f"{'name':14s} {'memory GB':>9s} {'HBM TB/s':>8s} {'TFLOP/s':>8s} {'link GB/s':>9s}  description")
    for r in rows:
        flops = f"{r['tflops']:,.1f}" if r["tflops"] >= 1 else f"{r['tflops']:.3f}"
        typer.echo(f"{r['name']:14s} {r['memory_gb']:9,.0f} {r['memory_tb_per_s']:8.3g} {flops:>8s} "
                   f"{r['link_gb_per_s']:9.1f}  {r['description']} ({r['dtype']})")
    typer.echo("TFLOP/s: dense, at the profile's default dtype; link: pinned host->device. "
               "`pwbench hw show NAME` gives every number and its source.")


@hw_app.command("show")
@user_errors
def hw_show(
    profile: Annotated[str, typer.Argument(help="A profile name (`pwbench hw list`) or a TOML file.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line.")] = False,
) -> None:
    """One hardware profile: every number, every efficiency curve, and where each comes from."""
    from engines.sim.hardware import load_profile

    try:
        p = load_profile(profile)
    except ValueError as exc:
        raise fail(str(exc)) from None
    scalars = ("memory_bytes", "memory_bytes_per_s", "link_bytes_per_s", "link_pinned_bytes_per_s",
               "host_memory_bytes", "host_memory_bytes_per_s", "host_flops_per_s", "step_overhead_s", "op_overhead_s")
    if as_json:
        out = {"name": p.name, "description": p.description, "default_dtype": p.default_dtype, "origin": p.origin,
               **{k: getattr(p, k) for k in scalars}, "flops_per_s": p.flops_per_s,
               "efficiency": {k: {"points": [list(x) for x in c.points], "basis": c.basis, "source": c.source}
                              for k, c in p.efficiency.items()},
               "sources": p.sources}
        typer.echo(json.dumps(out))
        return
    typer.echo(f"{p.name}: {p.description} (default dtype {p.default_dtype}; from {p.origin})")
    for key in scalars:
        typer.echo(f"  {key:26s} {getattr(p, key):<12.4g} {p.sources.get(key, '')}")
    for dtype, value in p.flops_per_s.items():
        src = p.sources.get(f"flops_per_s.{dtype}") or p.sources.get("flops_per_s", "")
        typer.echo(f"  {'flops_per_s.' + dtype:26s} {value:<12.4g} {src}")
    for key, curve in p.efficiency.items():
        pts = ", ".join(f"{s:g}:{e:.3g}" for s, e in curve.points)
        typer.echo(f"  efficiency.{key} (of {curve.basis}): {pts}")
        typer.echo(f"      {curve.source}")


app.add_typer(hw_app, name="hw")

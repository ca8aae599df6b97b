"""`pwbench plan`: the cost model's plan for a plannable engine (moegen) on a model and a budget, and its prediction.

Reads only the folder's config.json (no weights), so a laptop can plan a large model for a
GPU it does not have (`--gpu H200` takes that GPU's datasheet peaks).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from engines.common.demo import resolve_model
from harness.cli.apps import app
from harness.cli.common import BUDGET_HELP, user_errors
from harness.errors import HarnessError

PLACEMENT_WORDS = {"device": "on device", "host": "on host", "stream": "streamed to the device",
                   "split": "split host/streamed"}


@app.command("plan")
@user_errors
def plan(
    budget: Annotated[str, typer.Option(help=BUDGET_HELP)],
    engine: Annotated[str, typer.Option(help="Engine to plan for: moegen.")] = "moegen",
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Model folder (default: the bundled demo model).")] = None,
    seqs: Annotated[int | None, typer.Option(
        help="Sequences in flight the plan may batch (engine option max_num_seqs).")] = None,
    context: Annotated[int | None, typer.Option(
        help="Mean tokens per sequence while decoding (plan_context).")] = None,
    link_gbps: Annotated[float | None, typer.Option(
        help="Host->device link in GB/s (default on CPU: none modelled; on a GPU: measured or datasheet).")] = None,
    gpu: Annotated[str | None, typer.Option(
        help="Plan for this GPU's datasheet peaks (H200, H100, A100, L4, A10G, RTX 6000 Ada) instead of this machine.",
    )] = None,
    dtype: Annotated[str | None, typer.Option(
        help="float32 | bfloat16 | float16 (default: float32 on this CPU, bf16 with --gpu).")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="The engine's option key=value (kv_placement, expert_slots, ...); repeatable.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line.")] = False,
) -> None:
    """Print the plan (KV placement, batch, micro-batch, expert ring and residents) and its predicted decode step."""
    model = resolve_model(model)  # a bundled model's name (demo, demo-fine) -> its folder
    from engines.common.demo import demo_model_path
    from engines.common.peaks import cpu_model
    from engines.common.sizes import format_size, parse_size
    from engines.moegen.cost import Workload, candidate_plans
    from engines.moegen.hardware import hardware
    from engines.moegen.plan import make_plan, seq_blocks
    from engines.registry import build_config, engine_class, list_engines, parse_set_options
    from engines.runtime.checkpoint import read_json
    from engines.runtime.config import parse_config
    from engines.runtime.shape import model_shape
    from harness.hw import datasheet_for, peaks_for

    cls = engine_class(engine)
    if not cls.plannable:
        plannable = [name for name, _ in list_engines() if engine_class(name).plannable]
        raise HarnessError(f"--engine {engine!r} has no plan; plannable engines: {', '.join(plannable)}")
    options = {"budget_bytes": parse_size(budget, "--budget"), **parse_set_options(set_ or [])}
    if seqs is not None:
        options["max_num_seqs"] = seqs
    if context is not None:
        options["plan_context"] = context
    cfg = build_config(cls.config_cls, options, owner=f"engine {engine!r}")
    config_path = Path(model or demo_model_path()).expanduser() / "config.json"
    if not config_path.is_file():
        raise HarnessError(f"{config_path.parent} has no config.json; --model takes a Hugging Face model folder")
    mc = parse_config(read_json(config_path), str(config_path))
    if gpu is not None:
        sheet = datasheet_for(gpu)
        if sheet is None:
            raise HarnessError(f"--gpu {gpu!r} is not in the datasheet table; "
                               "known: H200, H100, A100, L4, A10G, RTX 6000 Ada")
        peaks, name, on_cpu = {**sheet[1], "source": f"datasheet ({sheet[0]})"}, sheet[0], False
    else:
        name, on_cpu = cpu_model(), True
        peaks = peaks_for(name)
    if cfg.peak_memory_gbps is not None and cfg.peak_gflops is not None:  # as the engine takes them
        peaks = {"memory_bandwidth_bytes_per_s": cfg.peak_memory_gbps * 1e9,
                 "matmul_flops_per_s": cfg.peak_gflops * 1e9, "source": "given"}
    widths = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2}
    if dtype is not None and dtype not in widths:
        raise HarnessError(f"--dtype {dtype!r} is not one of float32, float16, bfloat16")
    shape = model_shape(mc, widths[dtype] if dtype else (4 if on_cpu else 2))
    given = peaks if peaks.get("memory_bandwidth_bytes_per_s") else None  # else measured or assumed, said
    if link_gbps is None and cfg.link_gbps is not None:
        link_gbps = cfg.link_gbps
    host = peaks_for(cpu_model())  # with --gpu, this machine's CPU is the host (when measured)
    overhead = cfg.op_overhead_us * 1e-6 if cfg.op_overhead_us is not None else None
    hw = hardware(name, on_cpu, link_gbps * 1e9 if link_gbps is not None else None, given,
                  host if host.get("memory_bandwidth_bytes_per_s") else None, op_overhead_s=overhead)
    if given:
        hw = dataclasses.replace(hw, source=peaks["source"])
    chosen = make_plan(cfg, shape, hw, mc.max_position_embeddings, engine)
    work = Workload(cfg.max_num_seqs, cfg.plan_context)
    alternatives = {}
    for p in candidate_plans(shape, hw, cfg.budget_bytes, work, cfg.block_size * shape.kv_bytes_per_token,
                             cfg.host_scratch_mb << 20, max_seq_blocks=seq_blocks(cfg, mc.max_position_embeddings),
                             host_share=cfg.host_share):
        best = alternatives.get(p.kv_placement)
        if best is None or p.tokens_per_s > best.tokens_per_s:
            alternatives[p.kv_placement] = p
    row = plan_row(chosen)
    if as_json:
        typer.echo(json.dumps({"plan": row, "hardware": dataclasses.asdict(hw), "budget_bytes": cfg.budget_bytes,
                               "alternatives": {k: plan_row(v) for k, v in alternatives.items()}}))
        return
    e = shape.expert_bytes
    typer.echo(f"{engine} plan for {mc.architecture} ({shape.moe_layers} MoE layers x {shape.experts} experts of "
               f"{format_size(e)}) within {format_size(cfg.budget_bytes)} on {name}")
    typer.echo(f"  peaks: {hw.device_bytes_per_s / 1e9:,.1f} GB/s, {hw.device_flops_per_s / 1e9:,.0f} GFLOP/s"
               + (f", link {hw.link_bytes_per_s / 1e9:,.1f} GB/s" if hw.link_bytes_per_s else ", no link modelled")
               + f" ({hw.source})")
    kv = (f"KV staging {format_size(chosen.staging_bytes)} (KV pool in the host tier)" if chosen.staging_bytes
          else f"KV {format_size(chosen.device_kv_bytes)}")
    typer.echo(f"  device: dense {format_size(shape.dense_bytes)} + ring {chosen.expert_slots} x {format_size(e)} + "
               f"resident {chosen.resident_experts}/{shape.total_experts} experts + {kv}")
    for key, value in row.items():
        typer.echo(f"  {key:34s} {value:,.6g}" if isinstance(value, float) else f"  {key:34s} {value}")
    for placement, p in sorted(alternatives.items()):
        typer.echo(f"  best with KV {PLACEMENT_WORDS[placement]:30s}: {p.batch_seqs} seqs, "
                   f"micro-batch {p.micro_batch}, {p.tokens_per_s:,.1f} tok/s predicted")


def plan_row(p) -> dict:
    c = p.predicted
    return {"kv_placement": p.kv_placement, "batch_seqs": p.batch_seqs, "micro_batch": p.micro_batch,
            "expert_slots": p.expert_slots, "resident_experts": p.resident_experts,
            "device_kv_bytes": p.device_kv_bytes, "staging_bytes": p.staging_bytes, "host_share": p.host_share,
            "predicted_decode_step_s": c.total_s,
            "predicted_compute_s": c.compute_s, "predicted_host_s": c.host_s, "predicted_link_s": c.link_s,
            "predicted_tokens_per_s": p.tokens_per_s, "predicted_h2d_bytes_per_step": c.h2d_bytes,
            "predicted_h2d_bytes_per_token": c.h2d_bytes / p.batch_seqs}

"""`pwbench hw`: measure this machine's bandwidths and FLOP/s and cache them for efficiency metrics;
`pwbench hw list` / `pwbench hw show NAME_OR_TOML`: the hardware profiles `--simulate` runs on;
`pwbench hw calibrate [--output FILE.toml] [--model DIR ...]`: measure this CPU, fit the `cpu`
profile's curves and its per-step overhead, print them with their sources, and write them as a
profile TOML; with --model, also the GEMM and dequantization curves of that model's own shapes
(keyed by its shape)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from harness.cli.apps import app
from harness.cli.common import fail, user_errors

hw_app = typer.Typer(
    help="Measure this machine's memory bandwidth, matmul FLOP/s and host<->device bandwidth; cache them. "
    "`hw list` / `hw show NAME` print the hardware profiles --simulate uses; `hw calibrate` fits the cpu one "
    "(`hw calibrate --model DIR`: also on that model's own GEMM shapes).",
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
        if key.endswith("_per_s") and isinstance(value, (int, float)):  # the curves (dicts) are in the cache
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
    if as_json:
        typer.echo(json.dumps(_profile_json(p)))
        return
    _print_profile(p)


SCALARS = ("memory_bytes", "memory_bytes_per_s", "link_bytes_per_s", "link_pinned_bytes_per_s",
           "host_memory_bytes", "host_memory_bytes_per_s", "host_flops_per_s", "step_overhead_s", "op_overhead_s",
           "decode_sequence_overhead_s", "prefill_element_overhead_s", "prefill_segment_overhead_s",
           "prefill_step_overhead_s")


def _profile_json(p: Any) -> dict[str, Any]:
    from engines.sim.hardware import OVERHEAD_TABLES

    return {"name": p.name, "description": p.description, "default_dtype": p.default_dtype, "origin": p.origin,
            **{k: getattr(p, k) for k in SCALARS}, "flops_per_s": p.flops_per_s,
            **{t: getattr(p, t) for t in OVERHEAD_TABLES},
            "efficiency": {k: {"points": [list(x) for x in c.points], "basis": c.basis, "source": c.source}
                           for k, c in p.efficiency.items()},
            "sources": p.sources}


def _print_profile(p: Any) -> None:
    from engines.sim.hardware import OVERHEAD_TABLES

    typer.echo(f"{p.name}: {p.description} (default dtype {p.default_dtype}; from {p.origin})")
    for key in SCALARS:
        typer.echo(f"  {key:26s} {getattr(p, key):<12.4g} {p.sources.get(key, '')}")
    for table in OVERHEAD_TABLES:
        for key, value in getattr(p, table).items():
            src = p.sources.get(table) or p.sources.get(f"model_prefill_overhead.{key}", "")
            typer.echo(f"  {table + '.' + key:26s} {value:<12.4g} {src}")
    for dtype, value in p.flops_per_s.items():
        src = p.sources.get(f"flops_per_s.{dtype}") or p.sources.get("flops_per_s", "")
        typer.echo(f"  {'flops_per_s.' + dtype:26s} {value:<12.4g} {src}")
    for key, curve in p.efficiency.items():
        pts = ", ".join(f"{s:g}:{e:.3g}" for s, e in curve.points)
        typer.echo(f"  efficiency.{key} (of {curve.basis}): {pts}")
        typer.echo(f"      {curve.source}")


# `hw calibrate`'s step-overhead probe: offline batches of the bundled model on engine moe of 6, 2 and 1
# requests (decode-heavy, prompts of distinct tokens: no prefix sharing), measured, then simulated on
# the cpu profile without step overhead, replaying the measured routing; PROBE_REQUESTS per round in the
# engine probe.
PROBE_SIZES, PROBE_PROMPT, PROBE_OUTPUT, PROBE_PASSES = (6, 2, 1), 48, 40, 3
PROBE_REQUESTS = 6


def _timed_steps(engine: Any, requests: list[Any], clock: Any, costs: list[Any] | None = None) -> list[float]:
    """Each step's time from its start to the next step's (the loop's own time included); with
    `costs`, a simulated engine's StepCost of each step is appended to it."""
    for r in requests:
        engine.add_request(r)
    stamps = [clock()]
    while engine.has_unfinished():
        engine.step()
        stamps.append(clock())
        if costs is not None:
            costs.append(engine.executor.last)
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _measured_then_simulated(profile: Any, measure: Any, simulate: Any, device: str = "cpu",
                             model: str | None = None) -> tuple[Any, Any]:
    """`measure(engine)` on `model` (default: the bundled model) on engine moe on `device` (on the
    CPU with one torch thread), its routing recorded, then `simulate(engine)` on the same model
    simulated on `profile` replaying it: (what each returned)."""
    import tempfile
    from pathlib import Path

    import torch

    from engines.common.demo import demo_model_path
    from engines.registry import create_engine
    from engines.sim.hardware import profile_toml

    model = model or str(demo_model_path())
    with tempfile.TemporaryDirectory(prefix="pwbench-calibrate-") as tmp:
        trace, prof = Path(tmp) / "routing.parquet", Path(tmp) / "cpu-probe.toml"
        prof.write_text(profile_toml(profile))
        measured = create_engine("moe", {"model": model, "device": device, "record_routing": str(trace)})
        threads = torch.get_num_threads()
        if device == "cpu":
            torch.set_num_threads(1)
        measured.start()
        try:
            got = measure(measured)
        finally:
            measured.stop()
            torch.set_num_threads(threads)
        simulated = create_engine("moe", {"model": model, "simulate": str(prof), "routing": f"replay:{trace}"})
        simulated.start()
        try:
            return got, simulate(simulated)
        finally:
            simulated.stop()


def step_clock(device: str) -> Any:
    """The probes' clock: this thread's CPU time on the CPU; on a GPU the wall clock, synchronized."""
    import time

    if device == "cpu":
        return time.thread_time
    import torch

    def clock() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    return clock


def measure_op_overhead(device: str = "cpu", base: Any = None) -> tuple[float, float, str]:
    """The runtime's time per torch call the cost model counts (engines/sim/cost.py
    `torch_calls`) and per decode sequence and layer: the calls' Python and the small kernels
    around the priced modules, fitted on the bundled model's decode steps of PROBE_SIZES sequences
    (engines/sim/calibrate.py `fit_call_and_sequence_overhead`: measured minus simulated, the
    simulated step priced without either, against its counted calls and its sequences). Steps are
    timed in this thread's CPU time with one torch thread: on a shared machine the time a neighbour
    holds the core is not the runtime's (wall time here ran ~2x the CPU time). A tiny call alone
    (`pwbench hw`'s op_overhead_s, ~1.4 us here) is a third or less of what a call of the runtime
    takes (4-8 us measured on the bundled and the benchmark models' decode steps). One price per
    call alone (cost model 7) priced the bundled model's one-sequence decode steps 25-32% high and
    its twelve-sequence ones 6-9% high (`python -m harness.bench.simulate --decode-grid`).

    On a GPU (`device` cuda, `base` its profile) the same fit gives eager PyTorch's host time per
    call: steps timed on the wall clock, synchronized; the bundled model's kernels are so small that
    the host's launches are the step (the cost model adds them to the device's work: this runtime's
    MoE layers wait for their routing counts on the host). Returns (seconds per call, seconds per
    decode sequence and layer, source)."""
    import dataclasses

    from engines.base import EngineRequest
    from engines.sim.calibrate import fit_call_and_sequence_overhead
    from engines.sim.hardware import cpu_profile

    def batch(prefix: str, n: int) -> list[Any]:
        return [EngineRequest(f"{prefix}{i}", tuple(3 + (37 * i + 11 * j) % 1000 for j in range(PROBE_PROMPT)),
                              PROBE_OUTPUT, ignore_eos=True) for i in range(n)]

    base = base or cpu_profile()
    marker = base.op_overhead_s or 1e-6  # prices each counted call at this, so that dispatch / marker counts them
    clock = step_clock(device)

    def run(engine: Any, prefix: str, clock: Any, costs: list[Any] | None = None) -> list[float]:
        """One batch of each of PROBE_SIZES in turn; each one prefill step, then PROBE_OUTPUT - 1 decode steps."""
        out = []
        for n in PROBE_SIZES:
            steps = _timed_steps(engine, batch(f"{prefix}-{n}-", n), clock, costs)
            if len(steps) != PROBE_OUTPUT:
                raise RuntimeError(f"op overhead probe: {n} requests took {len(steps)} steps, not {PROBE_OUTPUT}")
            out += steps
        return out

    def measure(engine: Any) -> tuple[int, list[float]]:
        run(engine, "warm", clock)  # the first calls fault pages in
        # each step the median of PROBE_PASSES passes (the same batches): a run's typical step, as a
        # run's latency medians see it, with one neighbour's burst in one pass left out
        passes = [run(engine, f"probe{k}", clock) for k in range(PROBE_PASSES)]
        return engine.checkpoint.config.num_layers, [sorted(step)[len(step) // 2] for step in zip(*passes)]

    def simulate(engine: Any) -> list[Any]:
        costs: list[Any] = []
        run(engine, "warm", engine.virtual_clock.now)
        run(engine, "probe0", engine.virtual_clock.now, costs)
        return costs

    (layers, wall), costs = _measured_then_simulated(
        dataclasses.replace(base, step_overhead_s=0.0, op_overhead_s=marker, decode_sequence_overhead_s=0.0,
                            prefill_element_overhead_s=0.0, prefill_segment_overhead_s=0.0,
                            prefill_step_overhead_s=0.0),
        measure, simulate, device)
    # each batch's decode steps after its first (the prefill and the first decode step left out: warm-up)
    seqs = [n if i >= 2 else 0 for n in PROBE_SIZES for i in range(PROBE_OUTPUT)]
    rows = [(n, max(1, round(c.parts["dispatch"] / marker)), m - (c.seconds - c.parts["dispatch"]))
            for n, m, c in zip(seqs, wall, costs) if n]
    per_call, per_seq, d = fit_call_and_sequence_overhead(rows, layers)
    where = "one torch thread" if device == "cpu" else f"{device}, eager PyTorch, wall clock synchronized"
    medians = "; ".join(f"{n} sequence{'s' if n != 1 else ''}: {c:.0f} calls, {r * 1e3:.3f} ms" for n, c, r in
                        zip(d["sizes"], d["median_calls"], d["median_residual_s"]))
    source = (f"`pwbench hw calibrate`: least squares over the bundled model's decode steps on engine moe "
              f"({layers} layers; batches of {', '.join(map(str, PROBE_SIZES))} requests of {PROBE_PROMPT} + "
              f"{PROBE_OUTPUT} tokens, each step the median of {PROBE_PASSES} passes, {where}) of the measured time "
              "minus the same step simulated without dispatch or step overhead (the cost model's compute, its "
              "GEMMs by the bundled model's own shape curves where measured, plus the control code's measured CPU "
              f"time), medians per batch size ({medians}) = {per_call * 1e6:.2f} us x the torch calls the cost model "
              f"counts + {per_seq * 1e6:.2f} us x layers x sequences (rms error {d['rms_s'] * 1e6:.1f} us): the "
              "runtime's time per call (its Python, views and small kernels) and per decode sequence beyond the "
              "priced modules")
    return per_call, per_seq, source


# `hw calibrate`'s prefill probe: batches of distinct random prompts (no prefix sharing), each prefilled
# in one step: (segments, prompt tokens) varied so that the per-token, per-segment and per-step costs
# can be told apart, single prompts up to the 640-1,024 tokens of an open-loop run's; each batch measured
# PREFILL_REPEATS times, the shapes in turn (a run's prefills differ one from the next). Each prompt then
# decodes PREFILL_DECODE tokens, untimed: a run's prefill follows decode steps (an open-loop run's, tens
# to hundreds of them), and after them the bundled model's prefill takes longer than after prefill-only
# steps: 5-8% after 16 (its six-prompt 880-token batch 10.8 ms against 10.1; `python -m
# harness.bench.simulate --prefill-grid`), single prompts of 128-800 tokens 7-13% more after 40 than after 8.
PREFILL_PROBE = ((1, 32), (1, 128), (1, 384), (4, 64), (8, 32), (12, 64), (24, 32), (6, 128), (1, 640), (1, 1024))
PREFILL_REPEATS = 5
PREFILL_DECODE = 40


# A model's own prefill probe (`hw calibrate --model` on a folder with weights): the same shapes, fewer
# repeats and decode tokens (~30 s on the 8-layer benchmark models), in one process; a checkpoint
# larger than MODEL_PREFILL_MAX_BYTES is not probed (its shape takes the bundled model's rates).
MODEL_PREFILL_REPEATS, MODEL_PREFILL_DECODE, MODEL_PREFILL_MAX_BYTES = 3, 16, 2 << 30


def measure_prefill_overhead(model: str | None = None, repeats: int = PREFILL_REPEATS,
                             decode: int = PREFILL_DECODE) -> tuple[float, float, float, str]:
    """The runtime's prefill time per activation element (token x hidden), per segment and per step
    (per layer) that the cost model does not price, fitted on `model` (default: the bundled model;
    engines/sim/calibrate.py `fit_prefill_overhead`): each probe batch's prefill step, median of its
    `repeats`, measured in this thread's CPU time with one torch thread, minus the same step simulated
    on the cpu profile as fitted so far (step overhead included, no prefill overhead, the model's own
    shape curves where measured), replaying the measured routing. Each prompt then decodes `decode`
    tokens, untimed."""
    import dataclasses
    import random
    import time

    from engines.base import EngineRequest
    from engines.common.demo import demo_model_path
    from engines.runtime.checkpoint import open_checkpoint
    from engines.sim.calibrate import fit_prefill_overhead
    from engines.sim.hardware import MODEL_PREFILL_TABLES, cpu_profile

    rng = random.Random(0)
    config = open_checkpoint(model or demo_model_path(), config_only=True).config
    top = min(1000, config.vocab_size)  # token ids drawn from 3 to this
    # the probe's shapes whose prompts (and their decode) fit the model's positions
    probe = [(g, n) for g, n in PREFILL_PROBE if n + decode <= config.max_position_embeddings]
    if len(probe) < 3:
        raise ValueError(f"prefill probe: {len(probe)} of its shapes fit the model's {config.max_position_embeddings} "
                         f"positions with {decode} tokens decoded; the fit needs 3")
    order = [(k, r) for r in range(repeats) for k in range(len(probe))]  # the shapes in turn
    batches = [[EngineRequest(f"p{k}-{r}-{i}", tuple(rng.randrange(3, top) for _ in range(probe[k][1])),
                              decode, ignore_eos=True) for i in range(probe[k][0])] for k, r in order]
    warm_len = 64 if 64 + decode <= config.max_position_embeddings else min(n for _, n in probe)
    warm = [EngineRequest(f"warm{i}", tuple(rng.randrange(3, top) for _ in range(warm_len)), decode,
                          ignore_eos=True) for i in range(4)]

    def steps(engine: Any, clock: Any) -> list[float]:
        """Each batch's prefill step, by (shape, repeat) in the probe's order."""
        _timed_steps(engine, warm, clock)
        out = [0.0] * len(order)
        for (k, r), batch in zip(order, batches):
            timed = _timed_steps(engine, batch, clock)
            if len(timed) != decode:  # one prefill step, then decode - 1 decode steps
                raise RuntimeError(f"prefill probe: a batch of {len(batch)} prompts took {len(timed)} steps, "
                                   f"not {decode} (its prefill in one)")
            out[k * repeats + r] = timed[0]
        return out

    unfitted = dataclasses.replace(cpu_profile(), prefill_element_overhead_s=0.0, prefill_segment_overhead_s=0.0,
                                   prefill_step_overhead_s=0.0, **{f: {} for f in MODEL_PREFILL_TABLES})
    wall, predicted = _measured_then_simulated(unfitted, lambda engine: steps(engine, time.thread_time),
                                               lambda engine: steps(engine, engine.virtual_clock.now), model=model)
    layers, hidden = config.num_layers, config.hidden_size
    rows = []
    for k, (segments, n) in enumerate(probe):
        got = slice(k * repeats, (k + 1) * repeats)
        # the median measured repeat (a run's typical step) against the median simulated one
        residual = sorted(wall[got])[repeats // 2] - sorted(predicted[got])[repeats // 2]
        rows.append((segments * n, segments, residual))
    per_element, per_segment, per_step, d = fit_prefill_overhead(rows, layers, hidden)
    shapes = ", ".join(f"{g} x {n}" for g, n in probe)
    name = f"the model {model}" if model else "the bundled model"
    source = (f"`pwbench hw calibrate`: least squares over {d['steps']} prefill steps of {name} on engine "
              f"moe ({layers} layers; prompts of distinct random tokens, segments x tokens: {shapes}, each batch "
              f"then decoding {decode} tokens untimed; median of {repeats} repeats each, the shapes "
              "in turn, one torch thread, this thread's CPU time) of measured minus simulated "
              f"(the cost model without these) = layers x ({per_element * 1e9:.2f} ns x tokens x hidden ({hidden}) + "
              f"{per_segment * 1e6:.1f} us x segments + {per_step * 1e6:.1f} us); rms error {d['rms_s'] * 1e3:.2f} "
              "ms: the model code's time per prefill activation element, segment and step beyond the priced modules")
    return per_element, per_segment, per_step, source


def prefill_probe_models(folders: list[str]) -> list[str]:
    """Those of `folders` that `hw calibrate --model` runs its own prefill probe on: a checkpoint
    whose weights (*.safetensors) are there and at most MODEL_PREFILL_MAX_BYTES (a config-only
    folder, or a larger model, takes the bundled model's rates; the bundled model is the profile's own)."""
    from pathlib import Path

    from engines.common.demo import demo_model_path

    out, bundled = [], demo_model_path().resolve()
    for folder in folders:
        if Path(folder).resolve() == bundled:  # the profile's own rates are fitted on it
            continue
        files = list(Path(folder).glob("*.safetensors"))
        if files and sum(f.stat().st_size for f in files) <= MODEL_PREFILL_MAX_BYTES:
            out.append(folder)
    return out


# `hw calibrate`'s engine probe: each engine that pays one key of the profile's executor_overhead tables
# (its class's `sim_overhead_keys`: its parts' host code beyond engine moe's path) stepped beside engine
# moe on the same batches (one step of each in turn, so the host's speed, which drifts by 1.5x within a
# second here, is the same for both), measured and simulated. An engine of several keys (full: moegen's
# executor and pagedweight's backend) is priced by them, not fitted.
EXECUTOR_ROUNDS = 9  # rounds of 6 requests (the first warms up, not counted)


def _paired_steps(make: Any, name: str, clock: Any) -> tuple[list[float], list[float], int, int]:
    """Engine moe and engine `name` (each from `make(engine)`) stepped in turn on the same requests:
    (the per-step time differences name - moe of prefill steps, of decode steps, the tokens of one
    prefill step, of one decode step)."""
    import random

    from engines.base import EngineRequest

    pair = [make("moe"), make(name)]
    prefill, decode, tokens = [], [], [0, 0]
    try:
        for k in range(EXECUTOR_ROUNDS):
            rng = random.Random(k)
            prompts = [tuple(rng.randrange(3, 1000) for _ in range(60 + 10 * i)) for i in range(PROBE_REQUESTS)]
            for e in pair:
                for i, prompt in enumerate(prompts):
                    e.add_request(EngineRequest(f"x{k}-{i}", prompt, 24, ignore_eos=True))
            first = True
            while any(e.has_unfinished() for e in pair):
                took = []
                for e in pair:
                    t = clock(e)
                    out = e.step()
                    took.append(clock(e) - t)
                if k:
                    (prefill if first else decode).append(took[1] - took[0])
                    tokens[0 if first else 1] = out.num_prefill_tokens + out.num_decode_tokens
                first = False
    finally:
        for e in pair:
            e.stop()
    return prefill, decode, tokens[0], tokens[1]


def measure_executor_overheads() -> tuple[dict[str, float], dict[str, float], str]:
    """The host time per layer and per layer-token that each engine's parts take beyond engine moe's
    path and the cost model does not price (engines/sim/cost.py `executor_overhead_s`), fitted on the
    bundled model: for each engine that pays one key, the median step-time difference from engine moe,
    measured (this thread's CPU time, one torch thread) minus simulated (the cpu profile without
    these, uniform routing), on prefill and on decode steps, solved for per layer and per
    layer-token (clipped at 0)."""
    import dataclasses
    import tempfile
    import time
    from pathlib import Path

    import torch

    from engines.common.demo import demo_model_path
    from engines.registry import create_engine, engine_class, list_engines
    from engines.runtime.checkpoint import open_checkpoint
    from engines.sim.hardware import cpu_profile, profile_toml
    from harness.bench.simulate import engine_options, model_sizes
    from harness.calibration import create_calibrated

    probe = [(name, engine_class(name).sim_overhead_keys[0]) for name, _ in list_engines()
             if len(engine_class(name).sim_overhead_keys) == 1]
    model = str(demo_model_path())
    sizes = model_sizes(model)
    layers = open_checkpoint(model, config_only=True).config.num_layers

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    per_layer, per_token, notes = {}, {}, []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="pwbench-calibrate-") as tmp:
            prof = Path(tmp) / "cpu-probe.toml"
            prof.write_text(profile_toml(dataclasses.replace(cpu_profile(), executor_overhead_s={},
                                                             executor_token_overhead_s={})))

            def started(name: str, sim: bool) -> Any:
                opts = {"model": model, "device": "cpu", "dtype": "float32", **engine_options(name, sizes)}
                e = (create_engine(name, {**opts, "simulate": str(prof), "routing": "uniform"}) if sim
                     else create_calibrated(name, opts))
                e.start()
                return e

            for name, key in probe:
                m_pre, m_dec, t_pre, t_dec = _paired_steps(lambda n: started(n, False), name,
                                                           lambda e: time.thread_time())
                s_pre, s_dec, _, _ = _paired_steps(lambda n: started(n, True), name, lambda e: e.virtual_clock.now())
                gap_pre, gap_dec = med(m_pre) - med(s_pre), med(m_dec) - med(s_dec)
                b = max(0.0, (gap_pre - gap_dec) / (layers * max(1, t_pre - t_dec)))
                a = max(0.0, gap_dec / layers - b * t_dec)
                per_layer[key], per_token[key] = a, b
                notes.append(f"{name} ({key}): prefill {gap_pre * 1e3:+.2f} ms over {t_pre} tokens, decode "
                             f"{gap_dec * 1e3:+.2f} ms over {t_dec}")
    finally:
        torch.set_num_threads(threads)
    source = (f"`pwbench hw calibrate`: each engine stepped beside engine moe on the bundled model ({layers} layers; "
              f"{EXECUTOR_ROUNDS - 1} rounds of {PROBE_REQUESTS} requests, one step of each in turn, this thread's CPU "
              "time, one torch thread), the median step-time difference from moe measured minus simulated (without "
              "these): " + "; ".join(notes) + "; solved per layer (executor_overhead_s) and per layer-token "
              "(executor_token_overhead_s)")
    return per_layer, per_token, source


# `hw calibrate` fits the runtime's overheads in CALIBRATION_PROCESSES fresh interpreters and keeps the
# median one: one process's fit differs from the next's on this host, as a run's timings do (the
# source lists each process's fit by the price below), and the benchmark's measured side is the median
# of several processes' runs. The fits are ranked by what they add to a
# reference step of the bundled model: (calls, layers x sequences) of its decode step of 6 sequences;
# (layers x tokens x hidden, layers x segments, layers) of its six-prompt 880-token prefill.
CALIBRATION_PROCESSES = 3
REFERENCE_DECODE = (376, 2 * 6)
REFERENCE_PREFILL = (2 * 880 * 128, 2 * 6, 2)


def median_fit(measure: Any, price: Any, what: str) -> tuple[Any, ...]:
    """`measure()` (returning (coefficients..., source)) in CALIBRATION_PROCESSES fresh interpreters:
    the fit whose `price(fit)` (seconds) is the median, its source saying so and giving each fit's."""
    from harness.hw import fresh_process

    fits = sorted((fresh_process(measure) for _ in range(CALIBRATION_PROCESSES)), key=price)
    chosen = fits[len(fits) // 2]
    prices = ", ".join(f"{price(f) * 1e3:.3f}" for f in fits)
    return (*chosen[:-1], f"{chosen[-1]}; the median of {len(fits)} fresh processes' fits by {what} ({prices} ms)")


def calibrate_cpu(models: list[str], overheads: bool = True) -> dict[str, Any]:
    """`pwbench hw calibrate`'s work, cached as it goes: this CPU measured as `pwbench hw` does,
    the GEMM shapes of each folder in `models` (and the bundled model's, for the probes) added
    to those calibrated before, and with `overheads` the runtime's time per counted call and the
    prefill rates fitted on the bundled model. Returns the cached measurement."""
    from engines.common.peaks import cached_peaks, cpu_model
    from harness.hw import measure, save_cached

    previous = (cached_peaks().get(cpu_model()) or {}).get("model_gemm") or {}
    result = measure("cpu")
    folders, keys = list(models), {}
    if overheads:  # the probes' model, priced by its own shapes: the residual is then the runtime's Python
        from engines.common.demo import demo_model_path

        folders.append(str(demo_model_path()))
    if folders or previous:
        from harness.bench.cpu_ops import model_gemm_entry

        result["model_gemm"] = dict(previous)  # models calibrated before keep their curves
        for folder in folders:
            key, entry = model_gemm_entry(folder)
            result["model_gemm"][key] = entry
            keys[folder] = key
    save_cached(result)
    if overheads:
        # kept beside `pwbench hw`'s op_overhead_s (a tiny call), which moegen's planner reads for measured runs
        (result["runtime_op_overhead_s"], result["decode_sequence_overhead_s"],
         result["runtime_op_overhead_source"]) = median_fit(
            measure_op_overhead, lambda f: f[0] * REFERENCE_DECODE[0] + f[1] * REFERENCE_DECODE[1],
            f"the bundled model's decode step of 6 sequences ({REFERENCE_DECODE[0]} calls) priced by each")
        result["step_overhead_s"] = 0.0
        result["step_overhead_source"] = ("folded into op_overhead_s (fitted per counted torch call); the run loop's "
                                          "own time between steps is the simulated run's measured control time")
        save_cached(result)
        (result["prefill_element_overhead_s"], result["prefill_segment_overhead_s"],
         result["prefill_step_overhead_s"], result["prefill_overhead_source"]) = median_fit(
            measure_prefill_overhead, lambda f: sum(k * n for k, n in zip(f, REFERENCE_PREFILL)),
            "the bundled model's six-prompt 880-token prefill priced by each")
        save_cached(result)
        (result["executor_overhead_s"], result["executor_token_overhead_s"],
         result["executor_overhead_source"]) = measure_executor_overheads()
        save_cached(result)
        for folder in prefill_probe_models(list(models)):  # each model's own prefill rates, by its shape key
            entry = result["model_gemm"][keys[folder]]
            try:
                element, segment, step, source = measure_prefill_overhead(folder, MODEL_PREFILL_REPEATS,
                                                                          MODEL_PREFILL_DECODE)
            except ValueError as exc:  # too few probe shapes fit its positions, or their residuals fit no rate
                entry["prefill_overhead_skipped"] = f"{exc}; the bundled model's rates apply"
                continue
            entry["prefill_overhead"] = {"element_s": element, "segment_s": segment, "step_s": step, "source": source}
            save_cached(result)
    return result


@hw_app.command("calibrate")
@user_errors
def hw_calibrate(
    output: Annotated[str | None, typer.Option(help="Also write the fitted profile to this TOML file "
                                               "(`pwbench run --simulate FILE.toml` runs on it).")] = None,
    step_overhead: Annotated[bool, typer.Option(help="Also fit, on the bundled model, the runtime's time per torch "
                                                "call and per decode sequence, and per prefill token, segment and "
                                                "step (each the median of three fresh processes' fits), and each "
                                                "engine's parts' time beyond engine moe's path (stepped beside moe) "
                                                "(~40 s; the bundled model's shapes measured first).")] = True,
    model: Annotated[list[str] | None, typer.Option(
        "--model", help="A model folder (config.json is enough) whose own shapes to measure: its attention "
        "projections, one expert (gate_up + down) and its LM head at 1-1024 rows, 16 sequences' decode attention "
        "over its cache layout at 128-1536 tokens of context, SDPA over its heads at 16-1024-token chunks "
        "(causal, and after as many tokens of context with the runtime's mask), and the "
        "torch reference's dequantization of one expert at 2, 3, 4 and 8 bits (RTN records of the static "
        "engines' group size); with the overheads, and where the folder holds the weights (up to 2 GiB), the "
        "prefill probe on the model itself (~30 s for an 8-layer model; its per-element, per-segment and per-step "
        "rates, model_prefill_*_overhead_s.KEY). The fitted curves are kept under the model's shape key "
        "(gemm@KEY, grouped_gemm@KEY, "
        "head@KEY, attention_decode@KEY, attention_prefill@KEY, attention_prefill_context@KEY, "
        "dequant_cpu_packed@KEY) beside those of "
        "models calibrated before, and `--simulate cpu` prices a model of that shape by them instead of the "
        "generic curves (measured on one square matrix, one [1536, 512] expert matrix). Repeat for several "
        "models.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line.")] = False,
) -> None:
    """Measure this CPU as `pwbench hw` does (and cache it), fit the `cpu` profile's efficiency
    curves and overheads (per torch call, per prefill token, segment and step, per engine part),
    print the profile with every source, and optionally write it.
    With --model, also measure that model's own GEMM shapes and expert dequantization (curves keyed
    by its shape)."""
    from pathlib import Path

    from engines.base import ModelLoadError
    from engines.runtime.checkpoint import open_checkpoint
    from engines.sim.hardware import cpu_profile, load_profile, profile_toml

    out_path = Path(output).expanduser() if output else None
    if out_path is not None and (out_path.is_dir() or not out_path.parent.is_dir()):
        raise fail(f"--output {output}: not a file in an existing folder; give e.g. --output my-cpu.toml")
    for folder in model or ():
        try:
            open_checkpoint(folder, config_only=True)
        except ModelLoadError as exc:
            raise fail(f"--model {folder}: {exc}") from None
    result = calibrate_cpu(list(model or ()), step_overhead)
    for entry in (result.get("model_gemm") or {}).values():
        if entry.get("prefill_overhead_skipped") and entry.get("model") in (model or ()):
            typer.echo(f"--model {entry['model']}: no prefill probe of its own: {entry['prefill_overhead_skipped']}",
                       err=True)
    try:
        p = cpu_profile()
        if out_path is not None:
            out_path.write_text(profile_toml(p, header=f"{p.description}: fitted by `pwbench hw calibrate` at "
                                                       f"{result['measured_at']}"))
            load_profile(str(out_path))  # reads back: the file is a valid profile
    except ValueError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"--output {output}: cannot write ({exc.strerror})") from None
    if as_json:
        typer.echo(json.dumps({**_profile_json(p), "output": str(out_path) if out_path else None}))
        return
    _print_profile(p)
    if out_path is not None:
        typer.echo(f"wrote {out_path}: `pwbench run --simulate {out_path}` runs on it")


app.add_typer(hw_app, name="hw")

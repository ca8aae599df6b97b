"""The `pwbench` command line.

Commands import their heavy dependencies inside the function body, so `pwbench --help` and
`pwbench ls engines` never import torch. A user error (EngineError and friends) becomes one
line on stderr and exit code 2; Ctrl-C exits with 130.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from engines.base import EngineError
from harness.cli_common import print_columns, user_errors
from harness.quantize_cli import quantize
from harness.trace_cli import trace_app

app = typer.Typer(
    name="pwbench",
    help="Benchmark MoE serving techniques on your own traffic: run workloads against engines, "
    "compare results, gate regressions.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
ls_app = typer.Typer(help="List what pwbench knows about: engines, workloads.", no_args_is_help=True)
app.add_typer(ls_app, name="ls")
app.add_typer(trace_app, name="trace")
demo_app = typer.Typer(help="The bundled demo MoE model: train it, evaluate it.", no_args_is_help=True)
app.add_typer(demo_app, name="demo")
app.command("quantize")(quantize)

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


@app.command()
@user_errors
def generate(
    model: Annotated[str, typer.Option("--model", "-m", help="Local Hugging Face model folder.")],
    prompt_ids: Annotated[
        list[str] | None, typer.Option("--prompt-ids", help="A prompt as comma-separated token ids; repeatable.")
    ] = None,
    prompt: Annotated[
        list[str] | None, typer.Option("--prompt", help="A text prompt (needs tokenizer.json); repeatable.")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 32,
    engine: Annotated[str | None, typer.Option(help="Engine name (see `pwbench ls engines`; default: moe, or static-<method> for a quantized folder).")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (1 = off).")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely tokens (0 = off).")] = 0,
    seed: Annotated[int, typer.Option(help="Sampling seed (prompt i uses seed + i).")] = 0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Generate exactly --max-new-tokens.")] = False,
    dtype: Annotated[str | None, typer.Option(help="float32 | bfloat16 | float16 (default: float32 on cpu, bf16 on cuda).")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N (default: cuda if present).")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Engine option key=value; repeatable.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line.")] = False,
) -> None:
    """Generate continuations of one or more prompts, all submitted together."""
    from harness.generate import GenerateArgs, parse_prompt_ids, run_generate
    from engines.registry import parse_set_options

    prompts = _ordered_prompts([parse_prompt_ids(p) for p in prompt_ids or []], list(prompt or []))
    if not prompts:
        raise EngineError("give at least one --prompt-ids or --prompt")
    args = GenerateArgs(
        engine=_engine_for(engine, model),
        model=model,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        ignore_eos=ignore_eos,
        options={"device": device, "dtype": dtype, **parse_set_options(set_ or [])},
    )
    results = run_generate(args)
    if as_json:
        typer.echo(json.dumps({"outputs": results}))
        return
    for i, r in enumerate(results):
        typer.echo(f"[{i}] prompt: {r.get('prompt_text', r['prompt_ids'])}")
        typer.echo(f"    output: {r.get('text', r['output_ids'])}  ({len(r['output_ids'])} tokens, {r['finish_reason']})")


@demo_app.command("train")
@user_errors
def demo_train(
    output: Annotated[str, typer.Option(help="Folder to write the trained model to.")] = "demo-model",
    steps: Annotated[int | None, typer.Option(help="Curriculum-stage optimizer steps, the lookup-circuit phase included (default 4000; deterministic for a fixed count).")] = None,
    seed: Annotated[int, typer.Option(help="Seed for weights and data (2: the shipped model).")] = 2,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Training option key=value (see harness/demo_train.py TrainConfig).")] = None,
    from_: Annotated[str | None, typer.Option("--from", help="Skip the curriculum: run only the long-context stage on this finished curriculum checkpoint (same settings; one written with --set long_steps=0).")] = None,
) -> None:
    """Train the demo MoE model from scratch on the demo tasks (the shipped model's command:
    about 47 minutes on 2 CPU cores)."""
    from pathlib import Path

    from engines.registry import build_config, parse_set_options
    from harness.demo_train import TrainConfig, train

    options = {"seed": seed, **({"steps": steps} if steps is not None else {}), **parse_set_options(set_ or [])}
    config = build_config(TrainConfig, options, owner="demo train")
    report = train(config, Path(output), log=lambda line: typer.echo(line), start_from=Path(from_) if from_ else None)
    typer.echo(f"wrote {output} (final curriculum level {report['final_level']}, {report['minutes']} min)")


@demo_app.command("eval")
@user_errors
def demo_eval(
    model: Annotated[str | None, typer.Option(help="Model folder (default: the bundled demo model).")] = None,
    engine: Annotated[str, typer.Option(help="Engine name.")] = "moe",
    samples: Annotated[int, typer.Option(help="Examples per recall/copy task.")] = 200,
    expert_bits: Annotated[int | None, typer.Option(help="RTN-quantize routed experts to this many bits first (moe engine).")] = None,
    expert_group: Annotated[int, typer.Option(help="Inputs per RTN group with --expert-bits; 0 = one group per output row (plain per-channel RTN).")] = 32,
    curve: Annotated[str | None, typer.Option(help="Also measure recall at these context lengths, e.g. 256,512,1024,2000.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Engine option key=value, e.g. dtype=bfloat16 for 16-bit weights and activations.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line.")] = False,
) -> None:
    """Exact-match accuracy on held-out demo tasks (RAG and chat recall at 512-1024 tokens, closed book, copy)."""
    from engines.demo import demo_model_path
    from engines.registry import parse_set_options
    from harness.demo_eval import EvalSpec, context_curve, evaluate

    folder = model or str(demo_model_path())
    options = parse_set_options(set_ or [])
    say = (lambda m: None) if as_json else (lambda m: typer.echo(m))
    result = evaluate(folder, engine, EvalSpec(samples=samples), options=options, expert_bits=expert_bits, progress=say,
                      expert_group=expert_group)
    payload = {"model": folder, "engine": engine, "options": options, "expert_bits": expert_bits,
               "expert_group": expert_group if expert_bits is not None else None,
               "accuracy": result.accuracy, "counts": result.counts}
    if curve:
        lengths = [int(x) for x in curve.split(",")]
        payload["context_curve"] = context_curve(folder, lengths, EvalSpec(samples=samples), engine, options)
        for task, points in payload["context_curve"].items():
            say(f"{task} by context: " + ", ".join(f"{n}: {a:.3f}" for n, a in points.items()))
    if as_json:
        typer.echo(json.dumps(payload))


@app.command("eval")
@user_errors
def eval_(
    tasks: Annotated[str, typer.Option(help="Comma-separated lm-eval task names (demo_rag, demo_chat, demo_closed_book, demo_copy, or any task in --include-path).")] = "demo_rag,demo_chat",
    engine: Annotated[str, typer.Option(help="Engine name.")] = "moe",
    model: Annotated[str | None, typer.Option(help="Model folder (default: the bundled demo model).")] = None,
    output: Annotated[str | None, typer.Option(help="Run folder to store lm_eval.json in (default: print only).")] = None,
    include_path: Annotated[str | None, typer.Option(help="Extra folder of lm-eval task YAMLs.")] = None,
    limit: Annotated[int | None, typer.Option(help="Examples per task (default: all).")] = None,
    samples: Annotated[int, typer.Option(help="Examples written per demo task.")] = 200,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Engine option key=value; repeatable.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line.")] = False,
) -> None:
    """Run lm-eval tasks against a pwbench engine, fully offline."""
    import os
    import tempfile
    from pathlib import Path

    from engines.registry import parse_set_options
    from harness.lm_eval_tasks import run_lm_eval, write_demo_tasks

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="pwbench-lm-eval-") as tmp:
        folder = write_demo_tasks(Path(tmp), samples)
        if include_path:
            for extra in Path(include_path).glob("*.yaml"):
                (folder / extra.name).write_text(extra.read_text())
        result = run_lm_eval([t.strip() for t in tasks.split(",") if t.strip()], engine, model, folder, limit,
                             parse_set_options(set_ or []))
    if output:
        target = Path(output) / "lm_eval.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp_file = target.with_suffix(".json.tmp")
        tmp_file.write_text(json.dumps(result, indent=1) + "\n")
        tmp_file.replace(target)
    for task, metrics in result["metrics"].items():
        line = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        if not as_json:
            typer.echo(f"{task}: {line}")
    if as_json:
        typer.echo(json.dumps(result["metrics"]))


@demo_app.command("tasks")
@user_errors
def demo_tasks(
    output: Annotated[str, typer.Option(help="Folder for the task YAMLs and their JSONL data.")] = "demo-tasks",
    samples: Annotated[int, typer.Option(help="Examples per task.")] = 200,
) -> None:
    """Write the demo tasks as offline lm-eval tasks (use the folder as --include_path)."""
    from pathlib import Path

    from harness.lm_eval_tasks import write_demo_tasks

    folder = write_demo_tasks(Path(output), samples)
    typer.echo(f"wrote demo_rag, demo_chat, demo_closed_book, demo_copy to {folder}")


@app.command("lm-eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                         "help_option_names": []})
@user_errors
def lm_eval_passthrough(ctx: typer.Context) -> None:
    """lm-eval's own command line with `--model pwbench` available (arguments pass through)."""
    from harness.lm_eval_tasks import lm_eval_cli

    raise typer.Exit(lm_eval_cli(list(ctx.args)))


@app.command("run")
@user_errors
def run(
    workload: Annotated[str, typer.Option(help="Named workload (see `pwbench ls workloads`) or trace:PATH.")] = "rag_long",
    engine: Annotated[str | None, typer.Option(help="Engine name (see `pwbench ls engines`; default: moe, or static-<method> for a quantized folder).")] = None,
    model: Annotated[str | None, typer.Option(help="Local model folder (default: the bundled demo model).")] = None,
    requests: Annotated[int | None, typer.Option(help="At most this many requests.")] = None,
    duration: Annotated[float | None, typer.Option(help="Admit requests only during this many seconds.")] = None,
    rate: Annotated[float | None, typer.Option(help="Open loop: mean requests per second.")] = None,
    concurrency: Annotated[int | None, typer.Option(help="Closed loop: this many users.")] = None,
    time_scale: Annotated[float | None, typer.Option(help="Multiply trace times and think times (0.1 = 10x faster; default 1).")] = None,
    arrival: Annotated[str | None, typer.Option(help="trace | poisson | gamma | closed | offline (default: the workload's).")] = None,
    burstiness: Annotated[float | None, typer.Option(help="Gamma arrivals: CV^2 of the gaps (1 = Poisson).")] = None,
    scale: Annotated[float | None, typer.Option(help="Multiply every token length (default 1; smaller for the demo model).")] = None,
    context: Annotated[int | None, typer.Option(help="rag_long: target prompt length in tokens (e.g. 16000).")] = None,
    input_len: Annotated[str | None, typer.Option(help="offline_batch: prompt length N or range A-B.")] = None,
    output_len: Annotated[str | None, typer.Option(help="offline_batch: output length N or range A-B.")] = None,
    trace_format: Annotated[str | None, typer.Option("--format", help="trace:PATH: the trace format (default: detected).")] = None,
    trace_map: Annotated[str | None, typer.Option("--map", help="trace:PATH in your own JSONL/CSV layout (--format jsonl|csv): FIELD=COLUMN pairs, e.g. arrival_s=start_time_s,input_tokens=input_tokens,output_tokens=output_tokens,session_id=session_id[,time_unit=ms]; times may be absolute or relative.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for the workload and sampling.")] = 0,
    output: Annotated[str | None, typer.Option(help="Result folder (default: results/<run_id>).")] = None,
    slo: Annotated[str, typer.Option(help="Latency targets for goodput, e.g. ttft_ms=2000,tpot_ms=200.")] = "ttft_ms=2000,tpot_ms=200",
    warmup: Annotated[int, typer.Option(help="Requests run before measuring (excluded).")] = 2,
    telemetry_hz: Annotated[float, typer.Option(help="Telemetry samples per second.")] = 10.0,
    quality: Annotated[bool, typer.Option(help="Measure KL / top-1 agreement against the float32 reference.")] = True,
    dtype: Annotated[str | None, typer.Option(help="float32 | bfloat16 | float16.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Engine option key=value; repeatable.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object as the last line.")] = False,
) -> None:
    """Replay a workload against an engine and write a result folder (run.json + parquet files)."""
    from harness.run_cli import run_command

    options = dict(locals())
    options["engine"] = _engine_for(engine, model)
    code = run_command(options)
    raise typer.Exit(code)


@app.command("show")
@user_errors
def show(
    run_dir: Annotated[str, typer.Argument(help="A result folder written by `pwbench run`.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object.")] = False,
) -> None:
    """Print a run's summary again, from its files."""
    from pathlib import Path

    from harness.results import read_run
    from harness.summary_table import print_summary

    run_json = read_run(Path(run_dir))
    if as_json:
        typer.echo(json.dumps(run_json["summary"]))
    else:
        print_summary(run_json, Path(run_dir))


@app.command("hw")
@user_errors
def hw(
    device: Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N (default: cuda if present).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line.")] = False,
) -> None:
    """Measure this machine's memory bandwidth, matmul FLOP/s and host<->device bandwidth; cache them."""
    from engines.device import resolve_device
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


def _engine_for(engine: str | None, model: str | None) -> str:
    """The engine named, else the one that serves the folder (static-<method> for a quantized
    folder, said in one line on stderr)."""
    if engine is not None:
        return engine
    from engines.folders import engine_for_folder

    name, note = engine_for_folder(model)
    if note:
        typer.echo(f"note: {note}", err=True)
    return name


def _ordered_prompts(id_prompts: list[list[int]], text_prompts: list[str]) -> list[list[int] | str]:
    """Interleave --prompt-ids and --prompt in the order they appeared on the command line."""
    kinds = []
    for arg in sys.argv[1:]:
        if arg == "--prompt-ids" or arg.startswith("--prompt-ids="):
            kinds.append("ids")
        elif arg == "--prompt" or arg.startswith("--prompt="):
            kinds.append("text")
    if kinds.count("ids") != len(id_prompts) or kinds.count("text") != len(text_prompts):
        kinds = ["ids"] * len(id_prompts) + ["text"] * len(text_prompts)
    ids, texts = iter(id_prompts), iter(text_prompts)
    return [next(ids) if k == "ids" else next(texts) for k in kinds]


def main() -> None:
    app()


if __name__ == "__main__":
    main()

"""`pwbench demo train|eval|tasks`: the bundled demo model's trainer, evaluator and lm-eval tasks."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from harness.cli.apps import demo_app
from harness.cli.common import user_errors


@demo_app.command("train")
@user_errors
def demo_train(
    output: Annotated[str, typer.Option(help="Folder to write the trained model to.")] = "demo-model",
    preset: Annotated[str, typer.Option(help="Which bundled model's recipe: demo (engines/demo_model, Mixtral) or "
                                             "demo-fine (engines/demo_fine_model, DeepSeek-V3).")] = "demo",
    steps: Annotated[int | None,
                     typer.Option(help="Curriculum-stage optimizer steps, the lookup-circuit phase included (default: "
                                       "the preset's, 4000 for demo; deterministic for a fixed count).")] = None,
    seed: Annotated[int | None,
                    typer.Option(help="Seed for weights and data (default 2, the shipped models').")] = None,
    set_: Annotated[list[str] | None,
                    typer.Option("--set",
                                 help="Training option key=value (see harness/demo/train.py TrainConfig).")] = None,
    from_: Annotated[str | None,
                     typer.Option("--from",
                                  help="Skip the curriculum: run only the long-context stage on this finished "
                                       "curriculum checkpoint (same settings; one written "
                                       "with --set long_steps=0).")] = None,
) -> None:
    """Train a demo MoE model from scratch on the demo tasks (the shipped demo model's command:
    about 47 minutes on 2 CPU cores; --preset demo-fine: see docs/demo_model.md)."""
    from pathlib import Path

    from engines.registry import build_config, parse_set_options
    from harness.demo.train import PRESETS, TrainConfig, train
    from harness.errors import HarnessError

    if preset not in PRESETS:
        raise HarnessError(f"--preset {preset!r} is unknown; use one of {', '.join(PRESETS)}")
    options = {**PRESETS[preset], **({"seed": seed} if seed is not None else {}),
               **({"steps": steps} if steps is not None else {}), **parse_set_options(set_ or [])}
    config = build_config(TrainConfig, options, owner="demo train")
    report = train(config, Path(output), log=lambda line: typer.echo(line), start_from=Path(from_) if from_ else None)
    typer.echo(f"wrote {output} (final curriculum level {report['final_level']}, {report['minutes']} min)")


@demo_app.command("eval")
@user_errors
def demo_eval(
    model: Annotated[str | None, typer.Option(help="Model folder, or a bundled model's name: demo (the default) "
                                                   "or demo-fine.")] = None,
    engine: Annotated[str, typer.Option(help="Engine name.")] = "moe",
    samples: Annotated[int, typer.Option(help="Examples per recall/copy task.")] = 200,
    expert_bits: Annotated[int | None,
                           typer.Option(help="RTN-quantize routed experts to this many "
                                             "bits first (moe engine).")] = None,
    expert_group: Annotated[int,
                            typer.Option(help="Inputs per RTN group with --expert-bits; 0 = one group per output row "
                                              "(plain per-channel RTN).")] = 32,
    curve: Annotated[str | None,
                     typer.Option(help="Also measure recall at these context lengths, e.g. 256,512,1024,2000.")] = None,
    set_: Annotated[list[str] | None,
                    typer.Option("--set",
                                 help="Engine option key=value, e.g. dtype=bfloat16 for 16-bit "
                                      "weights and activations.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line.")] = False,
) -> None:
    """Exact-match accuracy on held-out demo tasks (RAG and chat recall at 512-1024 tokens, closed book, copy)."""
    from engines.common.demo import demo_model_path, resolve_model
    from engines.registry import parse_set_options
    from harness.demo.eval import EvalSpec, context_curve, evaluate

    folder = resolve_model(model) or str(demo_model_path())
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


@demo_app.command("tasks")
@user_errors
def demo_tasks(
    output: Annotated[str, typer.Option(help="Folder for the task YAMLs and their JSONL data.")] = "demo-tasks",
    samples: Annotated[int, typer.Option(help="Examples per task.")] = 200,
) -> None:
    """Write the demo tasks as offline lm-eval tasks (use the folder as --include_path)."""
    from pathlib import Path

    from harness.lmeval.tasks import write_demo_tasks

    folder = write_demo_tasks(Path(output), samples)
    typer.echo(f"wrote demo_rag, demo_chat, demo_closed_book, demo_copy to {folder}")

"""`pwbench eval` (lm-eval tasks against an engine, offline) and `pwbench lm-eval` (lm-eval's own CLI)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from engines.common.demo import resolve_model
from harness.cli.apps import app
from harness.cli.common import user_errors


@app.command("eval")
@user_errors
def eval_(
    tasks: Annotated[str,
                     typer.Option(help="Comma-separated lm-eval task names (demo_rag, demo_chat, demo_closed_book, "
                                       "demo_copy, or any task in --include-path).")] = "demo_rag,demo_chat",
    engine: Annotated[str, typer.Option(help="Engine name.")] = "moe",
    model: Annotated[str | None, typer.Option(help="Model folder (default: the bundled demo model).")] = None,
    output: Annotated[str | None,
                      typer.Option(help="Run folder to store lm_eval.json in (default: print only).")] = None,
    include_path: Annotated[str | None, typer.Option(help="Extra folder of lm-eval task YAMLs.")] = None,
    limit: Annotated[int | None, typer.Option(help="Examples per task (default: all).")] = None,
    samples: Annotated[int, typer.Option(help="Examples written per demo task.")] = 200,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Engine option key=value; repeatable.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line.")] = False,
) -> None:
    """Run lm-eval tasks against a pwbench engine, fully offline."""
    model = resolve_model(model)  # a bundled model's name (demo, demo-fine) -> its folder
    import os
    import tempfile
    from pathlib import Path

    from engines.registry import parse_set_options
    from harness.lmeval.tasks import run_lm_eval, write_demo_tasks

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


@app.command("lm-eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                         "help_option_names": []})
@user_errors
def lm_eval_passthrough(ctx: typer.Context) -> None:
    """lm-eval's own command line with `--model pwbench` available (arguments pass through)."""
    from harness.lmeval.tasks import lm_eval_cli

    raise typer.Exit(lm_eval_cli(list(ctx.args)))

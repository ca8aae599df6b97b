"""`pwbench generate`: continuations of prompts given as token ids or text."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from engines.base import EngineError
from engines.common.demo import demo_model_path, resolve_model
from harness.cli.apps import app
from harness.cli.common import BUDGET_HELP, engine_for, user_errors


@app.command()
@user_errors
def generate(
    model: Annotated[str | None, typer.Option("--model", "-m",
                                              help="Model folder, or bundled: demo (default), demo-fine.")] = None,
    prompt_ids: Annotated[
        list[str] | None, typer.Option("--prompt-ids", help="A prompt as comma-separated token ids; repeatable.")
    ] = None,
    prompt: Annotated[
        list[str] | None, typer.Option("--prompt", help="A text prompt (needs tokenizer.json); repeatable.")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 32,
    engine: Annotated[str | None,
                      typer.Option(help="Engine name (see `pwbench ls engines`; default: full, or static-<method> "
                                        "for a quantized folder).")] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (1 = off).")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely tokens (0 = off).")] = 0,
    seed: Annotated[int, typer.Option(help="Sampling seed (prompt i uses seed + i).")] = 0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Generate exactly --max-new-tokens.")] = False,
    dtype: Annotated[str | None,
                     typer.Option(help="float32 | bfloat16 | float16 (default: float32 on cpu, bf16 on cuda).")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N (default: cuda if present).")] = None,
    budget: Annotated[str | None, typer.Option(help=BUDGET_HELP)] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Engine option key=value; repeatable.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line.")] = False,
) -> None:
    """Generate continuations of one or more prompts, all submitted together."""
    # a bundled model's name (demo, demo-fine) -> its folder; none given: the demo model, as `run` and `serve`
    model = resolve_model(model) or str(demo_model_path())
    from engines.registry import parse_set_options
    from harness.generate import GenerateArgs, parse_prompt_ids, run_generate

    prompts = _ordered_prompts([parse_prompt_ids(p) for p in prompt_ids or []], list(prompt or []))
    if not prompts:
        raise EngineError("give at least one --prompt-ids or --prompt")
    args = GenerateArgs(
        engine=engine_for(engine, model),
        model=model,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        ignore_eos=ignore_eos,
        options={"device": device, "dtype": dtype, "budget_bytes": budget, **parse_set_options(set_ or [])},
    )
    results = run_generate(args)
    if as_json:
        typer.echo(json.dumps({"outputs": results}))
        return
    for i, r in enumerate(results):
        typer.echo(f"[{i}] prompt: {r.get('prompt_text', r['prompt_ids'])}")
        typer.echo(f"    output: {r.get('text', r['output_ids'])}  ({len(r['output_ids'])} "
                   f"tokens, {r['finish_reason']})")


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

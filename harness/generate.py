"""`pwbench generate`: submit a few prompts together to one engine and collect the outputs.

A closed batch through the Engine protocol (no arrivals, no metrics): the quick check that a
model folder loads and an engine produces the tokens one expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engines.base import EngineError, EngineRequest, SamplingParams
from engines.common.tokenizer import load_tokenizer
from harness.calibration import create_calibrated
from harness.offline import run_offline


@dataclass(frozen=True)
class GenerateArgs:
    engine: str
    model: str
    prompts: list[list[int] | str]
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False
    options: dict[str, Any] = field(default_factory=dict)


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise EngineError(f"--prompt-ids expects comma-separated integers, got {text!r}") from None
    if not ids:
        raise EngineError("--prompt-ids got an empty prompt")
    return ids


def run_generate(args: GenerateArgs) -> list[dict[str, Any]]:
    """One dict per prompt, in the order given: prompt_ids, output_ids, finish_reason, text."""
    tokenizer = load_tokenizer(args.model)
    prompts: list[list[int]] = []
    for p in args.prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise EngineError(f"--prompt needs a tokenizer.json in {args.model}; pass --prompt-ids instead")
            prompts.append(tokenizer.encode(p).ids)
        else:
            prompts.append(p)
    if args.max_new_tokens < 1:
        raise EngineError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    options = {k: v for k, v in args.options.items() if v is not None}
    engine = create_calibrated(args.engine, {"model": args.model, **options})
    engine.start()
    try:
        done = run_offline(engine, [
            EngineRequest(str(i), tuple(ids), args.max_new_tokens,
                          SamplingParams(args.temperature, args.top_p, args.top_k, seed=args.seed + i), args.ignore_eos)
            for i, ids in enumerate(prompts)
        ])
    finally:
        engine.stop()
    results = []
    for i, ids in enumerate(prompts):
        out = done[str(i)]
        item: dict[str, Any] = {"prompt_ids": ids, "output_ids": out.output_ids, "finish_reason": out.finish_reason}
        if tokenizer is not None:
            item["prompt_text"] = tokenizer.decode(ids)
            item["text"] = tokenizer.decode(out.output_ids)
        results.append(item)
    return results

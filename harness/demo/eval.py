"""Exact-match accuracy of any engine on the demo tasks, by generation (greedy, stop at EOS).

The held-out examples come from a seed the training never uses. `expert_bits` applies
round-to-nearest quantize-dequantize to every routed expert of the `moe` engine before
evaluation, the quickest way to see how much of a task lives in the experts.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engines.base import EngineRequest
from harness.calibration import create_calibrated
from harness.offline import cut_at_eos, run_offline
from workloads.demo.language import BOS_ID, EOS_ID, demo_language
from workloads.demo.tasks import Sample, closed_book, copy_task, make_sample, score

EVAL_SEED = 424242  # training draws from seeds < 100,000
CLOSED_BOOK_SAMPLES = 1600  # closed-book questions per evaluation (of the 6,400 facts)


@dataclass(frozen=True)
class EvalSpec:
    rag_tokens: tuple[int, int] = (512, 1024)  # the demo workloads' context range
    facts_per_token: float = 1 / 32  # 512 tokens -> 16 facts
    samples: int = 200
    seed: int = EVAL_SEED
    tasks: tuple[str, ...] = ("rag_recall", "chat_recall", "closed_book", "copy")


@dataclass
class EvalResult:
    accuracy: dict[str, float]
    counts: dict[str, int]
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def demo_samples(task: str, spec: EvalSpec, tokens: tuple[int, int] | None = None) -> list[Sample]:
    rng = random.Random(f"{spec.seed}-{task}-{tokens}")
    lo, hi = tokens or spec.rag_tokens
    if task == "closed_book":
        # A seeded quarter of the 6,400 facts (every fact when samples asks for more).
        count = min(len(demo_language().book_facts), max(spec.samples, CLOSED_BOOK_SAMPLES))
        return [Sample("closed_book", "", (pair,)) for pair in closed_book(rng, count).qa]
    if task == "copy":
        return [copy_task(rng, rng.randint(6, 24)) for _ in range(spec.samples)]
    out = []
    for _ in range(spec.samples):
        n_tokens = rng.randint(lo, hi)
        out.append(make_sample(task, rng, num_facts=max(2, round(n_tokens * spec.facts_per_token)),
                               target_tokens=n_tokens))
    return out


def run_samples(engine, samples: list[Sample]) -> tuple[float, list[dict[str, Any]]]:
    lang = demo_language()
    done = run_offline(engine, [EngineRequest(str(i), (BOS_ID, *lang.encode(s.prompt)), len(s.answer.split()) + 2)
                                for i, s in enumerate(samples)])
    rows = []
    for i, s in enumerate(samples):
        text = lang.decode(cut_at_eos(done[str(i)].output_ids, (EOS_ID,)))
        rows.append({"task": s.task, "answer": s.answer, "output": text, "correct": score(text, s.answer)})
    return sum(r["correct"] for r in rows) / max(1, len(rows)), rows


def evaluate(model: str, engine_name: str = "moe", spec: EvalSpec = EvalSpec(), options: dict | None = None,
             expert_bits: int | None = None, progress: Callable[[str], None] | None = None,
             expert_group: int | None = 32) -> EvalResult:
    options = dict(options or {})
    if expert_bits is not None:  # RTN-rounded experts: the moe engine's fake-quantization backend
        options.update(expert_bits=expert_bits, expert_group=expert_group or 0)
    engine = create_calibrated(engine_name, {"model": model, **options})
    engine.start()
    try:
        accuracy, counts, examples = {}, {}, {}
        for task in spec.tasks:
            acc, rows = run_samples(engine, demo_samples(task, spec))
            accuracy[task], counts[task], examples[task] = acc, len(rows), rows[:5]
            if progress:
                progress(f"{task}: {acc:.3f} ({len(rows)} examples)")
        return EvalResult(accuracy, counts, examples)
    finally:
        engine.stop()


def context_curve(model: str, lengths: list[int], spec: EvalSpec = EvalSpec(), engine_name: str = "moe",
                  options: dict | None = None) -> dict[str, dict[int, float]]:
    """Recall accuracy at each context length (±10%), facts scaling with length."""
    engine = create_calibrated(engine_name, {"model": model, **(options or {})})
    engine.start()
    try:
        curve: dict[str, dict[int, float]] = {}
        for task in ("rag_recall", "chat_recall"):
            curve[task] = {}
            for n in lengths:
                samples = demo_samples(task, spec, (int(n * 0.9), n))
                curve[task][n] = run_samples(engine, samples)[0]
        return curve
    finally:
        engine.stop()

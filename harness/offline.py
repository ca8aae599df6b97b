"""The offline driver: submit requests, step until done, collect what each one produced.

One loop for everything that is not a timed run: `pwbench generate`, the demo evaluator,
quality against the reference, lm-eval's scoring and generation, and the runner's warm-up.
Engines see only the Engine protocol. `cut_at_eos` is the one way output ids are cut.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from engines.base import Engine, EngineRequest, StepOutput


@dataclass
class Completion:
    """What one request produced, in order."""

    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logits: list[Any] = field(default_factory=list)  # per generated token, with return_logits
    prompt_logits: Any = None  # with return_prompt_logits


def run_offline(engine: Engine, requests: Iterable[EngineRequest], should_stop: Callable[[], bool] = lambda: False,
                on_step: Callable[[StepOutput], None] | None = None) -> dict[str, Completion]:
    """Submit every request to the started `engine`, step until it has nothing left (or
    `should_stop()`), and return each request's Completion by request id. `on_step` sees each
    StepOutput after it is collected (preemption counts, or a test aborting mid-way)."""
    done: dict[str, Completion] = {}
    for r in requests:
        engine.add_request(r)
        done[r.request_id] = Completion()
    while engine.has_unfinished() and not should_stop():
        out = engine.step()
        for o in out.outputs:
            c = done.setdefault(o.request_id, Completion())
            c.output_ids.extend(o.new_token_ids)
            if o.logits is not None:
                c.logits.append(o.logits)
            if o.prompt_logits is not None:
                c.prompt_logits = o.prompt_logits
            if o.finished:
                c.finish_reason = o.finish_reason
        if on_step is not None:
            on_step(out)
    return done


def cut_at_eos(ids: list[int], eos_ids: Collection[int]) -> list[int]:
    """The ids before the first EOS token (all of them when there is none)."""
    cut = next((i for i, t in enumerate(ids) if t in eos_ids), len(ids))
    return list(ids[:cut])

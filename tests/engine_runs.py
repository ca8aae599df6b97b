"""Helpers the engine tests share: seeded random-token requests, and one engine run offline
(start, step until done, stop) returning its outputs, step records and EngineInfo."""

from __future__ import annotations

import random

from tiny_models import CPU32

from engines.base import EngineRequest, SamplingParams
from harness.calibration import create_calibrated
from harness.offline import run_offline


def random_requests(vocab: int, n: int = 5, new: int = 10, seed: int = 0, lo: int = 3, hi: int = 90,
                    sampling: SamplingParams = SamplingParams()) -> list[EngineRequest]:
    """n requests of random ids in [3, vocab), prompt lengths in [lo, hi), `new` tokens each."""
    rng = random.Random(seed)
    return [EngineRequest(f"r{i}", tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))), new,
                          sampling=sampling, ignore_eos=True) for i in range(n)]


def run_engine(engine, reqs: list[EngineRequest]):
    """(request id -> output ids, the StepOutputs, EngineInfo) of one offline run of `engine`."""
    engine.start()
    steps = []
    try:
        done = run_offline(engine, reqs, on_step=steps.append)
        info = engine.info()
    finally:
        engine.stop()
    return {rid: c.output_ids for rid, c in done.items()}, steps, info


def generate(name: str, model, reqs: list[EngineRequest], **options):
    """run_engine on engine `name` over `model` at float32 on CPU with `options` (calibrated on
    the demo tasks when the engine calibrates and the model is the demo-language one)."""
    return run_engine(create_calibrated(name, {"model": str(model), **CPU32, **options}), reqs)

"""What recording routing costs a measured run: the recording's own time per step of engine moe.

    OMP_NUM_THREADS=1 taskset -c 1 python -m harness.bench.recording [--model FOLDER] [--sequences 1]
                                                                      [--context 700] [--batches 6]

The validation benchmark (harness/bench/simulate.py) records every measured run's routing so its
simulated twin replays it; the recording is the measured side's own time, which no twin pays. One
recording engine moe gets `--batches` batches of `--sequences` prompts of `--context` tokens that
decode 40 tokens each; every step and every call of the recording's hooks (the model's `on_route`,
once per MoE layer, and the engine's per-step `_flush_routing`) is timed on this thread's CPU
time. A difference between a plain and a recording run's steps would drown in this shared host's
drift (tens of percent between seconds); the hooks' own time does not. Prints the median decode
step, the median recording time per decode step and its share.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

DECODE = 40


def timed(fn: Any, spent: list[float]) -> Any:
    """`fn`, its CPU time per call added to `spent[-1]` (the current step's)."""

    def call(*args: Any) -> Any:
        t = time.thread_time()
        try:
            return fn(*args)
        finally:
            spent[-1] += time.thread_time() - t

    return call


def measure(model: str, sequences: int, context: int, batches: int) -> tuple[float, float, int]:
    """(median decode step ms, median recording ms per decode step, MoE layers recorded per step)."""
    from engines.registry import create_engine
    from harness.bench.simulate import add_prompts

    with tempfile.TemporaryDirectory(prefix="pwbench-recording-") as tmp:
        engine = create_engine("moe", {"model": model, "device": "cpu", "record_routing": f"{tmp}/r.parquet"})
        engine.start()
        spent: list[float] = [0.0]
        engine.model.on_route = timed(engine.model.on_route, spent)
        if hasattr(engine, "_flush_routing"):  # (before 2026-12-05 the hooks copied each layer's ids themselves)
            engine._flush_routing = timed(engine._flush_routing, spent)
        rng, steps, recording = random.Random(1), [], []
        try:
            for k in range(batches):
                add_prompts(engine, rng, f"b{k}", [context] * sequences, DECODE)
                engine.step()  # the prefill
                for i in range(DECODE - 1):
                    spent.append(0.0)
                    t = time.thread_time()
                    engine.step()
                    if i >= 2:  # the first decode steps after a prefill are left out
                        steps.append(time.thread_time() - t)
                        recording.append(spent[-1])
            layers = sum(engine.model.config.moe_layers)
        finally:
            engine.stop()
    return statistics.median(steps) * 1e3, statistics.median(recording) * 1e3, layers


def main(argv: list[str] | None = None) -> int:
    from engines.common.demo import demo_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    parser.add_argument("--sequences", type=int, default=1, help="prompts per batch (default 1)")
    parser.add_argument("--context", type=int, default=700, help="prompt tokens (default 700)")
    parser.add_argument("--batches", type=int, default=6, help="batches (default 6)")
    args = parser.parse_args(argv)
    model = args.model or str(demo_model_path())
    if not (Path(model) / "config.json").is_file():
        raise SystemExit(f"--model {model}: no config.json there; give a model folder")
    step, recording, layers = measure(model, args.sequences, args.context, args.batches)
    print(f"{Path(model).name}, {args.sequences} x {args.context} tokens, {layers} MoE layers: decode step "
          f"{step:.3f} ms, of which recording routing {recording * 1e3:.1f} us ({100 * recording / step:.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

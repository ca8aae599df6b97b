"""Calibration prompts for quantization, drawn from a named workload (what `pwbench quantize`
and the quality tests calibrate on): one random window of at most `max_len` tokens from each
of `samples` full-length, seeded prompts. RAG prompts open with the system prompt and passages
they share, so their heads repeat; windows at random offsets avoid fitting those few sequences.
"""

from __future__ import annotations

import random

FULL_LENGTH = 1 << 20  # a model length no workload prompt reaches


def calibration_prompts(model: str, workload: str, samples: int, seed: int, max_len: int) -> list[list[int]]:
    """A random window of at most `max_len` tokens from each of `samples` prompts of `workload`."""
    from engines.base import EngineError, EngineInfo  # noqa: PLC0415
    from engines.runtime.checkpoint import open_checkpoint  # noqa: PLC0415
    from harness.run import uses_demo_language  # noqa: PLC0415
    from workloads.registry import ModelTarget, WorkloadSpec, build_workload  # noqa: PLC0415

    if samples < 1 or max_len < 1:
        raise EngineError(f"--calib-samples and --calib-len must be >= 1, got {samples} and {max_len}")
    cfg = open_checkpoint(model).config
    info = EngineInfo(name="quantize", model=model, architecture=cfg.architecture, device="cpu", dtype="float32",
                      vocab_size=cfg.vocab_size, max_model_len=cfg.max_position_embeddings)
    synthesizer = None
    if workload in ("rag_long", "long_chat") and uses_demo_language(model, info):
        from workloads.demo.synth import DemoTaskSynthesizer  # noqa: PLC0415

        synthesizer = DemoTaskSynthesizer(seed, "rag" if workload == "rag_long" else "chat")
    # Prompts at their natural length (not clipped to the model's): windows are cut below.
    target = ModelTarget(cfg.vocab_size, FULL_LENGTH, tuple(cfg.eos_token_ids))
    built = build_workload(WorkloadSpec(workload, seed=seed, requests=samples), target, synthesizer)
    length = min(max_len, cfg.max_position_embeddings)
    rng = random.Random(seed)
    windows = []
    for r in built.requests:
        start = rng.randrange(len(r.prompt_ids) - length + 1) if len(r.prompt_ids) > length else 0
        windows.append(list(r.prompt_ids[start : start + length]))
    return windows

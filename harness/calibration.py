"""Calibration prompts for quantization, drawn from a named workload (what `pwbench quantize`
and the quality tests calibrate on): one random window of at most `max_len` tokens from each
of `samples` full-length, seeded prompts. RAG prompts open with the system prompt and passages
they share, so their heads repeat; windows at random offsets avoid fitting those few sequences.

`create_calibrated` builds an engine that calibrates at start (Engine.needs_calibration): for
a demo-language model it writes the task mix (RAG and chat prompts, whose questions include
closed-book ones) to a cached JSON file and passes it as `calib_file`; for other models the
engine's own seeded random-token prompts stand.
"""

from __future__ import annotations

import random

from harness.demo_model import demo_synthesizer, uses_demo_language

FULL_LENGTH = 1 << 20  # a model length no workload prompt reaches


def _model_config(model: str):
    """(the folder's ModelConfig, whether it speaks the demo language)."""
    from engines.base import EngineInfo  # noqa: PLC0415
    from engines.runtime.checkpoint import open_checkpoint  # noqa: PLC0415

    cfg = open_checkpoint(model, config_only=True).config  # the config is all it reads
    info = EngineInfo(name="calibration", model=model, architecture=cfg.architecture, device="cpu", dtype="float32",
                      vocab_size=cfg.vocab_size, max_model_len=cfg.max_position_embeddings)
    return cfg, uses_demo_language(model, info)


def calibration_prompts(model: str, workload: str, samples: int, seed: int, max_len: int) -> list[list[int]]:
    """A random window of at most `max_len` tokens from each of `samples` prompts of `workload`."""
    from engines.base import EngineError  # noqa: PLC0415
    from workloads.registry import ModelTarget, WorkloadSpec, build_workload  # noqa: PLC0415

    if samples < 1 or max_len < 1:
        raise EngineError(f"--calib-samples and --calib-len must be >= 1, got {samples} and {max_len}")
    cfg, demo = _model_config(model)
    synthesizer = demo_synthesizer(workload, seed) if demo else None
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


CALIBRATION_MIX = (("rag_long", 12), ("long_chat", 12))  # workload, prompts


def create_calibrated(name: str, options: dict):
    """create_engine(name, options), with `calib_file` filled in for an engine that calibrates
    at start on a demo-language model when the caller gave none."""
    import hashlib  # noqa: PLC0415
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from engines.common.folders import cache_dir  # noqa: PLC0415
    from engines.registry import create_engine, engine_class  # noqa: PLC0415

    cls = engine_class(name)
    model = options.get("model")
    if not cls.needs_calibration or options.get("calib_file") or model is None:
        return create_engine(name, options)
    cfg, demo = _model_config(model)
    if not demo:
        return create_engine(name, options)
    seed = int(options.get("seed", 0) or 0)
    key = hashlib.sha256(json.dumps([str(Path(model).resolve()), CALIBRATION_MIX, seed]).encode()).hexdigest()[:16]
    root = cache_dir("calibration")
    path = root / f"demo-mix-{key}.json"
    if not path.is_file():
        prompts = [p for workload, n in CALIBRATION_MIX
                   for p in calibration_prompts(model, workload, n, seed, cfg.max_position_embeddings)]
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(prompts))
        tmp.replace(path)
    return create_engine(name, {**options, "calib_file": str(path)})

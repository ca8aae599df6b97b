"""Where the bundled demo model lives: engines/demo_model/ (config, safetensors, tokenizer)."""

from __future__ import annotations

from pathlib import Path

from engines.base import ModelLoadError

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "demo_model"


def demo_model_path() -> Path:
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        raise ModelLoadError(
            f"the bundled demo model is missing from this installation ({DEMO_MODEL_DIR}); "
            "train one with `pwbench demo train --output DIR` and pass --model DIR"
        )
    return DEMO_MODEL_DIR

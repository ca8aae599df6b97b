"""What a model folder is, read from its small files only (no torch): which quantization method
made it, and so which engine serves it when the user names none.

A quantized folder says its method in pwbench's quantize report, in llm-compressor's recipe, or
in config.json's quant_method (gptq, awq); a folder that says nothing (compressed-tensors
alone) is served as GPTQ-style packed weights by static-gptq.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPORT_FILE = "quantize_report.json"  # written by `pwbench quantize` beside the weights
# llm-compressor saves its recipe beside the weights: the modifier names the method.
_RECIPE_METHODS = (("GPTQModifier", "gptq"), ("AWQModifier", "awq"), ("QuantizationModifier", "rtn"))
DEFAULT_ENGINE = "full"  # the engine pwbench is named for; the suite compares it with the rest
CACHE_ENV = "PWBENCH_CACHE"


def cache_dir(name: str = "") -> Path:
    """pwbench's cache folder ($PWBENCH_CACHE, else ~/.cache/pwbench), or its subfolder `name`:
    quantized folders, sensitivity tables, calibration prompts, hw.json."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pwbench").expanduser()
    return root / name if name else root


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def quantization_config(folder: str | Path) -> dict | None:
    """config.json's quantization_config, or None (also for a folder that cannot be read:
    the engine that loads it reports that properly)."""
    config = _json(Path(folder).expanduser() / "config.json")
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    return qc if isinstance(qc, dict) and qc else None


def folder_method(folder: str | Path) -> str | None:
    """The method a quantized folder was made with: pwbench's report, llm-compressor's recipe, or
    quant_method (gptq, awq); None when the folder does not say (compressed-tensors alone)."""
    root = Path(folder).expanduser()
    report = _json(root / REPORT_FILE)
    if isinstance(report, dict) and isinstance(report.get("method"), str):
        return report["method"]
    recipe = root / "recipe.yaml"
    if recipe.is_file():
        text = recipe.read_text()
        found = [method for name, method in _RECIPE_METHODS if name in text]
        if found:
            return found[0]
    method = (quantization_config(root) or {}).get("quant_method")
    return method if method in ("gptq", "awq") else None


def engine_for_folder(folder: str | Path | None) -> tuple[str, str | None]:
    """(engine name, a one-line note saying why, or None for the default engine)."""
    if folder is None or quantization_config(folder) is None:
        return DEFAULT_ENGINE, None
    method = folder_method(folder) or "gptq"
    return f"static-{method}", f"{folder} is {method}-quantized: serving it with engine static-{method}"

"""Result folders: written atomically, read back, and summaries recomputed from them.

    results/<run_id>/run.json           schema version, status, config, engine, workload,
                                        environment, summary
                     requests.parquet   one row per request: timestamps, lengths, outputs
                     steps.parquet      one row per engine step
                     telemetry.parquet  the sampler series
                     <name>.parquet     tables the engine adds (Engine.tables(), e.g. expert_bits)
Everything is written into a hidden sibling folder first and renamed into place at the end,
run.json last, so a crash never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from harness.errors import HarnessError

SCHEMA_VERSION = 1


def new_run_id(workload: str, engine: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", workload.split("/")[-1])[:40]
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}-{engine}"


def check_output(target: Path) -> None:
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise HarnessError(f"output folder {target} already exists and is not empty; choose another --output")


_TABLE_NAME = re.compile(r"[a-z][a-z0-9_]{0,40}")
_OWN_TABLES = ("requests", "steps", "telemetry", "run")


def write_run(target: Path, run: dict[str, Any], requests: list[dict], steps: list[dict], telemetry: list[dict],
              tables: dict[str, list[dict]] | None = None) -> Path:
    """`tables`: the engine's own result tables (Engine.tables()), one `<name>.parquet` each."""
    import pandas as pd  # noqa: PLC0415

    tables = tables or {}
    bad = [n for n in tables if not _TABLE_NAME.fullmatch(n) or n in _OWN_TABLES]
    if bad:
        raise HarnessError(f"engine table names {bad} are not allowed (lowercase identifiers, not {_OWN_TABLES})")
    check_output(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name, rows in (("requests", requests), ("steps", steps), ("telemetry", telemetry), *tables.items()):
            pd.DataFrame(rows).to_parquet(tmp / f"{name}.parquet", index=False)
        (tmp / "run.json").write_text(json.dumps(_clean(run), indent=1) + "\n")
        if target.exists():
            target.rmdir()  # empty (check_output made sure)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become null, tuples lists, numpy scalars Python numbers."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_run(folder: Path) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / "run.json"
    if not path.is_file():
        raise HarnessError(f"{folder} is not a complete pwbench result folder (no run.json)")
    try:
        run = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise HarnessError(f"{path}: invalid JSON at line {exc.lineno}") from None
    if run.get("schema_version") != SCHEMA_VERSION:
        raise HarnessError(f"{path}: schema_version {run.get('schema_version')!r}, this pwbench reads {SCHEMA_VERSION}")
    return run


def read_rows(folder: Path, name: str) -> list[dict[str, Any]]:
    """Rows of a parquet file as plain dicts: nulls as None, list columns as lists."""
    import pandas as pd  # noqa: PLC0415

    frame = pd.read_parquet(Path(folder) / f"{name}.parquet")
    rows = frame.to_dict("records")
    for row in rows:
        for key, value in row.items():
            if hasattr(value, "tolist"):
                row[key] = value.tolist()
            elif isinstance(value, float) and math.isnan(value):
                row[key] = None
            elif value is pd.NA:
                row[key] = None
    return rows

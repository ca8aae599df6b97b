"""What a result folder must hold before anything reads it: run.json's fields with their types,
and requests.parquet / steps.parquet readable with the columns the readers use.

`check_folder` returns run.json as a dict or raises one HarnessError naming the file and the
field, so `report`, `compare`, `gate`, `show` and `sweep` never trace back on a damaged file.
It reads parquet footers only (pyarrow metadata), not the rows. No engine, no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.errors import HarnessError
from harness.results import SCHEMA_VERSION, not_complete

# run.json: dotted path -> kind; "?" allows null or absent; "*" is every key of the dict above.
# Only the fields the readers (reports/, `pwbench show`) index; a writer may add more.
_NUM_DICT = {"": "dict", "*": "num?"}
RUN_FIELDS: dict[str, str] = {
    "schema_version": "int", "status": "str", "error": "str?", "seed": "int?",
    "config": "dict?", "config.workload": "dict?", "config.model": "str?", "config.engine": "str?",
    "config.engine_options": "dict?", "config.slo": "dict?", "config.row": "str?", "config.repeat": "int?",
    "engine": "dict", "engine.name": "str", "engine.device": "str?", "engine.dtype": "str?",
    "engine.model_stats": "dict?", "engine.unavailable": "dict?",
    "workload": "dict", "workload.name": "str", "workload.arrival": "str?", "workload.requests": "int?",
    "workload.notes": "list?",
    "environment": "dict?", "environment.peaks": "dict?", "engine_notes": "list?",
    "quality": "dict?", "capacity": "dict?", "stability": "dict?",
    "summary": "dict",
    **{f"summary.{k}": "int" for k in ("completed", "failed", "input_tokens", "output_tokens")},
    "summary.requests": "int?",
    **{f"summary.{k}": "num?" for k in ("duration_s", "requests_per_s", "input_tokens_per_s", "output_tokens_per_s",
                                         "goodput_requests_per_s", "slo_attainment", "peak_concurrency")},
    **{f"summary.{k}{'.' + sub if sub else ''}": kind for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
       for sub, kind in _NUM_DICT.items()},
    "summary.slo": "dict", "summary.slo.*": "num",
    "summary.engine": "dict", "summary.engine.*": "num?",
    "summary.memory": "dict?", "summary.memory.*": "num?", "summary.efficiency": "dict?",
    "summary.efficiency.mbu": "num?", "summary.efficiency.mfu": "num?", "summary.fidelity": "dict?",
    **{f"summary.fidelity.{k}": "num?" for k in ("compared", "identical", "fidelity", "flips_lost", "flips_gained",
                                                  "token_match_mean")},
    "summary.transitions": "dict?", "summary.expert_precision": "dict?", "summary.expert_precision.*": "num?",
    "summary.accuracy": "dict?", "summary.accuracy.*": "dict",
    "summary.accuracy.*.correct": "int", "summary.accuracy.*.total": "int", "summary.accuracy.*.accuracy": "num?",
}
# parquet tables: column -> kind, required whenever the table has rows (an empty table, e.g. the
# steps of an imported run, has no columns at all).
TABLE_COLUMNS: dict[str, dict[str, str]] = {
    "requests": {"request_id": "str", "arrival_s": "num", "finish_s": "num", "token_times_s": "list",
                 "output_ids": "list", "output_tokens": "num", "prompt_tokens": "num"},
    "steps": {"t_s": "num", "duration_s": "num", "prefill_tokens": "num", "decode_tokens": "num"},
}
_KINDS = {"int": "an integer", "num": "a number", "str": "a string", "dict": "an object", "list": "a list"}
_PLURAL = {"num": "numbers", "str": "strings", "list": "lists"}


def _is(kind: str, value: Any) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "num":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"str": str, "dict": dict, "list": list}[kind])


def _values(data: Any, path: list[str], prefix: str = "") -> list[tuple[str, Any, bool]]:
    """(dotted path, value, present) for every match of `path` (with "*") under `data`."""
    if not path:
        return [(prefix, data, True)]
    key, rest = path[0], path[1:]
    if not isinstance(data, dict):
        return []  # the parent's own kind is checked on its own line
    keys = list(data) if key == "*" else [key]
    out = []
    for k in keys:
        name = f"{prefix}.{k}" if prefix else str(k)
        if k in data:
            out += _values(data[k], rest, name)
        elif not rest:
            out.append((name, None, False))
    return out


def check_run_json(run: Any, path: Path) -> dict[str, Any]:
    """run.json's parsed content, checked against RUN_FIELDS; a HarnessError names the field."""
    if not isinstance(run, dict):
        raise HarnessError(f"{path}: expected a JSON object, got {type(run).__name__}; the file is damaged, "
                           "rerun the run")
    if run.get("schema_version") != SCHEMA_VERSION:
        raise HarnessError(f"{path}: schema_version {run.get('schema_version')!r}, this pwbench reads "
                           f"{SCHEMA_VERSION}")
    for field, spec in RUN_FIELDS.items():
        kind, optional = spec.rstrip("?"), spec.endswith("?")
        for name, value, present in _values(run, field.split(".")):
            if (value is None and optional) or (present and _is(kind, value)):
                continue
            got = "missing" if not present else f"got {json.dumps(value)[:40]}"
            raise HarnessError(f"{path}: field {name} must be {_KINDS[kind]}{' or null' if optional else ''}, "
                               f"{got}; the file is damaged, rerun the run")
    return run


def read_run_json(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "run.json"
    if not path.is_file():
        raise not_complete(folder)
    try:
        run = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise HarnessError(f"{path}: invalid JSON at line {exc.lineno}; the file is damaged, rerun the run") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HarnessError(f"{path}: unreadable ({type(exc).__name__}); rerun the run") from None
    return check_run_json(run, path)


def _arrow_kind(kind: str, dtype: Any) -> bool:
    import pyarrow as pa  # noqa: PLC0415  (the CLI starts without pyarrow)

    t = pa.types
    if t.is_null(dtype):  # a column of nulls only (pandas writes all-None columns so)
        return True
    return {"num": lambda: t.is_integer(dtype) or t.is_floating(dtype),
            "str": lambda: t.is_string(dtype) or t.is_large_string(dtype),
            "list": lambda: t.is_list(dtype) or t.is_large_list(dtype)}[kind]()


def check_table(folder: Path, name: str) -> None:
    """`<name>.parquet` exists, its footer reads, and a table with rows has TABLE_COLUMNS[name]."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    path = Path(folder) / f"{name}.parquet"
    if not path.is_file():
        raise HarnessError(f"{path}: missing; the result folder is incomplete, rerun the run")
    try:
        meta = pq.ParquetFile(path)
        schema, rows = meta.schema_arrow, meta.metadata.num_rows
    except Exception as exc:  # noqa: BLE001  (pyarrow raises several types for a bad file)
        raise HarnessError(f"{path}: not a readable parquet file ({type(exc).__name__}); rerun the run") from None
    if not rows:
        return
    for column, kind in TABLE_COLUMNS.get(name, {}).items():
        if column not in schema.names:
            raise HarnessError(f"{path}: column {column} is missing; not a pwbench {name} table, rerun the run")
        dtype = schema.field(column).type
        if not _arrow_kind(kind, dtype):
            raise HarnessError(f"{path}: column {column} must hold {_PLURAL[kind]}, has {dtype}; rerun the run")


def check_folder(folder: Path) -> dict[str, Any]:
    """run.json (checked) of a result folder whose requests and steps tables are readable."""
    run = read_run_json(folder)
    for name in TABLE_COLUMNS:
        check_table(folder, name)
    return run


def unfinished(run: dict[str, Any]) -> str | None:
    """Why a run's numbers are not a whole run's (its status is not complete), else None."""
    if run["status"] == "complete":
        return None
    return f"status {run['status']}" + (f" ({run['error']})" if run.get("error") else "")

"""Trace formats by name: lazy reader targets, detection from a file's first line, read_trace.

Listing or detecting formats imports no reader module and nothing heavy; `read_trace`
imports the one reader it needs. Readers raise only WorkloadError on bad input.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from workloads.base import WorkloadError
from workloads.traces.common import Trace

RAGPULSE_TRACE = "0_trace.jsonl"

# name -> (lazy "module:function" reader, one-line description). A reader is
# `read(path: Path, skip_bad_lines: bool) -> Trace`.
_FORMATS: dict[str, tuple[str, str]] = {
    "mooncake": (
        "workloads.traces.jsonl_formats:read_mooncake",
        "Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids of 512-token blocks",
    ),
    "ragpulse": (
        "workloads.traces.jsonl_formats:read_ragpulse",
        "RAGPulse 0_trace.jsonl + side tables 1_..5_*.jsonl: sessions, per-component ids and lengths",
    ),
    "azure": (
        "workloads.traces.csv_formats:read_azure",
        "Azure LLM inference 2023 CSV: TIMESTAMP (wall clock), ContextTokens, GeneratedTokens",
    ),
    "burstgpt": (
        "workloads.traces.csv_formats:read_burstgpt",
        "BurstGPT CSV: Timestamp (s), Request tokens, Response tokens (0 tokens = a failed request, left out)",
    ),
    "lengths": (
        "workloads.traces.csv_formats:read_lengths",
        "length-only CSV: num_prefill_tokens, num_decode_tokens (optional arrived_at); needs an arrival process",
    ),
    "pwbench": (
        "workloads.traces.jsonl_formats:read_pwbench",
        "pwbench JSONL: a header line, then arrival_s, input_tokens, output_tokens, session_id, blocks",
    ),
}


def list_formats() -> list[tuple[str, str]]:
    """(name, description) pairs, sorted by name."""
    return sorted((name, desc) for name, (_, desc) in _FORMATS.items())


# Formats without fixed columns: the user names them (workloads/traces/generic.py). Never
# detected; `--map` alone picks jsonl or csv from the first line.
GENERIC_FORMATS = ("jsonl", "csv")
_MAP_HINT = "arrival_s=KEY,input_tokens=KEY,output_tokens=KEY[,session_id=KEY]"


def _unknown(what: str, fix: str = f"or any JSONL/CSV file with --format jsonl|csv --map {_MAP_HINT}") -> WorkloadError:
    known = ", ".join(name for name, _ in list_formats())
    return WorkloadError(f"{what}; known formats: {known} (`pwbench trace formats` describes them); {fix}")


def _keys(names: list[str]) -> str:
    from workloads.traces.common import listing

    return listing([str(n) for n in names])


def trace_file(path: Path) -> Path:
    """The file to read: a RAGPulse folder stands for its 0_trace.jsonl."""
    if path.is_dir():
        if (path / RAGPULSE_TRACE).is_file():
            return path / RAGPULSE_TRACE
        raise WorkloadError(f"{path}: is a folder; give a trace file (a RAGPulse folder must hold {RAGPULSE_TRACE})")
    if not path.exists():
        raise WorkloadError(f"{path}: no such file")
    return path


def _first_line(path: Path) -> str:
    try:
        with path.open("rb") as handle:
            for raw in handle:
                raw = raw.strip().removeprefix(b"\xef\xbb\xbf").strip()
                if raw:
                    return raw[:65536].decode("utf-8", errors="replace")
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read ({exc.strerror})") from None
    raise WorkloadError(f"{path}: the file is empty; give a trace with at least one request")


def _first_object(line: str) -> dict | None:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def detect_format(path: Path | str) -> str:
    """The format name, from the first non-blank line (JSON keys or CSV header names).

    JSON lines: `pwbench_trace` -> pwbench; `hash_ids` an object of component lists ->
    ragpulse; timestamp + input_length + output_length -> mooncake. Anything else is an
    error naming the keys seen (name them with --format jsonl --map, or convert the file)."""
    path = trace_file(Path(path))
    line = _first_line(path)
    obj = _first_object(line)
    if obj is not None:
        if "pwbench_trace" in obj:
            return "pwbench"
        if isinstance(obj.get("hash_ids"), dict):
            return "ragpulse"
        if {"timestamp", "input_length", "output_length"} <= obj.keys():
            return "mooncake"
        raise _unknown(
            f"{path}: unknown trace format: a JSON-lines file whose first line has the keys {_keys(list(obj))}",
            f"name them with --format jsonl --map {_MAP_HINT}, or convert the file to pwbench JSONL",
        )
    header = [c.strip().strip('"') for c in line.split(",")]
    columns = {c.lower() for c in header}
    if {"timestamp", "contexttokens", "generatedtokens"} <= columns:
        return "azure"
    if {"request tokens", "response tokens"} <= columns:
        return "burstgpt"
    if {"num_prefill_tokens", "num_decode_tokens"} <= columns:
        return "lengths"
    raise _unknown(
        f"{path}: unknown trace format (first line {line[:60]!r}, as CSV columns: {_keys(header)})",
        f"name them with --format csv --map {_MAP_HINT}, or convert the file to pwbench JSONL",
    )


def read_trace(
    path: Path | str, format: str | None = None, skip_bad_lines: bool = False, columns=None
) -> Trace:
    """Parse a trace file (format auto-detected unless given).

    `columns` (a `--map` text or a generic.ColumnMap) names the columns of a JSONL or CSV file
    in the user's own layout: `format` is then jsonl or csv (detected from the first line if
    None)."""
    path = Path(path)
    if format is not None and format not in _FORMATS and format not in GENERIC_FORMATS:
        raise _unknown(f"unknown trace format {format!r}")
    if columns is not None or format in GENERIC_FORMATS:
        return _read_mapped(path, format, skip_bad_lines, columns)
    name = format or detect_format(path)
    module_name, _, attr = _FORMATS[name][0].partition(":")
    reader = getattr(importlib.import_module(module_name), attr)
    return reader(trace_file(path), skip_bad_lines)


def _read_mapped(path: Path, format: str | None, skip_bad_lines: bool, columns) -> Trace:
    from workloads.traces.generic import parse_map, read_generic

    if format is not None and format not in GENERIC_FORMATS:
        raise WorkloadError(
            f"--map names the columns of --format jsonl or csv; {format} has fixed columns (drop --map, "
            f"or use --format jsonl|csv)"
        )
    path = trace_file(path)
    if columns is None:
        line = _first_line(path)
        obj = _first_object(line)
        seen = (f"the first line has the keys {_keys(list(obj))}" if obj is not None
                else f"the header has the columns {_keys([c.strip() for c in line.split(',')])}")
        raise WorkloadError(
            f"{path}: --format {format} needs --map {_MAP_HINT} naming its columns; {seen}"
        )
    mapping = parse_map(columns) if isinstance(columns, str) else columns
    if format is None:
        format = "jsonl" if _first_object(_first_line(path)) is not None else "csv"
    return read_generic(path, format, mapping, skip_bad_lines)

"""Traces in the user's own JSONL or CSV layout: the user names which column holds what.

`--format jsonl --map arrival_s=start_time_s,input_tokens=prompt_len,output_tokens=output_len`
(or `--format csv --map ...`). Map keys, each `FIELD=COLUMN`:
- input_tokens, output_tokens (required): whole token counts (input >= 1);
- arrival_s (optional): the request's time. Numbers are in `time_unit` (default s); a text
  that is not a number is read as an ISO 8601 date-time (`2024-05-01T12:00:03.25Z`,
  `2023-11-16 18:17:03.9799600`; with an offset it is converted to UTC, without one it is
  taken as is). Times are shifted so that the earliest request arrives at 0, so absolute clocks
  (Unix time, date-times) and relative times (seconds since the start) both work and give the
  same replay. Without arrival_s the trace has no times and a replay needs an arrival process;
- session_id (optional): requests with one id form a session (turns in arrival order);
- blocks (optional): the prompt's prefix block ids in prompt order (JSONL: a list of integers;
  CSV: integers separated by spaces, ';' or '|'), every block `block_tokens` long (default 512);
- end_s (optional): when the request ended, on arrival_s's clock: the gap to the session's next
  request is the think time a dependent replay waits after the answer;
- session_start_s (optional): when the session started, for traces whose arrival_s counts from
  each session's start (workloads/sessions.py detects those and adds the two).
Options in the same map: `time_unit=s|ms|us|ns`, `block_tokens=N`.
JSONL keys may be dotted paths into nested objects (`usage.prompt_tokens`). CSV columns are
matched exactly, else case-insensitively. Extra keys and columns are ignored.
"""

from __future__ import annotations

import datetime
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from workloads.base import WorkloadError
from workloads.traces.common import (
    BLOCK_TOKENS,
    LineError,
    LineLog,
    Trace,
    TraceRow,
    as_count,
    as_ids,
    as_session,
    finish,
    json_object,
    listing,
    parse_rows,
    read_lines,
    show,
)
from workloads.traces.csv_formats import csv_fields, csv_header

GENERIC_FORMATS = {
    "jsonl": "any JSON-lines trace: name its keys with --map "
             "arrival_s=KEY,input_tokens=KEY,output_tokens=KEY[,session_id=KEY]",
    "csv": "any CSV trace with a header: name its columns with --map "
           "arrival_s=COL,input_tokens=COL,output_tokens=COL[,session_id=COL]",
}
FIELDS = ("arrival_s", "input_tokens", "output_tokens", "session_id", "blocks", "end_s", "session_start_s")
REQUIRED = ("input_tokens", "output_tokens")
TIME_UNITS = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
MAP_EXAMPLE = "arrival_s=COLUMN,input_tokens=COLUMN,output_tokens=COLUMN[,session_id=COLUMN][,time_unit=ms]"


@dataclass(frozen=True)
class ColumnMap:
    """Which source column holds each pwbench field, and how to read times and blocks."""

    columns: tuple[tuple[str, str], ...]  # (field, column) in FIELDS order
    time_unit: str = "s"
    block_tokens: int = BLOCK_TOKENS

    def get(self, name: str) -> str | None:
        return dict(self.columns).get(name)


def _map_error(text: str, what: str) -> WorkloadError:
    return WorkloadError(f"--map {text!r}: {what}; use --map {MAP_EXAMPLE}")


def parse_map(text: str) -> ColumnMap:
    """'arrival_s=ts,input_tokens=prompt,output_tokens=completion' -> ColumnMap (WorkloadError if bad)."""
    if not isinstance(text, str) or not text.strip():
        raise _map_error(str(text), "it is empty")
    given: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = (p.strip() for p in part.partition("="))
        if not sep or not key or not value:
            raise _map_error(text, f"{part.strip()!r} is not FIELD=COLUMN")
        if key not in (*FIELDS, "time_unit", "block_tokens"):
            raise _map_error(text,
                             f"unknown field {key!r}; fields: {', '.join(FIELDS)}; options: time_unit, block_tokens")
        if key in given:
            raise _map_error(text, f"{key} is given twice")
        given[key] = value
    missing = [f for f in REQUIRED if f not in given]
    if missing:
        raise _map_error(text, f"it needs {' and '.join(f'{f}=COLUMN' for f in missing)}")
    unit = given.pop("time_unit", "s")
    if unit not in TIME_UNITS:
        raise _map_error(text, f"time_unit {unit!r} is not one of {', '.join(TIME_UNITS)}")
    block_tokens = given.pop("block_tokens", str(BLOCK_TOKENS))
    if not block_tokens.isdigit() or int(block_tokens) < 1:
        raise _map_error(text, f"block_tokens {block_tokens!r} must be a whole number >= 1")
    columns = tuple((f, given[f]) for f in FIELDS if f in given)
    return ColumnMap(columns, unit, int(block_tokens))


# -- values ------------------------------------------------------------------------------------
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_DATE_TIME = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})(?:[ T](\d{2}):(\d{2})(?::(\d{2})(?:[.,](\d{1,9}))?)?)?\s*(Z|[+-]\d{2}:?\d{2})?", re.I
)
_EPOCH = datetime.date(1970, 1, 1).toordinal()


def raw_time(value: Any, name: str) -> tuple[str, int | float]:
    """('number', value in the map's unit) or ('datetime', integer nanoseconds since 1970 UTC)."""
    if isinstance(value, bool) or value is None:
        raise LineError(f"{name} must be a number or a date-time, got {show(value)}")
    if isinstance(value, (int, float)):
        number = value
    elif isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        text = value.strip()
        number = int(text) if re.fullmatch(r"[+-]?\d+", text) else float(text)
    elif isinstance(value, str):
        return "datetime", _date_time_ns(value, name)
    else:
        raise LineError(f"{name} must be a number or a date-time, got {show(value)}")
    if isinstance(number, float) and not math.isfinite(number):
        raise LineError(f"{name} must be a finite number, got {show(value)}")
    return "number", number


def _date_time_ns(text: str, name: str) -> int:
    match = _DATE_TIME.fullmatch(text.strip())
    if not match:
        raise LineError(f"{name} must be a number or an ISO 8601 date-time such as "
                        f"2024-05-01T12:00:03.25Z, got {show(text)}")
    year, month, day, hour, minute, second, fraction, zone = match.groups()
    try:
        ordinal = datetime.date(int(year), int(month), int(day)).toordinal()
        datetime.time(int(hour or 0), int(minute or 0), int(second or 0))
    except ValueError as exc:
        raise LineError(f"{name} {show(text)} is not a valid date-time ({exc})") from None
    seconds = (ordinal - _EPOCH) * 86400 + int(hour or 0) * 3600 + int(minute or 0) * 60 + int(second or 0)
    if zone and zone.upper() != "Z":
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        seconds -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return seconds * 1_000_000_000 + int((fraction or "0").ljust(9, "0"))


def _blocks(value: Any, name: str) -> tuple[int, ...]:
    if isinstance(value, str):  # CSV: "1 2 3", "1;2;3", "1|2|3" (or a JSON list)
        text = value.strip().strip("[]")
        parts = [p for p in re.split(r"[\s;|,]+", text) if p]
        if not all(re.fullmatch(r"\d+", p) for p in parts):
            raise LineError(f"{name} must hold integer block ids separated by spaces, ';' or '|', got {show(value)}")
        value = [int(p) for p in parts]
    return as_ids(value, name)


# -- reading -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Row:
    line: int
    time: tuple[str, int | float] | None
    input_tokens: int
    output_tokens: int
    session_id: str | None
    blocks: tuple[int, ...]
    end: tuple[str, int | float] | None = None
    session_start: tuple[str, int | float] | None = None


def _lookup(obj: dict[str, Any], key: str) -> Any:
    if key in obj:
        return obj[key]
    node: Any = obj
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise LineError(f"missing field {key!r}")
        node = node[part]
    return node


def _has(obj: dict[str, Any], key: str) -> bool:
    try:
        _lookup(obj, key)
    except LineError:
        return False
    return True


def _parse(mapping: ColumnMap, number: int, get) -> _Row:
    """One row from `get(column)` (raises LineError for a missing value)."""
    names = dict(mapping.columns)

    def label(field: str) -> str:
        return f"{names[field]} ({field})" if names[field] != field else field

    time = None
    if "arrival_s" in names:
        time = raw_time(get(names["arrival_s"]), label("arrival_s"))
    inp = as_count(get(names["input_tokens"]), label("input_tokens"), minimum=1)
    out = as_count(get(names["output_tokens"]), label("output_tokens"))
    session = None
    if "session_id" in names:
        raw = get(names["session_id"])
        session = as_session(None if raw == "" else raw, label("session_id"))
    blocks: tuple[int, ...] = ()
    if "blocks" in names:
        blocks = _blocks(get(names["blocks"]), label("blocks"))
        need = math.ceil(inp / mapping.block_tokens)
        if len(blocks) > need:
            raise LineError(
                f"{label('blocks')} has {len(blocks)} blocks but {label('input_tokens')} {inp} fills only {need} "
                f"blocks of {mapping.block_tokens} tokens (set block_tokens=N in --map)"
            )
    end = raw_time(get(names["end_s"]), label("end_s")) if "end_s" in names else None
    start = raw_time(get(names["session_start_s"]), label("session_start_s")) if "session_start_s" in names else None
    return _Row(number, time, inp, out, session, blocks, end, start)


def read_generic(path: Path, fmt: str, mapping: ColumnMap, skip_bad_lines: bool = False) -> Trace:
    """Read `path` as `fmt` ('jsonl' or 'csv') with the user's column map."""
    log = LineLog(str(path), skip_bad_lines)
    lines = read_lines(path, log)
    if fmt == "jsonl":
        rows = _read_jsonl(path, lines, log, mapping)
    elif fmt == "csv":
        rows = _read_csv(path, lines, log, mapping)
    else:
        raise WorkloadError(f"format {fmt!r} has fixed columns; --map applies to --format jsonl or csv")
    trace = finish(path, fmt, _rebase(path, rows, mapping), log,
                   has_sessions=mapping.get("session_id") is not None, block_tokens=mapping.block_tokens)
    return replace(trace, columns=format_map(mapping))


def format_map(mapping: ColumnMap) -> str:
    """The --map text that parses back to `mapping` (recorded with the run and in converted files)."""
    parts = [f"{f}={c}" for f, c in mapping.columns]
    if mapping.time_unit != "s":
        parts.append(f"time_unit={mapping.time_unit}")
    if mapping.block_tokens != BLOCK_TOKENS:
        parts.append(f"block_tokens={mapping.block_tokens}")
    return ",".join(parts)


def _check_columns(path: Path, number: int, mapping: ColumnMap, present: list[str], has, what: str) -> None:
    for field, column in mapping.columns:
        if not has(column):
            raise WorkloadError(
                f"{path}:{number}: --map {field}={column}: no {what[0]} {column!r}; {what[1]} "
                f"{listing(present)} (fix --map)"
            )


def _read_jsonl(path: Path, lines, log: LineLog, mapping: ColumnMap) -> list[_Row]:
    checked = False

    def parse(number: int, text: str) -> _Row:
        nonlocal checked
        obj = json_object(text)
        if not checked:  # the first object says whether the map fits this file at all
            _check_columns(path, number, mapping, list(obj), lambda key: _has(obj, key),
                           ("key", "the first line's keys are"))
            checked = True
        return _parse(mapping, number, lambda key: _lookup(obj, key))

    return parse_rows(lines, log, parse)


def _read_csv(path: Path, lines, log: LineLog, mapping: ColumnMap) -> list[_Row]:
    number, _, header = csv_header(path, lines, log)
    index: dict[str, int] = {}
    for _field, column in mapping.columns:
        exact = [i for i, h in enumerate(header) if h == column]
        loose = [i for i, h in enumerate(header) if h.lower() == column.lower()]
        found = exact or (loose if len(loose) == 1 else [])
        if found:
            index[column] = found[0]
    _check_columns(path, number, mapping, header, lambda column: column in index, ("column", "the header has"))

    def parse(number: int, text: str) -> _Row:
        values = csv_fields(text, header)
        return _parse(mapping, number, lambda column: values[index[column]])

    return parse_rows(lines, log, parse)


def _rebase(path: Path, rows: list[_Row], mapping: ColumnMap) -> list[TraceRow]:
    """Times relative to the earliest request, in seconds; numbers and date-times must not mix."""
    kinds = {r.time[0] for r in rows if r.time is not None}
    if len(kinds) > 1:
        first = {kind: next(r.line for r in rows if r.time is not None and r.time[0] == kind) for kind in kinds}
        raise WorkloadError(
            f"{path}:{first['datetime']}: {mapping.get('arrival_s')} (arrival_s) is a date-time here but a number on "
            f"line {first['number']}; use one kind of time for the whole file"
        )
    divisor = 1_000_000_000 if kinds == {"datetime"} else TIME_UNITS[mapping.time_unit]
    times = [r.time[1] for r in rows if r.time is not None]
    origin = min(times) if times else 0
    starts = [r.session_start[1] for r in rows if r.session_start is not None]
    start_origin = min(starts) if starts else 0
    for name, kind_of in (("end_s", lambda r: r.end), ("session_start_s", lambda r: r.session_start)):
        other = next((r for r in rows if kind_of(r) is not None and kinds and kind_of(r)[0] not in kinds), None)
        if other is not None:
            raise WorkloadError(f"{path}:{other.line}: {mapping.get(name)} ({name}) is a {kind_of(other)[0]} but "
                                f"arrival_s is a {next(iter(kinds))}; use one kind of time for the whole file")
    out = []
    for r in rows:
        arrival = None if r.time is None else (r.time[1] - origin) / divisor
        end = None if r.end is None else max(0.0, (r.end[1] - origin) / divisor)
        start = None if r.session_start is None else (r.session_start[1] - start_origin) / divisor
        out.append(TraceRow(r.line, arrival, r.input_tokens, r.output_tokens, r.session_id, r.blocks,
                            session_start_s=start, end_s=end))
    return out

"""CSV trace formats: Azure LLM inference 2023, BurstGPT, and length-only files.

Each file starts with a header naming its columns; columns are found by name, so extra or
reordered columns are fine. One physical line is one request (no quoted newlines in these
formats). Length-only files (Sarathi/Vidur ShareGPT, arXiv) have no arrival times.
"""

from __future__ import annotations

import csv
import datetime
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from workloads.base import WorkloadError
from workloads.traces.common import (
    LineError,
    LineLog,
    Trace,
    TraceRow,
    as_count,
    as_seconds,
    as_session,
    finish,
    header_was_skipped,
    listing,
    parse_rows,
    read_lines,
)

# "2023-11-16 18:17:03.9799600": 7 fractional digits, more than datetime keeps, so parsed by hand.
_WALL_CLOCK = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")

Parse = Callable[[int, dict[str, str]], TraceRow | None]


def _read_csv(path: Path, skip_bad_lines: bool, fmt: str, required: tuple[str, ...],
              parse: Parse) -> tuple[list[TraceRow], LineLog]:
    """Header first (matched case-insensitively), then `parse` gets each line as {column: text}."""
    log = LineLog(str(path), skip_bad_lines)
    lines = read_lines(path, log)
    number, text, header = csv_header(path, lines, log)
    missing = [c for c in required if c.lower() not in {h.lower() for h in header}]
    if missing:
        raise WorkloadError(
            f"{path}:{number}: a {fmt} CSV header needs the columns {', '.join(required)}; "
            f"missing {', '.join(missing)} (the header is {text[:80]!r})"
        )
    canonical = {h.lower(): h for h in required}
    names = [canonical.get(h.lower(), h) for h in header]

    def parse_line(number: int, text: str) -> TraceRow | None:
        return parse(number, dict(zip(names, csv_fields(text, names))))

    return parse_rows(lines, log, parse_line), log


def csv_header(path: Path, lines: Iterator[tuple[int, str]], log: LineLog) -> tuple[int, str, list[str]]:
    """(line number, text, stripped column names) of the header: the first non-blank line. A
    header that is not CSV, was skipped as not UTF-8, or missing (empty file) is an error."""
    for number, text in lines:
        header_was_skipped(log)
        try:
            return number, text, [c.strip() for c in _split(text)]
        except LineError as exc:
            raise WorkloadError(f"{path}:{number}: bad CSV header ({exc})") from None
    header_was_skipped(log)
    raise WorkloadError(f"{path}: the file is empty; give a trace with at least one request")


def csv_fields(text: str, names: list[str]) -> list[str]:
    """One data line's fields, exactly one per header column."""
    values = _split(text)
    if len(values) != len(names):
        raise LineError(f"expected {len(names)} comma-separated fields ({listing(names)}), got {len(values)}")
    return values


def _split(text: str) -> list[str]:
    try:
        return next(csv.reader([text]))
    except csv.Error as exc:
        raise LineError(f"not a CSV line ({exc})") from None


def read_azure(path: Path, skip_bad_lines: bool = False) -> Trace:
    """Azure 2023: arrival_s = seconds since midnight of the first request's day (naive clock)."""
    day0: list[int] = []  # the first row's date ordinal, set once

    def parse(number: int, row: dict[str, str]) -> TraceRow:
        arrival = _wall_clock_seconds(row["TIMESTAMP"], day0)
        inp = as_count(row["ContextTokens"], "ContextTokens", minimum=1)
        out = as_count(row["GeneratedTokens"], "GeneratedTokens")
        return TraceRow(number, arrival, inp, out)

    rows, log = _read_csv(path, skip_bad_lines, "azure", ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), parse)
    return finish(path, "azure", rows, log)


def _wall_clock_seconds(text: str, day0: list[int]) -> float:
    match = _WALL_CLOCK.fullmatch(text.strip())
    if not match:
        raise LineError(f"TIMESTAMP must look like 2023-11-16 18:17:03.9799600, got {text[:40]!r}")
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    try:
        ordinal = datetime.date(year, month, day).toordinal()
        datetime.time(hour, minute, second)
    except ValueError as exc:
        raise LineError(f"TIMESTAMP {text[:40]!r} is not a valid time ({exc})") from None
    if not day0:
        day0.append(ordinal)
    whole = (ordinal - day0[0]) * 86400 + hour * 3600 + minute * 60 + second
    fraction = match.group(7) or "0"
    # Whole and fractional seconds stay separate until here so the sum is rounded once.
    return whole + int(fraction) / 10 ** len(fraction)


def read_burstgpt(path: Path, skip_bad_lines: bool = False) -> Trace:
    """BurstGPT: a row with 0 request or response tokens is a failed request: counted, left out."""
    failed = 0
    has_session = False

    def parse(number: int, row: dict[str, str]) -> TraceRow | None:
        nonlocal failed, has_session
        arrival = as_seconds(row["Timestamp"], "Timestamp")
        inp = as_count(row["Request tokens"], "Request tokens")
        out = as_count(row["Response tokens"], "Response tokens")
        if inp == 0 or out == 0:
            failed += 1
            return None
        session = as_session(row.get("Session ID") or None, "Session ID")
        has_session = has_session or session is not None
        return TraceRow(number, arrival, inp, out, session)

    rows, log = _read_csv(path, skip_bad_lines, "burstgpt", ("Timestamp", "Request tokens", "Response tokens"), parse)
    dropped = (f"{failed} failed requests (0 request or response tokens) left out",) if failed else ()
    return finish(path, "burstgpt", rows, log, has_sessions=has_session, dropped=dropped)


def read_lengths(path: Path, skip_bad_lines: bool = False) -> Trace:
    """Length-only CSV (Sarathi/Vidur): arrival_s from `arrived_at` when present, else None."""

    def parse(number: int, row: dict[str, str]) -> TraceRow:
        raw = row.get("arrived_at")
        arrival = None if raw is None else as_seconds(raw, "arrived_at")
        inp = as_count(row["num_prefill_tokens"], "num_prefill_tokens", minimum=1)
        out = as_count(row["num_decode_tokens"], "num_decode_tokens")
        return TraceRow(number, arrival, inp, out)

    rows, log = _read_csv(path, skip_bad_lines, "lengths", ("num_prefill_tokens", "num_decode_tokens"), parse)
    return finish(path, "lengths", rows, log)

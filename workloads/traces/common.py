"""The common trace record and the line-level parsing every trace reader shares.

Provides TraceRow / Trace (what a trace file says, before any arrival process, scaling or
prompt synthesis), per-field validators that raise LineError, and LineLog, which turns a
LineError into `WorkloadError("PATH:LINE: what")` or, when skipping, counts it. No numpy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from workloads.base import WorkloadError

# Far beyond any real prompt; a bound keeps a corrupted line from asking for a 10^18-token prompt.
MAX_TOKENS = 10_000_000
MAX_ID = 2**63 - 1  # hash ids feed uint64 arithmetic in the synthesizer
BLOCK_TOKENS = 512  # Mooncake's prefix block size (FAST'25 README)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request as the trace file describes it."""

    line: int  # 1-based line in the source file, for messages
    arrival_s: float | None  # seconds on the trace's own clock; None = the format has no times
    input_tokens: int
    output_tokens: int
    session_id: str | None = None
    # Prompt structure in prompt order: equal ids mean identical token blocks. With
    # `block_lengths` empty every block is the trace's block_tokens long (the last one may be
    # cut by input_tokens); otherwise each id has its own length (RAGPulse components).
    # Tokens after the last block are unique to the request.
    blocks: tuple[int, ...] = ()
    block_lengths: tuple[int, ...] = ()
    block_kinds: tuple[str, ...] = ()  # e.g. "sys_prompt", "passage", "question"; () = unknown
    # When its session started (for traces whose arrival_s counts from the session's start),
    # and when the request ended (same clock as arrival_s: the think time before the next turn)
    session_start_s: float | None = None
    end_s: float | None = None


@dataclass(frozen=True)
class Trace:
    """A parsed trace: rows in arrival order (file order when the format has no times)."""

    path: str
    format: str
    rows: tuple[TraceRow, ...]
    block_tokens: int = BLOCK_TOKENS
    has_sessions: bool = False
    bad_lines: tuple[str, ...] = ()  # "PATH:LINE: what" for each malformed line skipped
    dropped: tuple[str, ...] = ()  # rows left out on purpose, e.g. "3 failed requests (...)"
    # Where the rows came from, when not straight from this file: a converted file's header
    # (source, --map, lines skipped at conversion), for the run's notes
    provenance: tuple[str, ...] = ()
    columns: str | None = None  # the --map text the file was read with (generic JSONL/CSV)

    @property
    def has_arrivals(self) -> bool:
        return any(r.arrival_s is not None for r in self.rows)


def block_spans(
    blocks: tuple[int, ...], lengths: tuple[int, ...], block_tokens: int, input_tokens: int
) -> list[int]:
    """Token length of each block: explicit lengths, or uniform blocks cut by the prompt's end."""
    if lengths:
        return list(lengths)
    return [max(0, min(block_tokens, input_tokens - block_tokens * j)) for j in range(len(blocks))]


class LineError(ValueError):
    """One line is malformed; the message says what (the reader adds path and line)."""


class LineLog:
    """Raises on the first malformed line, or (skip=True) collects it and moves on."""

    def __init__(self, path: str, skip: bool) -> None:
        self.path = path
        self.skip = skip
        self.messages: list[str] = []
        self.seen = 0  # non-blank lines read

    def bad(self, line: int, what: str) -> None:
        message = f"{self.path}:{line}: {what}"
        if not self.skip:
            raise WorkloadError(f"{message} (fix the line, or skip bad lines with --skip-bad-lines)")
        self.messages.append(message)


def header_was_skipped(log: LineLog) -> None:
    """Before a file's header is parsed: a line already skipped (not UTF-8) was the header,
    which cannot be skipped like a request line; say so instead of misreading the next line."""
    if log.messages:
        raise WorkloadError(f"{log.messages[0]}; it is the header line, which cannot be skipped (fix it)")


def read_lines(path: Path, log: LineLog) -> Iterator[tuple[int, str]]:
    """(line number, text) for each non-blank line; a line that is not UTF-8 is a bad line."""
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise WorkloadError(f"{path}: is a folder, not a trace file") from None
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read ({exc.strerror})") from None
    with handle:
        for number, raw in enumerate(handle, 1):
            raw = raw.strip()
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
                raw = raw[3:].strip()
            if not raw:
                continue
            log.seen += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                log.bad(number, "not UTF-8 text")
                continue
            yield number, text


def parse_rows(lines: Iterator[tuple[int, str]], log: LineLog, parse: Callable[[int, str], T | None]) -> list[T]:
    """Apply `parse` to each line; LineError becomes a bad line, None means "left out"."""
    rows = []
    for number, text in lines:
        try:
            row = parse(number, text)
        except LineError as exc:
            log.bad(number, str(exc))
            continue
        if row is not None:
            rows.append(row)
    return rows


def finish(
    path: Path, fmt: str, rows: list[TraceRow], log: LineLog, *, has_sessions: bool = False,
    dropped: tuple[str, ...] = (), block_tokens: int = BLOCK_TOKENS,
) -> Trace:
    """Sort by arrival (stable, so file order breaks ties) and check something was read."""
    if not rows:
        if log.seen == 0:
            raise WorkloadError(f"{path}: the file is empty; give a trace with at least one request")
        why = f"all {len(log.messages)} request lines were malformed" if log.messages else "it holds no requests"
        raise WorkloadError(f"{path}: no usable requests ({why}{'; ' + dropped[0] if dropped else ''})")
    if any(r.arrival_s is not None for r in rows):
        rows = sorted(rows, key=lambda r: r.arrival_s if r.arrival_s is not None else math.inf)
    return Trace(str(path), fmt, tuple(rows), block_tokens, has_sessions, tuple(log.messages), dropped)


def json_object(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except (ValueError, RecursionError):  # an integer with thousands of digits, deep nesting
        raise LineError("not valid JSON (a number too long or nesting too deep)") from None
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def field(obj: dict[str, Any], key: str) -> Any:
    if key not in obj:
        raise LineError(f"missing field {key!r}")
    return obj[key]


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


MAX_SHOWN = 12  # keys or columns listed in a message


def listing(names: list[str]) -> str:
    """Names for a message, at most MAX_SHOWN of them."""
    shown = ", ".join(names[:MAX_SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > MAX_SHOWN else "")


def _number(value: Any, name: str) -> float | int:
    """An int or float from JSON, or a numeric CSV/JSON string; never a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise LineError(f"{name} must be a number, got {show(value)}")
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            raise LineError(f"{name} must be a number, got {show(value)}") from None
    return value


def as_count(value: Any, name: str, minimum: int = 0) -> int:
    """A whole number of tokens in [minimum, MAX_TOKENS]."""
    number = _number(value, name)
    if isinstance(number, float):
        if not number.is_integer():
            raise LineError(f"{name} must be a whole number, got {show(value)}")
        number = int(number)
    if number < 0:
        raise LineError(f"{name} is negative ({number})")
    if number < minimum:
        raise LineError(f"{name} must be at least {minimum}, got {number}")
    if number > MAX_TOKENS:
        raise LineError(f"{name} = {number} is more than {MAX_TOKENS} tokens")
    return number


def as_seconds(value: Any, name: str, divisor: float = 1.0) -> float:
    """A finite, non-negative time, divided by `divisor` (1000 for milliseconds)."""
    number = _number(value, name)
    try:
        seconds = float(number) / divisor
    except OverflowError:  # an integer too large for a float
        seconds = math.inf
    if not math.isfinite(seconds):
        raise LineError(f"{name} must be a finite number, got {show(value)}")
    if seconds < 0:
        raise LineError(f"{name} is negative ({show(value)})")
    return seconds


def as_ids(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise LineError(f"{name} must be a list of integer ids, got {show(value)}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= MAX_ID:
            raise LineError(f"{name} must hold integer ids in [0, 2^63), got {show(item)}")
    return tuple(value)


def as_session(value: Any, name: str = "session_id") -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise LineError(f"{name} must be a string, got {show(value)}")
    return str(value)

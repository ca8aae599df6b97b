"""JSON-lines trace formats: Mooncake, RAGPulse (with its side tables) and pwbench's own.

RAGPulse prompts are rebuilt as system prompt + passages + history + web search + question,
one block per component id with its side-table length. pwbench JSONL, what `trace convert`
writes: a header object, then one request per line (README "Workloads and traces").
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import replace
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
    as_seconds,
    as_session,
    field,
    finish,
    header_was_skipped,
    json_object,
    parse_rows,
    read_lines,
    show,
)

PWBENCH_VERSION = 1


def read_mooncake(path: Path, skip_bad_lines: bool = False) -> Trace:
    """Mooncake FAST'25 traces: `timestamp` in ms, lengths, `hash_ids` of 512-token blocks."""
    log = LineLog(str(path), skip_bad_lines)

    def parse(number: int, text: str) -> TraceRow:
        obj = json_object(text)
        arrival = as_seconds(field(obj, "timestamp"), "timestamp", divisor=1000.0)
        inp = as_count(field(obj, "input_length"), "input_length", minimum=1)
        out = as_count(field(obj, "output_length"), "output_length")
        ids = as_ids(field(obj, "hash_ids"), "hash_ids")
        check_uniform_blocks(ids, inp, BLOCK_TOKENS, "hash_ids", "input_length")
        return TraceRow(number, arrival, inp, out, None, ids)

    return finish(path, "mooncake", parse_rows(read_lines(path, log), log, parse), log)


def check_uniform_blocks(ids: tuple[int, ...], inp: int, block_tokens: int, what: str, length: str) -> None:
    need = math.ceil(inp / block_tokens)
    if len(ids) > need:
        raise LineError(
            f"{what} has {len(ids)} blocks but {length} {inp} fills only {need} blocks of {block_tokens} tokens"
        )


# (key in hash_ids, side table file, id field in that table, block kind), in prompt order.
COMPONENTS = (
    ("sys_prompt", "1_sys_prompt.jsonl", "sys_prompt_id", "sys_prompt"),
    ("passages_ids", "2_passages.jsonl", "passage_id", "passage"),
    ("history", "3_history.jsonl", "history_id", "history"),
    ("web_search", "5_web_search.jsonl", "web_search_id", "web_search"),
    ("user_input", "4_user_input.jsonl", "user_input_id", "question"),
)


def read_ragpulse(path: Path, skip_bad_lines: bool = False) -> Trace:
    """Read `path` (0_trace.jsonl, unsorted, string timestamps) and the side tables beside it.

    The 6-12 template tokens the components do not cover follow them as unique tokens.
    """
    log = LineLog(str(path), skip_bad_lines)
    # Side-table lines skipped count as bad lines of the trace, listed first.
    tables = {key: _side_table(path.parent / table, id_key, log) for key, table, id_key, _ in COMPONENTS}

    def parse(number: int, text: str) -> TraceRow:
        obj = json_object(text)
        arrival = as_seconds(field(obj, "timestamp"), "timestamp")
        inp = as_count(field(obj, "input_length"), "input_length", minimum=1)
        out = as_count(field(obj, "output_length"), "output_length")
        session = as_session(field(obj, "session_id"))
        components = field(obj, "hash_ids")
        if not isinstance(components, dict):
            raise LineError("hash_ids must be an object of component id lists")
        blocks: list[int] = []
        lengths: list[int] = []
        kinds: list[str] = []
        for key, table_name, _, kind in COMPONENTS:
            ids = as_ids(components.get(key, []), f"hash_ids.{key}")
            for block_id in ids:
                if block_id not in tables[key]:
                    raise LineError(f"hash_ids.{key} id {block_id} is not in {table_name}")
                blocks.append(block_id)
                lengths.append(tables[key][block_id])
                kinds.append(kind)
        if sum(lengths) > inp:
            raise LineError(f"components add up to {sum(lengths)} tokens, more than input_length {inp}")
        return TraceRow(number, arrival, inp, out, session, tuple(blocks), tuple(lengths), tuple(kinds))

    rows = parse_rows(read_lines(path, log), log, parse)
    return finish(path, "ragpulse", rows, log, has_sessions=True)


def _side_table(path: Path, id_key: str, trace_log: LineLog) -> dict[int, int]:
    """id -> token length from one side table; an id listed twice with two lengths is a bad line."""
    if not path.is_file():
        raise WorkloadError(
            f"{path}: RAGPulse side table missing; put {path.name} from RAGPulse's data/ folder beside 0_trace.jsonl"
        )
    log = LineLog(str(path), trace_log.skip)
    table: dict[int, int] = {}

    def parse(_: int, text: str) -> None:
        obj = json_object(text)
        (block_id,) = as_ids([field(obj, id_key)], id_key)
        length = as_count(field(obj, "token_length"), "token_length")
        if table.setdefault(block_id, length) != length:
            raise LineError(f"{id_key} {block_id} is listed again with another token_length")

    parse_rows(read_lines(path, log), log, parse)
    trace_log.messages.extend(log.messages)
    return table


def read_pwbench(path: Path, skip_bad_lines: bool = False) -> Trace:
    """pwbench's own JSONL (see README): a header line, then one request per line."""
    log = LineLog(str(path), skip_bad_lines)
    lines = read_lines(path, log)
    header: dict[str, Any] = {}
    for number, text in lines:  # the header is the first non-blank line; it cannot be skipped
        header_was_skipped(log)
        try:
            header = json_object(text)
            version = field(header, "pwbench_trace")
            block_tokens = as_count(header.get("block_tokens", BLOCK_TOKENS), "block_tokens", minimum=1)
        except LineError as exc:
            raise WorkloadError(
                f"{path}:{number}: bad pwbench header ({exc}); the first line must be a header such as "
                f'{{"pwbench_trace": {PWBENCH_VERSION}, "block_tokens": {BLOCK_TOKENS}}} (`pwbench '
                'trace convert` writes one)'
            ) from None
        if version != PWBENCH_VERSION:
            raise WorkloadError(
                f"{path}:{number}: pwbench_trace version {show(version)} is not supported (this pwbench reads "
                f"{PWBENCH_VERSION}); convert the source trace again with `pwbench trace convert`"
            )
        break
    else:
        header_was_skipped(log)
        raise WorkloadError(f"{path}: the file is empty; give a trace with at least one request")

    def parse(number: int, text: str) -> TraceRow:
        obj = json_object(text)
        raw_arrival = field(obj, "arrival_s")
        arrival = None if raw_arrival is None else as_seconds(raw_arrival, "arrival_s")
        inp = as_count(field(obj, "input_tokens"), "input_tokens", minimum=1)
        out = as_count(field(obj, "output_tokens"), "output_tokens")
        ids = as_ids(obj.get("blocks", []), "blocks")
        lengths = tuple(as_count(n, "block_lengths") for n in as_list(obj.get("block_lengths", []), "block_lengths"))
        kinds = as_list(obj.get("block_kinds", []), "block_kinds")
        if not all(isinstance(k, str) for k in kinds):
            raise LineError("block_kinds must be a list of strings")
        if lengths and len(lengths) != len(ids) or kinds and len(kinds) != len(ids):
            raise LineError(f"blocks has {len(ids)} ids; block_lengths and block_kinds must match it")
        if lengths and sum(lengths) > inp:
            raise LineError(f"block_lengths add up to {sum(lengths)}, more than input_tokens {inp}")
        if not lengths:
            check_uniform_blocks(ids, inp, block_tokens, "blocks", "input_tokens")
        times = {key: None if obj.get(key) is None else as_seconds(obj[key], key)
                 for key in ("session_start_s", "end_s")}
        return TraceRow(number, arrival, inp, out, as_session(obj.get("session_id")), ids, lengths, tuple(kinds),
                        **times)

    rows = parse_rows(lines, log, parse)
    has_sessions = bool(header.get("has_sessions", False))
    trace = finish(path, "pwbench", rows, log, has_sessions=has_sessions, block_tokens=block_tokens)
    return replace(trace, provenance=_provenance(header))


def _provenance(header: dict[str, Any]) -> tuple[str, ...]:
    """What a converted file's header says about its source (written by write_pwbench)."""
    source = header.get("source")
    if not isinstance(source, str):
        return ()
    said = f"converted from {source} ({header.get('source_format', '?')})"
    if isinstance(header.get("map"), str):
        said += f" with --map {header['map']}"
    skipped = header.get("skipped_lines")
    if isinstance(skipped, int) and skipped:
        first = header.get("first_skipped")
        said += f"; {skipped} malformed lines skipped at conversion" + (f" (first: {first})" if first else "")
    return (said,)


def as_list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise LineError(f"{name} must be a list, got {show(value)}")
    return value


def row_to_json(row: TraceRow) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "arrival_s": row.arrival_s,
        "input_tokens": row.input_tokens,
        "output_tokens": row.output_tokens,
    }
    if row.session_id is not None:
        obj["session_id"] = row.session_id
    for key, value in (("blocks", row.blocks), ("block_lengths", row.block_lengths), ("block_kinds", row.block_kinds)):
        if value:
            obj[key] = list(value)
    for key, value in (("session_start_s", row.session_start_s), ("end_s", row.end_s)):
        if value is not None:
            obj[key] = value
    return obj


def write_pwbench(trace: Trace, output: Path | str) -> Path:
    """Write `trace` as pwbench JSONL atomically: a temp file beside `output`, then rename."""
    output = Path(output)
    header = {
        "pwbench_trace": PWBENCH_VERSION,
        "source_format": trace.format,
        "source": os.path.basename(trace.path),
        "block_tokens": trace.block_tokens,
        "has_sessions": trace.has_sessions,
    }
    if trace.columns is not None:
        header["map"] = trace.columns
    if trace.bad_lines:
        header["skipped_lines"] = len(trace.bad_lines)
        header["first_skipped"] = trace.bad_lines[0]
    if trace.provenance:  # a converted file converted again keeps what the first header said
        header["converted_from"] = list(trace.provenance)
    try:
        handle = tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=output.parent, prefix=f".{output.name}.", suffix=".tmp", delete=False
        )
    except OSError as exc:
        raise WorkloadError(f"{output}: cannot write here ({exc.strerror}); choose another --output") from None
    try:
        with handle:
            handle.write(json.dumps(header) + "\n")
            for row in trace.rows:
                handle.write(json.dumps(row_to_json(row)) + "\n")
        os.replace(handle.name, output)
    except BaseException as exc:  # also Ctrl-C: never leave a half-written file behind
        Path(handle.name).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise WorkloadError(f"{output}: cannot write ({exc.strerror})") from None
        raise
    return output

"""Property tests: random and corrupted lines fed to every trace reader raise only WorkloadError.

Each example writes a small file of valid lines, some of them corrupted (truncated, random
bytes inserted, a field deleted or given a random JSON/CSV value, not UTF-8), then reads it
with the format forced and detected, strict and skipping. When a trace comes back, its
summary and a replay workload built from it must not fail either.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workloads.base import WorkloadError
from workloads.registry import ModelTarget, WorkloadSpec, build_workload
from workloads.traces.formats import read_trace
from workloads.traces.stats import summarize

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TARGET = ModelTarget(vocab_size=50, max_model_len=64, special_ids=(0, 1))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
counts = st.integers(0, 3000)


@st.composite
def corrupted(draw, line: str, csv: bool, percent: int = 35) -> bytes:
    """`line`, damaged in one of several ways `percent` % of the time, as raw bytes."""
    data = line.encode()
    if draw(st.integers(0, 99)) >= percent:
        return data
    op = draw(st.sampled_from(["truncate", "insert", "field", "drop", "random", "latin1"]))
    if op == "truncate":
        return data[: draw(st.integers(0, len(data)))]
    if op == "insert":
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.binary(min_size=1, max_size=4)) + data[at:]
    if op == "random":
        return draw(st.binary(max_size=40))
    if op == "latin1":
        return line.encode("latin-1", errors="replace") + b"\xff\xfe"
    if op in ("field", "drop"):
        if csv:
            fields = line.split(",")
            at = draw(st.integers(0, len(fields) - 1))
            if op == "drop":
                del fields[at]
            else:
                fields[at] = draw(st.text(max_size=12).filter(lambda t: "\n" not in t and "\r" not in t))
            return ",".join(fields).encode()
        obj = json.loads(line)
        key = draw(st.sampled_from(sorted(obj)))
        if op == "drop":
            del obj[key]
        else:
            obj[key] = draw(json_values)
        return json.dumps(obj).encode()
    return data


def write(folder: Path, name: str, lines: list[bytes]) -> Path:
    path = folder / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def exercise(path: Path, fmt: str) -> None:
    """Every way of reading the file either works or raises WorkloadError."""
    for format_, skip in ((fmt, False), (fmt, True), (None, True)):
        try:
            trace = read_trace(path, format_, skip)
        except WorkloadError:
            continue
        summarize(trace)
        arrival = None if trace.has_arrivals else "offline"
        spec = WorkloadSpec(f"trace:{path}", requests=5, arrival=arrival, trace_format=format_, skip_bad_lines=skip)
        try:
            build_workload(spec, TARGET)
        except WorkloadError:
            pass


def lines_of(draw, valid: st.SearchStrategy, csv: bool) -> list[bytes]:
    rows = draw(st.lists(valid, min_size=1, max_size=6))
    return [draw(corrupted(row, csv)) for row in rows]


mooncake_rows = st.builds(
    lambda ts, inp, out, ids: json.dumps(
        {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids[: -(-inp // 512)]}
    ),
    st.integers(0, 10**7), st.integers(1, 3000), counts, st.lists(st.integers(0, 20), max_size=6),
)


@SETTINGS
@given(st.data())
def test_mooncake_and_pwbench(data):
    with tempfile.TemporaryDirectory() as tmp:
        exercise(write(Path(tmp), "m.jsonl", lines_of(data.draw, mooncake_rows, csv=False)), "mooncake")
        header = json.dumps({"pwbench_trace": 1, "block_tokens": 512, "has_sessions": True})
        pw_rows = st.builds(
            lambda t, inp, out, s, ids: json.dumps(
                {"arrival_s": t, "input_tokens": inp, "output_tokens": out, "session_id": s,
                 "blocks": ids[: -(-inp // 512)]}
            ),
            st.none() | st.floats(0, 1e6), st.integers(1, 3000), counts, st.none() | st.text(max_size=4),
            st.lists(st.integers(0, 9), max_size=4),
        )
        lines = [data.draw(corrupted(header, csv=False, percent=10))] + lines_of(data.draw, pw_rows, csv=False)
        exercise(write(Path(tmp), "p.jsonl", lines), "pwbench")


CSV_FORMATS = {
    "azure": (
        "TIMESTAMP,ContextTokens,GeneratedTokens",
        st.builds(lambda s, i, o: f"2023-11-16 18:17:{s:010.7f},{i},{o}", st.floats(0, 59.9), st.integers(1, 9000),
                  counts),
    ),
    "burstgpt": (
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
        st.builds(lambda t, i, o: f"{t},GPT-4,{i},{o},{i + o},API log", st.integers(0, 10**6), counts, counts),
    ),
    "lengths": (
        "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio",
        st.builds(lambda i, o: f"{i},{o},{i + o},{i / max(o, 1)}", st.integers(1, 9000), counts),
    ),
}


@SETTINGS
@given(st.sampled_from(sorted(CSV_FORMATS)), st.data())
def test_csv_formats(fmt, data):
    header, rows = CSV_FORMATS[fmt]
    lines = [data.draw(corrupted(header, csv=True, percent=10))] + lines_of(data.draw, rows, csv=True)
    with tempfile.TemporaryDirectory() as tmp:
        exercise(write(Path(tmp), "t.csv", lines), fmt)


SIDE_TABLES = {  # file -> (id field, ids used); ranges kept apart as in the real trace
    "1_sys_prompt.jsonl": ("sys_prompt_id", range(0, 3)),
    "2_passages.jsonl": ("passage_id", range(10, 16)),
    "3_history.jsonl": ("history_id", range(20, 23)),
    "4_user_input.jsonl": ("user_input_id", range(30, 33)),
    "5_web_search.jsonl": ("web_search_id", range(40, 42)),
}


@SETTINGS
@given(st.data())
def test_ragpulse(data):
    def pick(ids: range) -> st.SearchStrategy:
        known = st.sampled_from(list(ids))
        return st.lists(st.one_of(*[known] * 9, st.just(999)), max_size=3)  # 999 is in no table

    rows = st.builds(
        lambda t, inp, out, parts, s: json.dumps(
            {"timestamp": str(t), "input_length": inp, "output_length": out, "session_id": s,
             "hash_ids": dict(zip(("sys_prompt", "passages_ids", "history", "user_input", "web_search"), parts))}
        ),
        st.integers(0, 10**6), st.integers(1, 20000), counts,
        st.tuples(*(pick(ids) for _, ids in SIDE_TABLES.values())), st.text(max_size=4),
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        missing = data.draw(st.one_of(st.none(), st.none(), st.none(), st.sampled_from(sorted(SIDE_TABLES))))
        for name, (key, ids) in SIDE_TABLES.items():
            if name == missing:
                continue
            table = [json.dumps({key: i, "token_length": data.draw(st.integers(0, 512))}) for i in ids]
            write(folder, name, [data.draw(corrupted(line, csv=False, percent=5)) for line in table])
        exercise(write(folder, "0_trace.jsonl", lines_of(data.draw, rows, csv=False) + [b""]), "ragpulse")

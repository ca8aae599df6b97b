"""One malformed line in each trace format the readers support (`pwbench trace formats`).

For every format a small file is written here with good lines, a blank line (line numbers
are physical lines, blanks included) and one bad line at a known number. `pwbench trace info`
must exit 2 with exactly one stderr line `error: PATH:LINE: what (fix ...)`; the reader raises
WorkloadError with the same text in-process; `--skip-bad-lines` reads the good rows and
reports the bad one. Mooncake also has fresh-interpreter cases in test_trace_cli_errors.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harness.cli.trace import trace_app
from workloads.base import WorkloadError
from workloads.traces.formats import list_formats, read_trace

FIX = "(fix the line, or skip bad lines with --skip-bad-lines)"


def j(obj) -> str:
    return obj if isinstance(obj, str) else json.dumps(obj)


MOONCAKE = {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}
RAG = {
    "timestamp": "5", "input_length": 40, "output_length": 7, "session_id": "s1",
    "hash_ids": {"sys_prompt": [1], "passages_ids": [10], "history": [20], "user_input": [30], "web_search": []},
}
RAG_TABLES = {  # side table -> its lines; the ids RAG uses are all present
    "1_sys_prompt.jsonl": [{"sys_prompt_id": 1, "token_length": 12}],
    "2_passages.jsonl": [{"passage_id": 10, "token_length": 9}],
    "3_history.jsonl": [{"history_id": 20, "token_length": 11}],
    "4_user_input.jsonl": [{"user_input_id": 30, "token_length": 3}],
    "5_web_search.jsonl": [{"web_search_id": 40, "token_length": 4}],
}
PW_HEADER = {"pwbench_trace": 1, "block_tokens": 512, "has_sessions": False}
PW = {"arrival_s": 1.5, "input_tokens": 700, "output_tokens": 3, "blocks": [4, 5]}
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
AZURE = "2023-11-16 18:17:03.9799600,1469,13"
BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"
BURST = "822291,ChatGPT,64,4,68,API log"
LENGTHS_HEADER = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio"
LENGTHS = "1730,415,2145,4.17"
TIMED_LENGTHS_HEADER = "arrived_at,num_prefill_tokens,num_decode_tokens"

# case -> (format, file name, header lines, bad line, what the message must say).
# The file is: header lines, a good row, a blank line, the bad line, a good row.
CASES = {
    "mooncake hash_ids not a list": ("mooncake", "t.jsonl", [], {**MOONCAKE, "hash_ids": "1,2"},
                                     "hash_ids must be a list of integer ids"),
    "mooncake more blocks than tokens": ("mooncake", "t.jsonl", [], {**MOONCAKE, "input_length": 512},
                                         "hash_ids has 2 blocks but input_length 512 fills only 1"),
    "mooncake zero input": ("mooncake", "t.jsonl", [], {**MOONCAKE, "input_length": 0, "hash_ids": []},
                            "input_length must be at least 1, got 0"),
    "ragpulse bad JSON": ("ragpulse", "0_trace.jsonl", [], '{"timestamp": "7", "input_length": 40', "not valid JSON"),
    "ragpulse missing session_id": ("ragpulse", "0_trace.jsonl", [],
                                    {k: v for k, v in RAG.items() if k != "session_id"}, "missing field 'session_id'"),
    "ragpulse hash_ids not an object": ("ragpulse", "0_trace.jsonl", [], {**RAG, "hash_ids": [1, 10]},
                                        "hash_ids must be an object of component id lists"),
    "ragpulse unknown passage id": ("ragpulse", "0_trace.jsonl", [],
                                    {**RAG, "hash_ids": {**RAG["hash_ids"], "passages_ids": [11]}},
                                    "hash_ids.passages_ids id 11 is not in 2_passages.jsonl"),
    "ragpulse components too long": ("ragpulse", "0_trace.jsonl", [], {**RAG, "input_length": 30},
                                     "components add up to 35 tokens, more than input_length 30"),
    "ragpulse negative output": ("ragpulse", "0_trace.jsonl", [], {**RAG, "output_length": -1},
                                 "output_length is negative (-1)"),
    "azure negative context": ("azure", "t.csv", [AZURE_HEADER], "2023-11-16 18:17:04.1000000,-3,5",
                               "ContextTokens is negative (-3)"),
    "azure bad timestamp": ("azure", "t.csv", [AZURE_HEADER], "16/11/2023 18:17,10,5",
                            "TIMESTAMP must look like 2023-11-16 18:17:03.9799600"),
    "azure missing field": ("azure", "t.csv", [AZURE_HEADER], "2023-11-16 18:17:04.1000000,10",
                            "expected 3 comma-separated fields"),
    "azure fractional tokens": ("azure", "t.csv", [AZURE_HEADER], "2023-11-16 18:17:04.1000000,10,2.5",
                                "GeneratedTokens must be a whole number, got '2.5'"),
    "burstgpt wrong type": ("burstgpt", "t.csv", [BURST_HEADER], "822292,ChatGPT,abc,4,68,API log",
                            "Request tokens must be a number, got 'abc'"),
    "burstgpt negative time": ("burstgpt", "t.csv", [BURST_HEADER], "-5,ChatGPT,64,4,68,API log",
                               "Timestamp is negative"),
    "lengths missing field": ("lengths", "t.csv", [LENGTHS_HEADER], "1730,415", "expected 4 comma-separated fields"),
    "lengths negative decode": ("lengths", "t.csv", [LENGTHS_HEADER], "1730,-415,1315,-4.17",
                                "num_decode_tokens is negative (-415)"),
    "lengths bad arrived_at": ("lengths", "t.csv", [TIMED_LENGTHS_HEADER], "soon,1730,415",
                               "arrived_at must be a number, got 'soon'"),
    "pwbench bad JSON": ("pwbench", "t.jsonl", [j(PW_HEADER)], '{"arrival_s": 1.5, "input_tokens": 7',
                         "not valid JSON"),
    "pwbench missing input_tokens": ("pwbench", "t.jsonl", [j(PW_HEADER)], {"arrival_s": 2.0, "output_tokens": 3},
                                     "missing field 'input_tokens'"),
    "pwbench block_lengths mismatch": ("pwbench", "t.jsonl", [j(PW_HEADER)], {**PW, "block_lengths": [512]},
                                       "blocks has 2 ids; block_lengths and block_kinds must match it"),
    "pwbench string arrival": ("pwbench", "t.jsonl", [j(PW_HEADER)], {**PW, "arrival_s": "noon"},
                               "arrival_s must be a number, got 'noon'"),
}
GOOD = {"mooncake": MOONCAKE, "ragpulse": RAG, "azure": AZURE, "burstgpt": BURST, "lengths": LENGTHS, "pwbench": PW}
GOOD_FOR_HEADER = {TIMED_LENGTHS_HEADER: "0.5,1730,415"}


def write_case(tmp_path: Path, case: str) -> tuple[Path, int]:
    """The case's file (and RAGPulse side tables); returns (path, bad line number)."""
    fmt, name, header, bad, _ = CASES[case]
    good = GOOD_FOR_HEADER.get(header[0] if header else "", j(GOOD[fmt]))
    lines = [*header, good, "", j(bad), good]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    if fmt == "ragpulse":
        for table, rows in RAG_TABLES.items():
            (tmp_path / table).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, len(header) + 3


def info(*args):
    return CliRunner().invoke(trace_app, ["info", *map(str, args)])


def the_error_line(result) -> str:
    """Exit 2, exactly one non-empty stderr line (a trailing newline aside), no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert isinstance(result.exception, SystemExit), result.exception  # not an uncaught error
    assert "Traceback" not in result.stderr
    lines = result.stderr.removesuffix("\n").split("\n")
    assert len(lines) == 1 and lines[0].strip(), result.stderr
    assert result.stdout == ""
    return lines[0]


def test_every_format_has_a_case():
    assert {fmt for fmt, *_ in CASES.values()} == {name for name, _ in list_formats()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_bad_line_is_one_error_naming_file_line_and_fix(tmp_path, case):
    fmt, *_, what = CASES[case]
    path, number = write_case(tmp_path, case)
    line = the_error_line(info(path))  # the format is detected from the first line
    assert line.startswith(f"error: {path}:{number}: {what}") and line.endswith(FIX), line
    with pytest.raises(WorkloadError) as caught:
        read_trace(path, fmt)
    assert f"error: {caught.value}" == line


@pytest.mark.parametrize("case", sorted(CASES))
def test_skipping_keeps_the_good_rows_and_reports_the_bad_one(tmp_path, case):
    fmt, *_, what = CASES[case]
    path, number = write_case(tmp_path, case)
    trace = read_trace(path, fmt, skip_bad_lines=True)
    assert len(trace.rows) == 2 and trace.format == fmt
    assert [r.line for r in trace.rows] == [number - 2, number + 1]
    assert len(trace.bad_lines) == 1 and trace.bad_lines[0].startswith(f"{path}:{number}: {what}")
    result = info(path, "--skip-bad-lines", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[-1])["bad_lines_skipped"] == 1
    assert result.stderr.splitlines() == [f"skipped {trace.bad_lines[0]}"]


def test_ragpulse_bad_side_table_line_names_the_side_table(tmp_path):
    path, _ = write_case(tmp_path, "ragpulse bad JSON")
    path.write_text(json.dumps(RAG) + "\n")
    table = tmp_path / "3_history.jsonl"
    table.write_text(json.dumps({"history_id": 20,
                                 "token_length": 11}) + "\n\n" + json.dumps({"history_id": 21}) + "\n")
    line = the_error_line(info(tmp_path))  # the folder stands for its 0_trace.jsonl
    assert line == f"error: {table}:3: missing field 'token_length' {FIX}"


@pytest.mark.parametrize(
    "first, needle",
    [
        ('{"pwbench": 1}',
         "bad pwbench header (missing field 'pwbench_trace'); the first line must be a header such as"),
        ('{"pwbench_trace": 2}',
         "pwbench_trace version 2 is not supported (this pwbench reads 1); convert the source trace again"),
    ],
)
def test_bad_pwbench_header_names_line_one_and_the_fix(tmp_path, first, needle):
    path = tmp_path / "t.jsonl"
    path.write_text(first + "\n" + json.dumps(PW) + "\n")
    line = the_error_line(info(path, "--format", "pwbench"))
    assert line.startswith(f"error: {path}:1: {needle}"), line
    assert "pwbench trace convert" in line


@pytest.mark.parametrize("fmt, header",
                         [("azure", "TIMESTAMP,ContextTokens"), ("burstgpt", "Timestamp,Request tokens"),
                          ("lengths", "num_prefill_tokens")])
def test_csv_header_missing_a_column_names_it(tmp_path, fmt, header):
    path = tmp_path / "t.csv"
    path.write_text(header + "\n1,2\n")
    line = the_error_line(info(path, "--format", fmt))
    assert line.startswith(f"error: {path}:1: a {fmt} CSV header needs the columns "), line
    assert "missing " in line


@pytest.mark.parametrize(
    "fmt, header, row",
    [("azure", AZURE_HEADER, AZURE), ("burstgpt", BURST_HEADER, BURST), ("lengths", LENGTHS_HEADER, LENGTHS),
     ("pwbench", j(PW_HEADER), j(PW))],
)
def test_a_header_that_is_not_utf8_is_not_skipped(tmp_path, fmt, header, row):
    """--skip-bad-lines skips bad request lines, not the header: a non-UTF-8 header is an error
    at line 1 (before the fix, the next row was taken for the header and blamed at line 2)."""
    path = tmp_path / "t.txt"
    path.write_bytes(header.encode() + b"\xff\n" + row.encode() + b"\n")
    line = the_error_line(info(path, "--format", fmt, "--skip-bad-lines"))
    assert line == f"error: {path}:1: not UTF-8 text; it is the header line, which cannot be skipped (fix it)"
    path.write_bytes(header.encode() + b"\xff\n")  # nothing after it: not "the file is empty"
    assert the_error_line(info(path, "--format", fmt, "--skip-bad-lines")) == line

"""Bad trace input through the CLI, in a fresh interpreter: one `error:` line naming PATH:LINE,
exit code 2, no traceback, and no output file left behind by `convert`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}


def jsonl(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def assert_one_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code exactly 2 (a user error), stderr exactly one non-empty `error:` line (a
    trailing newline aside), no traceback anywhere, and each needle in that line."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr
    lines = proc.stderr.removesuffix("\n").split("\n")
    assert len(lines) == 1 and lines[0].strip() and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


MALFORMED = {
    "bad JSON": ('{"timestamp": 1, "input_length": 5', "not valid JSON"),
    "missing field": ({"timestamp": 1, "input_length": 5, "hash_ids": []}, "missing field 'output_length'"),
    "negative length": ({**GOOD, "input_length": -3}, "input_length is negative"),
    "non-numeric timestamp": ({**GOOD, "timestamp": "noon"}, "timestamp must be a number"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_line_stops_with_path_and_line(trace_cli, tmp_path, case):
    bad, what = MALFORMED[case]
    path = tmp_path / "trace.jsonl"
    path.write_text(jsonl(GOOD, GOOD, bad, GOOD))
    assert_one_error(trace_cli("info", path, "--format", "mooncake"), f"{path}:3:", what)
    out = tmp_path / "out.jsonl"
    assert_one_error(trace_cli("convert", path, "--output", out), f"{path}:3:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.jsonl"]  # nothing written, no temp file


def test_skip_bad_lines_counts_and_reports(trace_cli, tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(jsonl(GOOD, MALFORMED["bad JSON"][0], GOOD, MALFORMED["negative length"][0]))
    proc = trace_cli("info", path, "--json", "--skip-bad-lines")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.splitlines()[-1])
    assert (info["requests"], info["bad_lines_skipped"]) == (2, 2)
    assert [line.split(": ")[0] for line in proc.stderr.splitlines()] == [f"skipped {path}:2", f"skipped {path}:4"]


@pytest.mark.parametrize(
    "content, needle",
    [
        ("", "the file is empty"),
        ("\n\n  \n", "the file is empty"),
        ("hello,world\n1,2\n", "unknown trace format"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no usable requests"),
    ],
)
def test_file_level_errors(trace_cli, tmp_path, content, needle):
    path = tmp_path / "trace.txt"
    path.write_text(content)
    line = assert_one_error(trace_cli("info", path), str(path), needle)
    if needle == "unknown trace format":  # the message lists the known formats
        assert all(name in line for name in ("mooncake", "ragpulse", "azure", "burstgpt", "lengths", "pwbench"))


def test_unknown_format_option_lists_formats(trace_cli, tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(jsonl(GOOD))
    assert_one_error(trace_cli("info", path, "--format", "parquet"), "'parquet'", "mooncake", "ragpulse")


def test_missing_file(trace_cli, tmp_path):
    assert_one_error(trace_cli("info", tmp_path / "nope.jsonl"), "no such file")


def test_ragpulse_missing_side_table(trace_cli, tmp_path, real_trace):
    source = real_trace("ragpulse")
    folder = tmp_path / "ragpulse"
    folder.mkdir()
    for file in source.iterdir():  # links, not copies: the traces stay where they are
        if file.name != "2_passages.jsonl":
            (folder / file.name).symlink_to(file)
    assert_one_error(trace_cli("info", folder), "2_passages.jsonl", "side table missing")
    out = tmp_path / "out.jsonl"
    assert_one_error(trace_cli("convert", folder / "0_trace.jsonl", "-o", out))
    assert not out.exists()


def test_help_imports_nothing_heavy():
    probe = (
        "import sys\nfrom harness.cli.trace import trace_app\n"
        "try:\n    trace_app(['info', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('heavy:', *(m for m in ('numpy', 'pandas', 'torch') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].strip() == "heavy:"

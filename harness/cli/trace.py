"""`pwbench trace info|convert`: summarise a trace file, or convert it to pwbench JSONL.

`trace_app` is a typer app for harness/cli.py to mount as `trace`. Commands import the
readers (and numpy) inside their bodies, so `--help` stays fast. A bad trace is one
`error:` line on stderr and exit code 2, as for every pwbench user error.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from harness.cli.common import print_columns, user_errors

trace_app = typer.Typer(
    help="Inspect request traces and convert them to pwbench JSONL.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

FormatOption = Annotated[
    str | None,
    typer.Option("--format",
                 help="Trace format (default: detected from the file's first line); jsonl or csv with --map."),
]
MapOption = Annotated[
    str | None,
    typer.Option(
        "--map",
        help="Your own JSONL/CSV layout: which key or column holds each field, e.g. arrival_s=start_time_s,"
        "input_tokens=prompt_len,output_tokens=output_len[,session_id=sid][,time_unit=ms]. Times may be "
        "absolute (Unix time, ISO 8601) or relative: they are shifted to start at 0.",
    ),
]
SkipOption = Annotated[
    bool, typer.Option("--skip-bad-lines", help="Skip malformed lines, count them and report them at the end.")
]
MAX_LISTED = 10  # skipped lines listed one by one; the rest are counted


def _report_skipped(trace) -> None:
    for message in trace.bad_lines[:MAX_LISTED]:
        typer.echo(f"skipped {message}", err=True)
    if len(trace.bad_lines) > MAX_LISTED:
        typer.echo(f"skipped {len(trace.bad_lines) - MAX_LISTED} more malformed lines", err=True)
    for note in trace.dropped:
        typer.echo(f"left out: {note}", err=True)


def _number(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}{unit}" if float(value).is_integer() else f"{value:,.1f}{unit}"


@trace_app.command("formats")
def formats() -> None:
    """List the trace formats pwbench reads, one per line; jsonl and csv (your own layout) need --map."""
    from workloads.traces.formats import list_formats
    from workloads.traces.generic import GENERIC_FORMATS

    print_columns([*list_formats(), *((f"{name} --map", text) for name, text in GENERIC_FORMATS.items())])


@trace_app.command("info")
@user_errors
def info(
    path: Annotated[str, typer.Argument(help="Trace file (a RAGPulse folder stands for its 0_trace.jsonl).")],
    format: FormatOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line.")] = False,
    skip_bad_lines: SkipOption = False,
    columns: MapOption = None,
) -> None:
    """Summarise a trace: requests, duration, token lengths, sessions, prefix reuse."""
    from workloads.traces.formats import read_trace
    from workloads.traces.stats import summarize

    trace = read_trace(path, format, skip_bad_lines, columns)
    summary = summarize(trace)
    _report_skipped(trace)
    if as_json:
        typer.echo(json.dumps(summary.as_dict()))
        return
    rows = [
        ("format", summary.format),
        *(("source", said) for said in summary.provenance),
        ("requests", f"{summary.requests:,}"),
        ("duration", _number(summary.duration_s, " s") if summary.duration_s is not None else "- (no arrival times)"),
    ]
    for label, stats in (("input tokens", summary.input_tokens), ("output tokens", summary.output_tokens)):
        rows.append((label,
                     f"mean {_number(stats.mean)}  p50 {_number(stats.p50)}  p99 "
                     f"{_number(stats.p99)}  max {stats.max:,}"))
    rows.append(("sessions", f"{summary.sessions:,}" if summary.sessions is not None else "- (the format has none)"))
    if summary.prefix_blocks is None:
        rows.append(("prefix blocks", "- (the format has none)"))
    else:
        rows.append((
            "prefix blocks",
            f"{summary.prefix_blocks:,} references, {summary.prefix_repeat_share:.1%} repeat an earlier id "
            f"({summary.repeated_token_share:.1%} of prompt tokens)",
        ))
    if summary.later_turns is not None:
        rows.append((
            "session reuse",
            f"inferred (no block ids): {summary.extending_turns:,} of {summary.later_turns:,} later turns hold the "
            f"previous turn's prompt + answer; {summary.inferred_reuse_share:.1%} of prompt tokens repeat the "
            f"previous prompt, {summary.inferred_answer_share:.1%} its answer",
        ))
    if summary.session_relative:
        rows.append(("session clock", "relative: every session starts at 0 (the arrival column counts from each "
                                      "session's start); a replay places the sessions and says how"))
    if summary.bad_lines_skipped:
        rows.append(("skipped", f"{summary.bad_lines_skipped:,} malformed lines"))
    print_columns(rows)


@trace_app.command("convert")
@user_errors
def convert(
    path: Annotated[str, typer.Argument(help="Trace file in any supported format.")],
    output: Annotated[str, typer.Option("--output", "-o", help="The pwbench JSONL file to write.")],
    format: FormatOption = None,
    skip_bad_lines: SkipOption = False,
    columns: MapOption = None,
) -> None:
    """Convert a trace to pwbench JSONL (written to a temp file, then renamed into place)."""
    from workloads.traces.formats import read_trace
    from workloads.traces.jsonl_formats import write_pwbench

    trace = read_trace(path, format, skip_bad_lines, columns)
    _report_skipped(trace)
    written = write_pwbench(trace, output)
    typer.echo(f"wrote {len(trace.rows):,} requests ({trace.format} -> pwbench) to {written}")

"""`pwbench run` (replay a workload against an engine into a result folder) and `pwbench show`.

The work happens in harness/run.py; harness/cli/run_session.py turns the options into RunArgs
and owns the progress display and Ctrl-C. Both are imported when the command runs.
"""

from __future__ import annotations

from typing import Annotated

import typer

from engines.common.demo import resolve_model
from engines.common.folders import engine_for_folder
from harness.cli.apps import app
from harness.cli.common import BUDGET_HELP, engine_for, user_errors


@app.command("run")
@user_errors
def run(
    workload: Annotated[str,
                        typer.Option(help="Named workload (see `pwbench ls workloads`) or trace:PATH.")] = "rag_long",
    engine: Annotated[str | None,
                      typer.Option(help="Engine name (see `pwbench ls engines`). Default: with --workload rag_long, "
                                        "the PoC suite (every suite engine under one --budget, then the HTML report); "
                                        "otherwise full, or static-<method> for a quantized folder.")] = None,
    model: Annotated[str | None, typer.Option(help="Model folder, or bundled: demo (default), demo-fine.")] = None,
    requests: Annotated[int | None, typer.Option(help="At most this many requests.")] = None,
    duration: Annotated[float | None, typer.Option(help="Admit requests only during this many seconds.")] = None,
    rate: Annotated[float | None,
                    typer.Option(help="Open loop: mean requests per second; the first --requests N arrive over about N "
                                      "/ rate seconds (session workloads: sessions start at the rate that makes "
                                      "their turns add up to it).")] = None,
    concurrency: Annotated[int | None, typer.Option(help="Closed loop: this many users.")] = None,
    time_scale: Annotated[float | None,
                          typer.Option(help="Multiply trace times and think times (0.1 = "
                                            "10x faster; default 1).")] = None,
    arrival: Annotated[str | None,
                       typer.Option(help="trace | poisson | gamma | closed | offline "
                                         "(default: the workload's).")] = None,
    burstiness: Annotated[float | None, typer.Option(help="Gamma arrivals: CV^2 of the gaps (1 = Poisson).")] = None,
    scale: Annotated[float | None,
                     typer.Option(help="Multiply every token length (default 1; smaller for the demo model).")] = None,
    context: Annotated[int | None, typer.Option(help="rag_long: target prompt length in tokens (e.g. 16000).")] = None,
    direct_share: Annotated[float | None,
                            typer.Option(help="rag_long: this share of the requests are direct questions outside the "
                                              "RAG pipeline (no system prompt, passages or history; short prompts, on "
                                              "the demo model closed-book questions). Default 0.")] = None,
    input_len: Annotated[str | None, typer.Option(help="offline_batch: prompt length N or range A-B.")] = None,
    output_len: Annotated[str | None, typer.Option(help="offline_batch: output length N or range A-B.")] = None,
    trace_format: Annotated[str | None,
                            typer.Option("--format", help="trace:PATH: the trace format (default: detected).")] = None,
    trace_map: Annotated[str | None,
                         typer.Option("--map",
                                      help="trace:PATH in your own JSONL/CSV layout (--format jsonl|csv): "
                                           "FIELD=COLUMN pairs, e.g. arrival_s=start_time_s,input_tokens=input_tokens,"
                                           "output_tokens=output_tokens,session_id=session_id[,time_unit=ms]; "
                                           "times may be absolute or relative.")] = None,
    skip_bad_lines: Annotated[bool,
                              typer.Option("--skip-bad-lines",
                                           help="trace:PATH: skip malformed lines; their count, the first reasons "
                                                "and the --map are recorded in run.json.")] = False,
    session_reuse: Annotated[str | None,
                             typer.Option(help="trace:PATH with session ids and no block ids: infer (default) makes "
                                               "a turn whose input holds the previous turn's input + output begin "
                                               "with that prompt and answer; none: fresh tokens.")] = None,
    turns: Annotated[str | None,
                     typer.Option(help="Open loop: dependent (default) sends a session's next turn after the previous "
                                       "answer plus its think time; independent: at its own arrival time.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for the workload and sampling.")] = 0,
    output: Annotated[str | None, typer.Option(help="Result folder (default: results/<run_id>).")] = None,
    slo: Annotated[str | None,
                   typer.Option(help="Latency targets for goodput and capacity, e.g. ttft_ms=2000,tpot_ms=200 (the "
                                     "default: MLPerf's Mixtral-8x7B server targets; the suite on the bundled demo "
                                     "model: ttft_ms=500,tpot_ms=150, scaled to its CPU speed).")] = None,
    warmup: Annotated[int, typer.Option(help="Requests run before measuring (excluded).")] = 2,
    telemetry_hz: Annotated[float, typer.Option(help="Telemetry samples per second.")] = 10.0,
    quality: Annotated[bool, typer.Option(help="Measure KL / top-1 agreement against the float32 reference.")] = True,
    dtype: Annotated[str | None, typer.Option(help="float32 | bfloat16 | float16.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N.")] = None,
    budget: Annotated[str | None, typer.Option(help=BUDGET_HELP)] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Engine option key=value; repeatable.")] = None,
    simulate: Annotated[str | None,
                        typer.Option(help="Simulate on this hardware instead of measuring here: a profile from "
                                          "`pwbench hw list` (e.g. h100-sxm) or a TOML file. The engine's control "
                                          "code runs on a virtual clock with a cost model; --model may be a preset "
                                          "name (e.g. mixtral-8x7b) or any folder with config.json. Results are "
                                          "marked simulated (docs/simulation.md).")] = None,
    routing: Annotated[str | None,
                       typer.Option(help="--simulate: expert choices per token: synthetic (default: published "
                                         "skew and locality of the model family), synthetic:skew=S,locality=L, "
                                         "uniform, or replay:PATH (a routing.parquet a measured run recorded).")
                       ] = None,
    find_capacity: Annotated[bool,
                             typer.Option("--find-capacity",
                                          help="After the run, search the highest request rate this engine serves "
                                               "within the SLO for --attainment of the requests: double the rate "
                                               "until a point fails, then bisect (each point the workload's "
                                               "requests retimed; docs/capacity.md). Written to run.json capacity; "
                                               "it drives devices and cost in the report.")] = False,
    attainment: Annotated[float,
                          typer.Option(help="--find-capacity: share of a point's requests that must meet every "
                                            "--slo target; a point needs at least 1 / (1 - attainment) requests "
                                            "(100 for 0.99).")] = 0.99,
    stability: Annotated[bool,
                         typer.Option("--stability",
                                      help="After the run, answer fixed probe prompts (greedy) at three background "
                                           "loads (idle, near the capacity, above it), 3 times each, and count "
                                           "distinct answers and flips against the float32 reference. Written to "
                                           "run.json stability.")] = False,
    stability_probes: Annotated[int, typer.Option(help="--stability: probe prompts.", min=1)] = 8,
    repeat: Annotated[int | None,
                      typer.Option(help="The suite (no --engine): run every engine this many times, interleaved, "
                                        "and report medians with 95% intervals (default: 3 on the bundled demo "
                                        "model, else 1).", min=1)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar.")] = False,
    as_json: Annotated[bool,
                       typer.Option("--json", help="Print the summary as one JSON object as the last line.")] = False,
) -> None:
    """Replay a workload against an engine and write a result folder (run.json + parquet files)."""
    model = resolve_model(model)  # a bundled model's name (demo, demo-fine) -> its folder
    from harness.cli.run_session import run_command

    options = dict(locals())
    if engine is None and workload == "rag_long" and engine_for_folder(model)[1] is None:  # not a quantized folder
        from harness.cli.run_session import suite_command

        raise typer.Exit(suite_command(options))
    options["engine"] = engine_for(engine, model)
    code = run_command(options)
    raise typer.Exit(code)


@app.command("show")
@user_errors
def show(
    run_dir: Annotated[str, typer.Argument(help="A result folder written by `pwbench run`.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object.")] = False,
) -> None:
    """Print a run's summary, recomputed from its files (checked first)."""
    from pathlib import Path

    from reports.summary_table import show_run

    show_run(Path(run_dir), as_json)

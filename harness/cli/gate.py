"""`pwbench gate`: fail CI when a candidate regresses against a baseline (reports/gate.py).
Exit 0 pass, 1 regression or an unfinished run, 2 unusable input (one line: a damaged file, or
runs of different workloads, seeds or models without --allow-different)."""

from __future__ import annotations

from typing import Annotated

import typer

from harness.cli.apps import app
from harness.cli.common import user_errors


@app.command("gate")
@user_errors
def gate(
    baseline: Annotated[str,
                        typer.Option(help="Baseline: a gate JSON (see --update-baseline) or result folder(s), "
                                          "comma-separated for repeats.")],
    candidate: Annotated[list[str],
                         typer.Option(help="Candidate result folder; repeat the option (or pass a folder of "
                                           "runs) for repeated runs.")],
    policy: Annotated[str | None,
                      typer.Option(help="Policy TOML: deterministic_tolerance, timing_tolerance, "
                                        "sigmas, min_p99_samples.")] = None,
    repeat: Annotated[int,
                      typer.Option(help="Timing metrics are judged only with this many runs "
                                        "on each side (medians).")] = 1,
    junit: Annotated[str | None, typer.Option(help="Write a JUnit XML file here.")] = None,
    markdown: Annotated[str | None, typer.Option(help="Write a Markdown summary here.")] = None,
    update_baseline: Annotated[bool,
                               typer.Option("--update-baseline",
                                            help="Write the candidate's metrics to --baseline (a "
                                                 ".json path) and exit 0.")] = False,
    deterministic_only: Annotated[bool,
                                  typer.Option("--deterministic-only",
                                               help="With --update-baseline: leave timing out (a baseline other "
                                                    "machines can gate against).")] = False,
    allow_different: Annotated[bool,
                               typer.Option("--allow-different",
                                            help="Gate runs of different workloads, seeds or models anyway (said "
                                                 "on stderr); without it they are refused.")] = False,
) -> None:
    """Compare a candidate run with a baseline, metric by metric; exit 1 on a regression."""
    import json
    from pathlib import Path

    from harness.errors import HarnessError
    from reports import gate as g

    if repeat < 1:
        raise HarnessError("--repeat must be >= 1")
    cand = g.load_side(candidate, "candidate")
    if update_baseline:
        if cand.unfinished:
            raise HarnessError(f"candidate {cand.unfinished[0]}: an unfinished run cannot be a baseline; "
                               "rerun it to completion")
        if not baseline.endswith(".json"):
            raise HarnessError(f"--update-baseline writes JSON: --baseline must end in .json, got {baseline!r}")
        g.write_atomic(Path(baseline),
                       json.dumps(g.baseline_json(cand, timing=not deterministic_only), indent=1,
                                  sort_keys=True) + "\n")
        typer.echo(f"baseline written: {baseline} ({len(cand.deterministic)} deterministic, "
                   f"{0 if deterministic_only else len(cand.timing)} timing metrics)")
        raise typer.Exit(0)
    base = g.load_side(baseline.split(","), "baseline")
    if diff := g.differences(base.identity, cand.identity):
        if not allow_different:
            raise HarnessError(f"baseline and candidate are runs of different workloads, seeds or models: "
                               f"{', '.join(diff)}; gate runs of one configuration, or pass --allow-different")
        typer.echo(f"note: gating runs that differ (--allow-different): {', '.join(diff)}", err=True)
    elif base.identity is None:
        typer.echo(f"note: {base.source} records no workload, seed or model (an older baseline); not checked",
                   err=True)
    verdicts = g.compare(base, cand, g.load_policy(policy, repeat))
    for v in verdicts:
        typer.echo(f"{v.status.upper():10s} {v.kind:13s} {v.metric:32s} {g.show(v.baseline)} -> "
                   f"{g.show(v.candidate)}  {v.detail}")
    if junit:
        g.write_atomic(Path(junit), g.junit(verdicts))
    if markdown:
        g.write_atomic(Path(markdown), g.markdown(verdicts, base, cand))
    failed = sum(v.status == "fail" for v in verdicts)
    typer.echo(f"gate: {'FAIL' if failed else 'PASS'}: {failed} regressions, "
               f"{sum(v.status == 'pass' for v in verdicts)} passed, "
               f"{sum(v.status == 'not judged' for v in verdicts)} not judged")
    raise typer.Exit(1 if failed else 0)

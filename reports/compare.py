"""`pwbench compare` and the suite's terminal summary: the executive table (reports.roi), one
row per arm (repeats of one configuration, medians with [95% intervals]), as a rich table or as
Markdown, with the recommendation (a winner only beyond noise, else the tie; never between two
runs of one configuration), its rule, and the runs left out of it: unfinished (interrupted,
failed) or not comparable."""

from __future__ import annotations

import sys

from reports import roi, verdict
from reports.runs import LeftOut, Run, left_out, simulated_on


def _mark(rows: list[dict], cells: list[list[str]], flagged: dict[str, LeftOut]) -> None:
    """Tag the first cell of each arm holding an unfinished run, so the table says it too."""
    for row, cell in zip(rows, cells):
        if (out := flagged.get(row["run"].text)) and out.kind == "unfinished":
            cell[0] += " (unfinished)"


def _left_out_lines(flagged: dict[str, LeftOut]) -> list[str]:
    return [f"{v.kind}: {k}: {v.why}" for k, v in flagged.items()]


def _simulated_line(runs: list[Run]) -> str | None:
    """Said first when any number is simulated (profiles named), None for measured runs."""
    sims = sorted({s for r in runs if (s := simulated_on(r.run))})
    if not sims:
        return None
    return (f"SIMULATED on {', '.join(sims)} (pwbench's cost model, not measured; quality not simulated; "
            "assumptions in run.json 'simulated')")


def markdown(runs: list[Run], prices: roi.Prices) -> str:
    flagged = left_out(runs)
    rows = roi.executive(runs, prices, set(flagged))
    header, cells = roi.table(rows)
    _mark(rows, cells, flagged)
    sim = _simulated_line(runs)
    lines = ([f"**{sim}**", ""] if sim else []) + ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
    _, sentence = verdict.recommend(rows, prices, set(flagged))
    lines += [""] + [f"- {t}" for t in verdict.technique_sentences(rows, prices, set(flagged))]
    lines += ["", f"**Recommendation:** {sentence}", "", verdict.RULE]
    lines += [f"- {line}" for line in _left_out_lines(flagged)]
    return "\n".join(lines)


def print_comparison(runs: list[Run], prices: roi.Prices, as_markdown: bool = False, compact: bool = False) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Column, Table

    # Piped (a log, CI): wide enough that no column is cut; rich would assume 80.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    if as_markdown:
        console.print(markdown(runs, prices), markup=False, highlight=False, soft_wrap=True)
        return
    flagged = left_out(runs)
    rows = roi.executive(runs, prices, set(flagged))
    header, cells = roi.table(rows, roi.COMPACT if compact else None)
    _mark(rows, cells, flagged)
    if sim := _simulated_line(runs):
        console.print(sim, markup=False, style="bold yellow")
    table = Table(*[Column(h, no_wrap=i == 0) for i, h in enumerate(header)])
    for row in cells:
        table.add_row(*(escape(c) for c in row))
    console.print(table)
    for t in verdict.technique_sentences(rows, prices, set(flagged)):
        console.print(t, markup=False)
    _, sentence = verdict.recommend(rows, prices, set(flagged))
    console.print(f"recommendation: {sentence}", markup=False)
    for line in _left_out_lines(flagged):
        console.print(line, markup=False, style="yellow")

"""`pwbench sweep`: a grid of engines x budgets x rates (x repeats, interleaved), one result folder
per cell inside the sweep folder, run by an executor (harness/sweep_exec.py: serial, local, ray).

Resumable, for the same settings only: the folder's sweep.json records the grid and settings,
and a rerun with others is refused (or, with force, goes to a new folder beside it). A cell
whose folder holds a complete, readable run of this grid is skipped; an interrupted, failed or
unreadable one (harness/result_checks.py) is run again. sweep.json also records each cell's
last outcome: status, error, executor and where it ran. The grid comes from flags or a TOML file
(SWEEP_KEYS); flags win. docs/sweeps.md.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.common.demo import resolve_model
from engines.registry import list_engines
from harness.errors import HarnessError, read_toml
from harness.run import RunArgs
from harness.sweep_exec import CellJob, CellOutcome, Executor, SerialExecutor, cell_kind, command
from workloads.registry import WorkloadSpec

SWEEP_SCHEMA = "pwbench-sweep/1"
SWEEP_KEYS = {"workload": str, "engines": list, "budgets": list, "rates": list, "requests": int, "seed": int,
              "set": dict, "model": str, "repeats": int}


@dataclass(frozen=True)
class Grid:
    workload: str = "rag_long"
    engines: tuple[str, ...] = ("moe",)
    budgets: tuple[str | None, ...] = (None,)
    rates: tuple[float | None, ...] = (None,)
    requests: int | None = None
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    model: str | None = None  # a folder or a bundled/preset name; None: the bundled demo model
    repeats: int = 1  # each point this many times, interleaved (every point once, then again, ...)

    def points(self) -> list[tuple[str, str, str | None, float | None]]:
        """(folder name, engine, budget, rate) for every point, in a fixed order."""
        out = []
        for engine, budget, rate in itertools.product(self.engines, self.budgets, self.rates):
            name = "-".join([engine, *([f"b{budget}"] if budget else []), *([f"r{rate:g}"] if rate else [])])
            out.append((re.sub(r"[^A-Za-z0-9_.-]+", "_", name), engine, budget, rate))
        return out

    def cells(self) -> list[Cell]:
        """Every cell, repeats interleaved: drift over the sweep (a busy machine) spreads over every
        point. With repeats a cell's folder is <point>/r<k>."""
        return [Cell(f"{name}/r{k}" if self.repeats > 1 else name, name, engine, budget, rate,
                     k if self.repeats > 1 else None)
                for k in range(1, self.repeats + 1) for name, engine, budget, rate in self.points()]


@dataclass(frozen=True)
class Cell:
    name: str  # its folder inside the sweep folder
    point: str
    engine: str
    budget: str | None
    rate: float | None
    repeat: int | None  # 1-based, with repeats > 1


def load_grid(path: str | Path | None, **flags: Any) -> Grid:
    data: dict[str, Any] = {}
    if path is not None:
        data = read_toml(path, "sweep", SWEEP_KEYS)
        for key, value in data.items():
            if not isinstance(value, SWEEP_KEYS[key]):
                raise HarnessError(f"{path}: {key} must be a {SWEEP_KEYS[key].__name__}, got {value!r}")
    extra = flags.pop("options", None) or {}  # --simulate / --routing: engine options of every point
    data.update({k: v for k, v in flags.items() if v is not None})
    if extra:
        data["set"] = {**dict(data.get("set") or {}), **extra}
    try:
        rates = tuple(float(r) for r in data.get("rates") or [None] if r is not None) or (None,)
    except (TypeError, ValueError):
        raise HarnessError(f"rates must be numbers, got {data.get('rates')!r}") from None
    repeats = data.get("repeats", 1)
    if not isinstance(repeats, int) or repeats < 1:
        raise HarnessError(f"repeats must be an integer >= 1, got {repeats!r}")
    engines = tuple(data.get("engines") or ["moe"])
    known = {name for name, _ in list_engines()}
    if unknown := [e for e in engines if e not in known]:  # before any cell runs (lists no engine module)
        raise HarnessError(f"unknown engine {unknown[0]!r} in the sweep; valid engines: {', '.join(sorted(known))}")
    return Grid(workload=data.get("workload", "rag_long"), engines=engines,
                budgets=tuple(str(b) for b in data.get("budgets") or []) or (None,), rates=rates,
                requests=data.get("requests"), seed=int(data.get("seed", 0)), options=dict(data.get("set") or {}),
                model=data.get("model"), repeats=repeats)


def settings(grid: Grid, quality: bool) -> dict[str, Any]:
    """What sweep.json records: everything that decides a point's result."""
    return {"workload": grid.workload, "engines": list(grid.engines), "budgets": list(grid.budgets),
            "rates": list(grid.rates), "requests": grid.requests, "seed": grid.seed,
            "set": json.loads(json.dumps(grid.options, sort_keys=True, default=str)), "quality": quality,
            **({"model": grid.model} if grid.model else {}), **({"repeats": grid.repeats} if grid.repeats > 1 else {})}


def _changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [f"{k} {new.get(k)!r} (was {old.get(k)!r})" for k in new if old.get(k) != new.get(k)]


def _point_changes(run: dict[str, Any], grid: Grid, engine: str, options: dict[str, Any],
                   rate: float | None) -> list[str]:
    """How a point's recorded run differs from what this grid runs there (a folder without
    sweep.json: a sweep from an older pwbench)."""
    config = run.get("config") or {}
    workload = config.get("workload") or {}
    want = {"engine": engine, "workload": grid.workload, "seed": grid.seed,
            "engine_options": json.loads(json.dumps(options, sort_keys=True, default=str)),
            **({"requests": grid.requests} if grid.requests else {}), **({"rate": rate} if rate else {})}
    have = {"engine": config.get("engine"), "engine_options": config.get("engine_options") or {},
            **{k: workload.get("name" if k == "workload" else k) for k in ("workload", "seed", "requests", "rate")}}
    return _changes(have, want)


def _free_folder(folder: Path) -> Path:
    n = 2
    while (folder.parent / f"{folder.name}-{n}").exists():
        n += 1
    return folder.parent / f"{folder.name}-{n}"


def open_sweep(grid: Grid, folder: Path, quality: bool, force: bool = False,
               say: Callable[[str], None] = print) -> Path:
    """The folder this sweep runs in, with its sweep.json: `folder`, or with `force` a new one
    beside it when `folder` holds a sweep of other settings (said through `say`)."""
    want = settings(grid, quality)
    record = folder / "sweep.json"
    changes: list[str] = []
    cells: dict[str, Any] = {}  # the cells' outcomes so far, kept when the settings are the same
    if record.exists():
        try:
            old = json.loads(record.read_text())
            if not isinstance(old, dict) or old.get("schema") != SWEEP_SCHEMA or not isinstance(old.get("settings"),
                                                                                                  dict):
                raise ValueError("not a pwbench sweep record")
        except (ValueError, OSError, UnicodeDecodeError) as exc:
            if not force:
                raise HarnessError(f"{record}: unreadable ({exc}); pass --force to start a new sweep beside it, "
                                   "or delete the folder") from None
            changes = ["sweep.json unreadable"]
        else:
            changes = _changes(old["settings"], want)
            cells = old.get("cells") if isinstance(old.get("cells"), dict) and not changes else {}
    elif folder.is_dir():
        from harness.result_checks import read_run_json  # noqa: PLC0415  (the readers' checks; no engine)

        for name, engine, budget, rate in grid.points():
            try:
                run = read_run_json(folder / name)
            except HarnessError:
                continue  # absent or unreadable: run again below
            options = {**grid.options, **({"budget_bytes": budget} if budget else {})}
            if diff := _point_changes(run, grid, engine, options, rate):
                changes = [f"point {name}: {', '.join(diff)}"]
                break
    if changes:
        if not force:
            raise HarnessError(f"{folder} holds a sweep of other settings: {'; '.join(changes)}; rerun with its "
                               "settings to resume, or pass --force to start a new sweep beside it")
        new = _free_folder(folder)
        say(f"sweep: {folder} holds a sweep of other settings ({'; '.join(changes)}); starting a new sweep in {new}")
        folder = new
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write_record(folder, {"schema": SWEEP_SCHEMA, "settings": want, **({"cells": cells} if cells else {})})
    except OSError as exc:
        raise HarnessError(f"{folder}: cannot write the sweep folder ({exc.strerror or type(exc).__name__}); "
                           "choose another --output") from None
    return folder


def _write_record(folder: Path, record: dict[str, Any]) -> None:
    tmp = folder / f".sweep.json.partial-{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(folder / "sweep.json")


def cell_args(grid: Grid, cell: Cell, folder: Path, quality: bool) -> RunArgs:
    """The `pwbench run` configuration of one cell, writing into its folder."""
    given = {"seed": grid.seed, **({"requests": grid.requests} if grid.requests else {}),
             **({"rate": cell.rate} if cell.rate else {})}
    options = {**grid.options, **({"budget_bytes": cell.budget} if cell.budget else {})}
    simulated = bool(options.get("simulate"))  # quality is not simulated: a simulated run has no logits
    return RunArgs(workload=WorkloadSpec(grid.workload, **given), given=frozenset(given), engine=cell.engine,
                   engine_options=options, model=resolve_model(grid.model), output=str(folder / cell.name),
                   quality=quality and not simulated, row=cell.point if cell.repeat else None, repeat=cell.repeat)


def plan_sweep(grid: Grid, folder: Path, quality: bool) -> tuple[list[tuple[CellJob, str | None]], list[str]]:
    """([(cell to run, why its folder is run again or None)], cells already complete), in the
    sweep's order; nothing is changed on disk (a dry run reads this too)."""
    from harness.result_checks import check_folder, unfinished  # noqa: PLC0415

    todo, skipped = [], []
    for cell in grid.cells():
        target = folder / cell.name
        why = None
        if target.exists():
            try:
                why = unfinished(check_folder(target))
            except HarnessError as exc:
                why = str(exc)
            if why is None:
                skipped.append(cell.name)
                continue
        args = cell_args(grid, cell, folder.resolve(), quality)  # absolute: the same path on every node
        todo.append((CellJob(cell.name, args, cell_kind(args.engine_options)), why))
    return todo, skipped


def dry_run(grid: Grid, folder: Path, quality: bool, executor: Executor) -> list[str]:
    """One line per cell: its name, where it would run, and the `pwbench run` command that runs it
    by itself; complete cells say so. Nothing runs, nothing is written."""
    todo, skipped = plan_sweep(grid, folder, quality)
    lines = [f"{job.name} ({executor.where(job)}): {command(job)}" for job, _ in todo]
    return lines + [f"{name} (complete: skipped)" for name in skipped]


@dataclass
class SweepResult:
    ran: list[str] = field(default_factory=list)  # complete now
    skipped: list[str] = field(default_factory=list)  # complete before this sweep
    failed: dict[str, str] = field(default_factory=dict)  # cell -> why (its status and error)


def run_sweep(grid: Grid, folder: Path, quality: bool = True, say: Callable[[str], None] = print,
              executor: Executor | None = None) -> SweepResult:
    """Run the missing cells of the sweep in `folder` (opened by open_sweep) on `executor`
    (default serial). Each outcome is recorded in sweep.json as it arrives; a failed cell is
    recorded and the others go on (never retried in this sweep). Ctrl-C propagates once the
    executor has stopped the cells in flight."""
    executor = executor or SerialExecutor()
    todo, skipped = plan_sweep(grid, folder, quality)
    result = SweepResult(skipped=skipped)
    for job, why in todo:
        if why is not None:
            say(f"sweep: {job.name}: {why}; running it again")
            shutil.rmtree(folder / job.name)
    record = json.loads((folder / "sweep.json").read_text())
    cells = record.setdefault("cells", {})
    info = executor.describe()

    def started(job: CellJob, where: str) -> None:
        say(f"sweep: {job.name}" + ("" if executor.name == "serial" else f" ({where})"))

    def done(outcome: CellOutcome) -> None:
        cells[outcome.name] = {**outcome.record(), **info}
        _write_record(folder, record)
        if outcome.status == "complete":
            result.ran.append(outcome.name)
        else:
            result.failed[outcome.name] = f"{outcome.status}" + (f" ({outcome.error})" if outcome.error else "")
            say(f"sweep: {outcome.name}: {result.failed[outcome.name]}")

    executor.run([job for job, _ in todo], started, done)
    return result

"""`pwbench sweep`: a grid of engines x budgets x rates, one result folder per point inside the
sweep folder, then the HTML report over all of them.

Resumable, for the same settings only: the folder's sweep.json records the grid and settings,
and a rerun with others is refused (or, with force, goes to a new folder beside it). A point
whose folder holds a complete, readable run of this grid is skipped; an interrupted, failed or
unreadable one (harness/result_checks.py) is run again. The grid comes from flags or a TOML file
(SWEEP_KEYS); flags win.
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
from harness.errors import HarnessError, read_toml
from harness.run import RunArgs, execute
from workloads.registry import WorkloadSpec

SWEEP_SCHEMA = "pwbench-sweep/1"
SWEEP_KEYS = {"workload": str, "engines": list, "budgets": list, "rates": list, "requests": int, "seed": int,
              "set": dict, "model": str}


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

    def points(self) -> list[tuple[str, str, str | None, float | None]]:
        """(folder name, engine, budget, rate) for every point, in a fixed order."""
        out = []
        for engine, budget, rate in itertools.product(self.engines, self.budgets, self.rates):
            name = "-".join([engine, *([f"b{budget}"] if budget else []), *([f"r{rate:g}"] if rate else [])])
            out.append((re.sub(r"[^A-Za-z0-9_.-]+", "_", name), engine, budget, rate))
        return out


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
    return Grid(workload=data.get("workload", "rag_long"), engines=tuple(data.get("engines") or ["moe"]),
                budgets=tuple(str(b) for b in data.get("budgets") or []) or (None,), rates=rates,
                requests=data.get("requests"), seed=int(data.get("seed", 0)), options=dict(data.get("set") or {}),
                model=data.get("model"))


def settings(grid: Grid, quality: bool) -> dict[str, Any]:
    """What sweep.json records: everything that decides a point's result."""
    return {"workload": grid.workload, "engines": list(grid.engines), "budgets": list(grid.budgets),
            "rates": list(grid.rates), "requests": grid.requests, "seed": grid.seed,
            "set": json.loads(json.dumps(grid.options, sort_keys=True, default=str)), "quality": quality,
            **({"model": grid.model} if grid.model else {})}


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
    tmp = folder / f".sweep.json.partial-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"schema": SWEEP_SCHEMA, "settings": want}, indent=1) + "\n")
        tmp.replace(folder / "sweep.json")
    except OSError as exc:
        raise HarnessError(f"{folder}: cannot write the sweep folder ({exc.strerror or type(exc).__name__}); "
                           "choose another --output") from None
    return folder


def run_sweep(grid: Grid, folder: Path, quality: bool = True,
              say: Callable[[str], None] = print) -> tuple[list[str], list[str]]:
    """Run the missing points of the sweep in `folder` (opened by open_sweep); returns (points
    run now, points skipped as already complete and readable)."""
    from harness.result_checks import check_folder, unfinished  # noqa: PLC0415

    ran, skipped = [], []
    for name, engine, budget, rate in grid.points():
        target = folder / name
        if target.exists():
            try:
                why = unfinished(check_folder(target))
            except HarnessError as exc:
                why = str(exc)
            if why is None:
                skipped.append(name)
                continue
            say(f"sweep: {name}: {why}; running it again")
            shutil.rmtree(target)
        given = {"seed": grid.seed, **({"requests": grid.requests} if grid.requests else {}),
                 **({"rate": rate} if rate else {})}
        spec = WorkloadSpec(grid.workload, **given)
        options = {**grid.options, **({"budget_bytes": budget} if budget else {})}
        say(f"sweep: {name}")
        simulated = bool(options.get("simulate"))  # quality is not simulated: a simulated run has no logits
        _, result = execute(RunArgs(workload=spec, given=frozenset(given), engine=engine, engine_options=options,
                                    model=resolve_model(grid.model), output=str(target),
                                    quality=quality and not simulated))
        if result["status"] != "complete":
            raise HarnessError(f"sweep point {name}: run {result['status']} ({result.get('error')}); rerun to resume")
        ran.append(name)
    return ran, skipped

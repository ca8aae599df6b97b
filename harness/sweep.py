"""`pwbench sweep`: a grid of engines x budgets x rates, one result folder per point inside the
sweep folder, then the HTML report over all of them.

Resumable: a point whose folder holds a complete run is skipped; an interrupted or failed one
is run again. The grid comes from flags or a TOML file (SWEEP_KEYS); flags win.
"""

from __future__ import annotations

import itertools
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import HarnessError, read_toml
from harness.run import RunArgs, execute
from workloads.registry import WorkloadSpec

SWEEP_KEYS = {"workload": str, "engines": list, "budgets": list, "rates": list, "requests": int, "seed": int,
              "set": dict}


@dataclass(frozen=True)
class Grid:
    workload: str = "rag_long"
    engines: tuple[str, ...] = ("moe",)
    budgets: tuple[str | None, ...] = (None,)
    rates: tuple[float | None, ...] = (None,)
    requests: int | None = None
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)

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
    data.update({k: v for k, v in flags.items() if v is not None})
    try:
        rates = tuple(float(r) for r in data.get("rates") or [None] if r is not None) or (None,)
    except (TypeError, ValueError):
        raise HarnessError(f"rates must be numbers, got {data.get('rates')!r}") from None
    return Grid(workload=data.get("workload", "rag_long"), engines=tuple(data.get("engines") or ["moe"]),
                budgets=tuple(str(b) for b in data.get("budgets") or []) or (None,), rates=rates,
                requests=data.get("requests"), seed=int(data.get("seed", 0)), options=dict(data.get("set") or {}))


def run_sweep(grid: Grid, folder: Path, quality: bool = True,
              say: Callable[[str], None] = print) -> tuple[list[str], list[str]]:
    """Run the missing points; returns (points run now, points skipped as already complete)."""
    from harness.results import read_run  # noqa: PLC0415

    folder.mkdir(parents=True, exist_ok=True)
    ran, skipped = [], []
    for name, engine, budget, rate in grid.points():
        target = folder / name
        if (target / "run.json").exists():
            try:
                if read_run(target)["status"] == "complete":
                    skipped.append(name)
                    continue
            except HarnessError:
                pass
            shutil.rmtree(target)  # an interrupted or unreadable point of this sweep: run it again
        given = {"seed": grid.seed, **({"requests": grid.requests} if grid.requests else {}),
                 **({"rate": rate} if rate else {})}
        spec = WorkloadSpec(grid.workload, **given)
        options = {**grid.options, **({"budget_bytes": budget} if budget else {})}
        say(f"sweep: {name}")
        _, result = execute(RunArgs(workload=spec, given=frozenset(given), engine=engine, engine_options=options,
                                    output=str(target), quality=quality))
        if result["status"] != "complete":
            raise HarnessError(f"sweep point {name}: run {result['status']} ({result.get('error')}); rerun to resume")
        ran.append(name)
    return ran, skipped

"""Result folders as the reports see them: expand suite and sweep folders, load run.json and
the parquet tables, decide which runs can be compared, and group repeats into arms.

An arm is every run of one configuration: the same engine, model, engine options (budget
included), workload (seed and rate included) and SLO. Suite repeats use the same seed on
purpose, so the spread across an arm's runs is the environment's noise, not the engine's.

Reads files only (harness.results, pandas): no engine, no torch. A folder that is neither a
result folder nor holds any, or whose files are damaged (harness/result_checks.py), is a HarnessError
naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import HarnessError
from harness.result_checks import check_folder, unfinished
from harness.results import read_rows


@dataclass
class Run:
    folder: Path
    run: dict[str, Any]
    _tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict, repr=False)

    @property
    def label(self) -> str:
        """The engine name, with the folder name when it says more (suite: the engine row)."""
        return self.folder.name

    @property
    def engine(self) -> str:
        return self.run["engine"]["name"]

    @property
    def summary(self) -> dict[str, Any]:
        return self.run["summary"]

    def rows(self, name: str) -> list[dict[str, Any]]:
        """Rows of `<name>.parquet`, [] when the run has no such table."""
        if name not in self._tables:
            path = self.folder / f"{name}.parquet"
            try:
                self._tables[name] = read_rows(self.folder, name) if path.exists() else []
            except Exception as exc:  # noqa: BLE001  (pyarrow raises several types for a bad file)
                raise HarnessError(f"{path}: not a readable parquet file "
                                   f"({type(exc).__name__}); rerun the run") from None
        return self._tables[name]


def expand(paths: list[str | Path]) -> list[Path]:
    """Result folders under each path: the path itself when it has run.json, else every
    subfolder (recursively, sorted) that has one."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise HarnessError(f"{path}: no such folder; pass result folders written by `pwbench run`")
        if (path / "run.json").exists():
            out.append(path)
            continue
        found = sorted(p.parent for p in path.rglob("run.json")
                       if not any(s.startswith(".") for s in p.relative_to(path).parts))
        if not found:
            raise HarnessError(f"{path}: holds no result folder (no run.json); pass folders written by `pwbench run`")
        out.extend(found)
    return out


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Every result folder under `paths`, each checked (harness.result_checks.check_folder)."""
    return [Run(folder, check_folder(folder)) for folder in expand(paths)]


def simulated_on(run: dict[str, Any]) -> str | None:
    """The hardware profile a simulated run stood for (run.json `simulated`); None: measured."""
    sim = run.get("simulated")
    return str(sim.get("hardware")) if isinstance(sim, dict) else None


def comparability_key(run: dict[str, Any]) -> dict[str, Any]:
    """What must agree for two runs to be compared: workload (with seed), hardware, pwbench.
    A simulated run's hardware is its profile, never the machine that simulated it: simulated
    and measured numbers are not compared."""
    env = run.get("environment") or {}
    workload = dict((run.get("config") or {}).get("workload") or {})
    sim = simulated_on(run)
    hardware = [f"simulated {sim}"] if sim is not None else [env.get("cpu_model"), env.get("gpu")]
    return {"workload": workload, "hardware": hardware, "pwbench": env.get("pwbench")}


def _incomparable_runs(runs: list[Run]) -> list[tuple[Run, str]]:
    """(run, why it differs from the first run) for each run that differs. Budget and rate may
    differ (a sweep varies them on purpose); nothing else in the key may."""
    if not runs:
        return []
    base = comparability_key(runs[0].run)
    out: list[tuple[Run, str]] = []
    for r in runs[1:]:
        key = comparability_key(r.run)
        diffs = []
        for part in ("workload", "hardware", "pwbench"):
            a, b = base[part], key[part]
            if part == "workload":
                a = {k: v for k, v in a.items() if k != "rate"}
                b = {k: v for k, v in b.items() if k != "rate"}
                keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                if keys:
                    diffs.append("workload " + ", ".join(f"{k}={b.get(k)!r} (vs {a.get(k)!r})" for k in keys))
            elif a != b:
                diffs.append(f"{part} {b!r} (vs {a!r})")
        if diffs:
            out.append((r, "; ".join(diffs)))
    return out


@dataclass(frozen=True)
class LeftOut:
    kind: str  # unfinished | not comparable
    why: str


def left_out(runs: list[Run]) -> dict[str, LeftOut]:
    """Arms the recommendation leaves out, by arm label (unique, where folder names are not:
    a suite's repeats are r1, r2, ... under every engine): an arm holding an unfinished run
    (interrupted, failed: part of the workload measured), else one holding a run not comparable
    with the first complete run."""
    gone = {id(r): why for r in runs if (why := unfinished(r.run))}
    differ = {id(r): why for r, why in _incomparable_runs([r for r in runs if id(r) not in gone])}
    out: dict[str, LeftOut] = {}
    for arm in arms(runs):
        def named(r: Run, why: str, arm: Arm = arm) -> str:
            return f"{r.folder.name} {why}" if len(arm.runs) > 1 else why

        if parts := [named(r, gone[id(r)]) for r in arm.runs if id(r) in gone]:
            out[arm.label] = LeftOut("unfinished", "; ".join(parts) + ": not a whole run, left out of the "
                                                                     "recommendation")
        elif parts := [named(r, differ[id(r)]) for r in arm.runs if id(r) in differ]:
            out[arm.label] = LeftOut("not comparable", "; ".join(parts))
    return out


def config_key(run: dict[str, Any]) -> str:
    """The configuration that makes runs repeats of one arm, as a canonical JSON string."""
    c = run.get("config") or {}
    engine = c.get("engine") or (run.get("engine") or {}).get("name")
    key = [engine, c.get("model"), sorted((c.get("engine_options") or {}).items()), c.get("workload") or {},
           c.get("slo") or {}]
    return json.dumps(key, sort_keys=True, default=str)


def describe_config(run: dict[str, Any]) -> str:
    """The configuration in a few words: engine, model, workload, seed, rate, options, SLO."""
    c = run.get("config") or {}
    wl = c.get("workload") or {}
    parts = [f"engine {c.get('engine') or (run.get('engine') or {}).get('name')}"]
    if c.get("model"):
        parts.append(f"model {Path(str(c['model'])).name}")
    parts += [f"workload {wl.get('name')}", f"seed {wl.get('seed', run.get('seed'))}"]
    if wl.get("requests") is not None:
        parts.append(f"{wl['requests']} requests")
    if wl.get("rate") is not None:
        parts.append(f"rate {wl['rate']:g}/s")
    for k, v in sorted((c.get("engine_options") or {}).items()):
        if k == "budget_bytes" and isinstance(v, (int, float)):
            parts.append(f"budget {v / 2**20:.2f} MiB")
        elif v is not None:
            parts.append(f"{k}={v}")
    if c.get("slo"):
        parts.append("SLO " + ", ".join(f"{k} <= {v:g}" for k, v in c["slo"].items()))
    return ", ".join(parts)


@dataclass
class Arm:
    """The repeats of one configuration (config_key), in the order they were given."""
    label: str
    runs: list[Run]

    @property
    def engine(self) -> str:
        return self.runs[0].engine

    @property
    def key(self) -> str:
        return config_key(self.runs[0].run)

    @property
    def folders(self) -> list[str]:
        return [r.folder.name for r in self.runs]


def _base_label(run: Run) -> str:
    return str((run.run.get("config") or {}).get("row") or run.engine)


def arms(runs: list[Run]) -> list[Arm]:
    """Runs grouped by configuration, in order of first appearance, repeats sorted by
    config.repeat. Label: config.row, else the engine name; where two arms would share one,
    each takes its first run's folder name (then its path) instead."""
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(config_key(r.run), []).append(r)
    members = [sorted(g, key=lambda r: (r.run.get("config") or {}).get("repeat") or 0) for g in groups.values()]
    labels = [_base_label(g[0]) for g in members]
    for fallback in (lambda g: g[0].folder.name, lambda g: str(g[0].folder)):
        clash = {x for x in labels if labels.count(x) > 1}
        labels = [fallback(g) if x in clash else x for g, x in zip(members, labels)]
    return [Arm(label, g) for label, g in zip(labels, members)]

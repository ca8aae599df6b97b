"""The same simulated sweep (default 16 cells: moe on the demo model, 4 budgets x 4 rates, simulated
on the `cpu` profile) run by `pwbench sweep --executor serial` and `--executor local --workers N`,
each in a fresh process into its own folder; prints wall times, the cells' summed run time and
the speed-up. Every cell's tokens and counts are checked equal between the two (its simulated
times include the measured control-code time, so they differ run to run).

    python -m harness.bench.sweep_executors [--workers 2] [--requests 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRID = """workload = "offline_batch"
engines = ["moe"]
budgets = ["3MiB", "4MiB", "5MiB", "6MiB"]
rates = [2, 4, 8, 16]
requests = {requests}
"""


def sweep(grid: Path, out: Path, *args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "harness.cli", "sweep", "--config", str(grid), "--simulate", "cpu",
                    "--output", str(out), *args], check=True, capture_output=True, text=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - start


def counts(folder: Path) -> dict[str, dict]:
    keys = ("completed", "failed", "input_tokens", "output_tokens")
    return {p.parent.name: {k: json.loads(p.read_text())["summary"][k] for k in keys}
            for p in sorted(folder.glob("*/run.json"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pwbench-sweep-bench-") as tmp:
        root = Path(tmp)
        grid = root / "grid.toml"
        grid.write_text(GRID.format(requests=opts.requests))
        rows = []
        for name, args in (("serial", ()), ("local", ("--executor", "local", "--workers", str(opts.workers)))):
            wall = sweep(grid, root / name, *args)
            cells = json.loads((root / name / "sweep.json").read_text())["cells"]
            rows.append((name, wall, sum(c["wall_s"] for c in cells.values()), len(cells)))
        same = counts(root / "serial") == counts(root / "local") and len(counts(root / "local")) == 16
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end; "
          f"every cell's counts equal between executors: {same}")
    print(f"{'executor':<10}{'cells':>6}{'wall s':>9}{'cells run s':>13}")
    for name, wall, busy, n in rows:
        print(f"{name:<10}{n:>6}{wall:>9.1f}{busy:>13.1f}")
    print(f"speed-up local/{opts.workers} workers over serial: {rows[0][1] / rows[1][1]:.2f}x")


if __name__ == "__main__":
    main()

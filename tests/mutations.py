"""Break the build on purpose and check that the suite notices (run by hand, not by pytest).

Each mutation replaces one exact line of source, runs the tests named for it, expects at
least one failure, and restores the file whatever happens. Usage:

    python tests/mutations.py            # all mutations
    python tests/mutations.py kv-table   # one, by name
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str


MUTATIONS = (
    Mutation(
        "kv-table", "engines/runtime/kv_cache.py",
        "        return -(-num_tokens // self.block_size)",
        "        return -(-(num_tokens - 1) // self.block_size)",
        ("tests/unit/test_scheduler.py",
         "tests/integration/test_moe_matches_transformers.py::test_batch_of_different_lengths"),
        "off-by-one in the KV block table: one block too few once a sequence fills its last block",
    ),
    Mutation(
        "fused-gate-up", "engines/runtime/checkpoint.py",
        "        gate_up = reader.get(prefix + \"gate_up_proj\", (E, 2 * I, D))",
        "        gate_up = reader.get(prefix + \"gate_up_proj\", (E, 2 * I, D)); gate_up = gate_up.roll(I, dims=1) if "
        "gate_up is not None else None",
        ("tests/integration/test_checkpoint_layouts.py",),
        "gate and up halves swapped when reading the fused 3-D expert format (one layout only)",
    ),
    Mutation(
        "percentile", "harness/metrics.py",
        "    pos = (len(xs) - 1) * q / 100",
        "    pos = min(len(xs) - 1, len(xs) * q / 100)",
        ("tests/harness/test_efficiency_by_hand.py", "tests/harness/test_run_cli.py",
         "tests/harness/test_metrics_dummy.py"),
        "percentiles by the wrong rank formula (n * q instead of (n - 1) * q, numpy's linear)",
    ),
)


def run(m: Mutation) -> tuple[bool, str, float]:
    path = ROOT / m.file
    original = path.read_text()
    if original.count(m.old) != 1:
        return False, f"the line to mutate is not in {m.file} exactly once; update tests/mutations.py", 0.0
    start = time.perf_counter()
    try:
        path.write_text(original.replace(m.old, m.new))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *m.tests],
                              cwd=ROOT, capture_output=True, text=True)
    finally:
        path.write_text(original)
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    detail = "\n    ".join(failed) or proc.stdout[-500:]
    return proc.returncode == 1 and bool(failed), detail, time.perf_counter() - start


def main(names: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    if names and len(chosen) != len(names):
        print(f"error: unknown mutation; valid: {', '.join(m.name for m in MUTATIONS)}", file=sys.stderr)
        return 2
    missed = 0
    for m in chosen:
        caught, detail, seconds = run(m)
        missed += not caught
        print(f"{m.name}: {'CAUGHT' if caught else 'MISSED'} in {seconds:.0f} s — {m.what}\n    {detail}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

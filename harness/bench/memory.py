"""Peak memory of a whole `pwbench run` at scale: rag_long on the dummy engine, N requests.

    python -m harness.bench.memory [--requests 20000 100000] [--arrival poisson|offline] [--rate 1000]

Each case is one `pwbench run --engine dummy --workload rag_long` in its own process (default
prompts, a 32,000-token vocabulary, no warm-up, no quality), into a temporary folder deleted
afterwards; its peak RSS is that process's own high-water mark (os.wait4's ru_maxrss), so
planning, the run loop, the streamed rows and building the result files all count. At
--rate 1000 the dummy (no sleeps, pure Python) falls behind, so thousands of requests queue
in it; --arrival offline queues all of them at t = 0. Printed per case: requests, arrival,
wall time, peak RSS, prompt and output tokens of the run (from its summary), the result
folder's size. Not a test (tests/harness/test_bench_memory.py runs a small case).
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


def measure(requests: int, arrival: str, rate: float) -> dict:
    """One `pwbench run` of `requests` rag_long requests on the dummy engine, in a child process."""
    with tempfile.TemporaryDirectory(prefix="pwbench-memory-") as tmp:
        out = Path(tmp) / "run"
        command = [sys.executable, "-m", "harness.cli", "run", "--engine", "dummy", "--workload", "rag_long",
                   "--requests", str(requests), "--arrival", arrival, "--warmup", "0", "--no-quality", "--quiet",
                   "--json", "--output", str(out)]
        if arrival != "offline":
            command += ["--rate", str(rate)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        start = time.perf_counter()
        with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
            proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env, text=True)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            wall = time.perf_counter() - start
            stdout.seek(0)
            stderr.seek(0)
            lines, err = stdout.read().strip().splitlines(), stderr.read().strip()
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{requests} requests: pwbench run exited {proc.returncode}: {err.splitlines()[-1:]}")
        summary = json.loads(lines[-1])
        size = sum(p.stat().st_size for p in out.iterdir())
    return {"requests": requests, "arrival": arrival, "rate": None if arrival == "offline" else rate,
            "wall_s": round(wall, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024),  # Linux: KiB
            "completed": summary["completed"], "input_tokens": summary["input_tokens"],
            "output_tokens": summary["output_tokens"], "folder_mb": round(size / 2**20, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[20_000, 100_000])
    parser.add_argument("--arrival", choices=("poisson", "offline"), default="poisson")
    parser.add_argument("--rate", type=float, default=1000.0, help="poisson: requests per second")
    parser.add_argument("--json", action="store_true", help="one JSON object a case instead of a line")
    args = parser.parse_args(argv)
    for n in args.requests:
        r = measure(n, args.arrival, args.rate)
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        how = "offline" if r["rate"] is None else f"poisson {r['rate']:g} req/s"
        print(f"rag_long on dummy, {r['requests']:,} requests ({how}): peak RSS {r['peak_rss_mb']:,} MB, "
              f"{r['wall_s']:,.1f} s; {r['completed']:,} completed, {r['input_tokens'] / 1e6:.1f}M prompt / "
              f"{r['output_tokens'] / 1e6:.2f}M output tokens; result folder {r['folder_mb']:,} MB", flush=True)


if __name__ == "__main__":
    main()

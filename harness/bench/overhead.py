"""The harness's own overhead: N zero-latency requests through the dummy engine.

    python -m harness.bench.overhead [--requests 10000]
Prints the wall time of the run loop (target: 10,000 requests in under 10 s) and the
per-request and per-step cost, as the median of three runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from engines.dummy import DummyConfig, DummyEngine
from harness.runner import Runner
from workloads.base import Request


def once(n: int, output_tokens: int) -> tuple[float, int]:
    requests = [Request(f"r{i}", (1, 2, 3, 4), output_tokens, arrival_s=0.0) for i in range(n)]
    runner = Runner(DummyEngine(DummyConfig(max_num_seqs=256)), requests)
    t = time.perf_counter()
    records = runner.run()
    return time.perf_counter() - t, len(records.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--output-tokens", type=int, default=8)
    args = parser.parse_args()
    runs = [once(args.requests, args.output_tokens) for _ in range(3)]
    seconds = statistics.median(r[0] for r in runs)
    steps = runs[0][1]
    print(f"{args.requests} requests x {args.output_tokens} tokens, dummy engine, zero latency: "
          f"{seconds:.2f} s (median of 3), {seconds / args.requests * 1e6:.0f} us/request, "
          f"{seconds / steps * 1e6:.0f} us/step over {steps} steps")


if __name__ == "__main__":
    main()

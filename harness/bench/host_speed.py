"""This host's CPU speed over time: a fixed pure-Python loop timed every `--every` seconds.

    taskset -c 1 python -m harness.bench.host_speed [--seconds 20] [--every 0.25]

Each probe is harness.hw `host_speed`: the loop's CPU time (this thread's, so time the core spent
on another process does not count) against the fastest this CPU ever ran it (1.0: as fast; 0.6: the
same work took 1/0.6 as long). On a dedicated machine every probe reads ~1.0. On a VM that shares
its physical cores, the same work slows when neighbours run, which no clock inside the VM can
leave out; a measured run and a calibration taken seconds apart then see different machines
(docs/simulation-validation.md). Prints the probes in order, their quartiles, and the runs of
consecutive probes above and below 0.9.
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    from harness.hw import host_speed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to probe")
    parser.add_argument("--every", type=float, default=0.25, help="seconds between probes")
    args = parser.parse_args(argv)
    speeds, end = [], time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        speeds.append(host_speed())
        time.sleep(args.every)
    ordered = sorted(speeds)
    q = [ordered[int(f * (len(ordered) - 1))] for f in (0.0, 0.25, 0.5, 0.75, 1.0)]
    runs, current = [], None
    for s in speeds:
        fast = s >= 0.9
        if current is None or current[0] != fast:
            current = [fast, 0]
            runs.append(current)
        current[1] += 1
    print("speeds:", " ".join(f"{s:.2f}" for s in speeds))
    print(f"{len(speeds)} probes {args.every} s apart: min {q[0]:.2f}, quartiles {q[1]:.2f} / {q[2]:.2f} / "
          f"{q[3]:.2f}, max {q[4]:.2f}; share >= 0.9: {sum(s >= 0.9 for s in speeds) / len(speeds):.0%}")
    print("runs (probes at >= 0.9 '+', below '-'):", " ".join(f"{'+' if f else '-'}{n}" for f, n in runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Peak memory and time-to-first-send of building a big workload (no engine, no run loop).

    python -m harness.bench.plan_memory [--case rag_long|mooncake|all] [--requests 20000] [--traces DIR]

Each case runs in a fresh interpreter, so its peak RSS is its own. A case builds the
workload exactly as `pwbench run` does (workloads.registry.build_workload, default hash-block
prompts, a 32,000-token vocabulary, max_model_len 10^6 so nothing is clipped), then makes the
first request's EngineRequest the way the runner submits it. Printed per case:
- time to first send: from before build_workload until that first EngineRequest exists
  (wall clock, and the process's CPU time, which is steadier on a shared machine);
- peak RSS: the process's high-water mark (ru_maxrss) at that moment, and the RSS after the
  imports alone, so the difference is what the plan and the prompts cost;
- requests and prompt tokens planned (from the requests' lengths, not their tokens).

Cases: `rag_long` (`--requests` generated RAG requests, Poisson) and `mooncake` (the whole
Mooncake conversation trace, 12,031 requests / 144.8M prompt tokens, from --traces or
$PWBENCH_TRACES, default ../shared/traces). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

TRACE = "mooncake/conversation_trace.jsonl"


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _current_rss_mb() -> float:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def child(case: str, requests: int, traces: Path) -> dict:
    from engines.base import EngineRequest
    from workloads.registry import ModelTarget, WorkloadSpec, build_workload

    target = ModelTarget(vocab_size=32000, max_model_len=10**6, special_ids=(0, 1, 2))
    if case == "rag_long":
        spec = WorkloadSpec("rag_long", requests=requests)
    else:
        spec = WorkloadSpec(f"trace:{traces / TRACE}")
    imports_mb = _rss_mb()
    start, cpu = time.perf_counter(), time.process_time()
    workload = build_workload(spec, target)
    first = workload.requests[0]
    # What the runner hands the engine (harness/runner.py: Runner._send).
    EngineRequest(first.request_id, tuple(first.prompt_ids), first.max_new_tokens, ignore_eos=first.ignore_eos)
    first_send_s, first_send_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    return {
        "case": case,
        "requests": len(workload.requests),
        "prompt_tokens": sum(r.num_prompt_tokens for r in workload.requests),
        "time_to_first_send_s": round(first_send_s, 2),
        "time_to_first_send_cpu_s": round(first_send_cpu_s, 2),
        "peak_rss_mb": round(_rss_mb()),
        "rss_after_imports_mb": round(imports_mb),
        "rss_now_mb": round(_current_rss_mb()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("rag_long", "mooncake", "all"), default="all")
    parser.add_argument("--requests", type=int, default=20_000, help="rag_long: requests to plan")
    parser.add_argument("--traces", type=Path,
                        default=Path(os.environ.get("PWBENCH_TRACES",
                                                    Path(__file__).resolve().parents[3] / "shared" / "traces")))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.case, args.requests, args.traces)))
        return
    cases = ("rag_long", "mooncake") if args.case == "all" else (args.case,)
    for case in cases:
        if case == "mooncake" and not (args.traces / TRACE).is_file():
            print(f"{case}: skipped ({args.traces / TRACE} not found; pass --traces DIR)")
            continue
        proc = subprocess.run(
            [sys.executable, "-m", "harness.bench.plan_memory", "--child", "--case", case,
             "--requests", str(args.requests), "--traces", str(args.traces)],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            print(f"{case}: failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{case}: {r['requests']:,} requests, {r['prompt_tokens'] / 1e6:.1f}M prompt tokens: "
              f"time to first send {r['time_to_first_send_s']:.2f} s ({r['time_to_first_send_cpu_s']:.2f} s CPU), peak "
              f"RSS {r['peak_rss_mb']:,} MB "
              f"({r['rss_after_imports_mb']:,} MB after imports; {r['rss_now_mb']:,} MB at first send)")


if __name__ == "__main__":
    main()

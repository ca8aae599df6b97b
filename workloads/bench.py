"""`python -m workloads.bench [TRACE]`: seconds to read the Mooncake conversation trace and plan
its requests (arrivals, sessions, blocks: everything but prompt tokens). Not a test.

Default trace: $PWBENCH_TRACES/mooncake/conversation_trace.jsonl (12,031 rows); target under 2 s.
Token synthesis is timed separately on the first 100 requests, since a full replay's
prompts (145M tokens) are far more than any run would send.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from workloads.assemble import make_plan
from workloads.fit import traces_dir
from workloads.registry import ModelTarget, WorkloadSpec, workload_shape
from workloads.synth import HashBlockSynthesizer

TARGET = ModelTarget(vocab_size=32000, max_model_len=131072, special_ids=(0, 1, 2))


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else traces_dir() / "mooncake" / "conversation_trace.jsonl"
    spec = WorkloadSpec(f"trace:{path}")
    start = time.perf_counter()
    plan = make_plan(spec, TARGET, workload_shape(spec))
    plan_s = time.perf_counter() - start
    tokens = sum(s.input_tokens for s in plan.skeletons)
    print(f"read + plan {len(plan.skeletons)} requests ({tokens / 1e6:.1f}M prompt tokens): "
          f"{plan_s:.2f} s (target < 2 s)")
    synthesizer = HashBlockSynthesizer(spec.seed, TARGET.vocab_size, TARGET.special_ids)
    start = time.perf_counter()
    head = plan.skeletons[:100]
    for skeleton in head:
        synthesizer.synthesize(skeleton)
    synth_s = time.perf_counter() - start
    head_tokens = sum(s.input_tokens for s in head)
    print(f"synthesize tokens of the first {len(head)} prompts ({head_tokens / 1e6:.2f}M tokens): {synth_s:.2f} s "
          f"({head_tokens / synth_s / 1e6:.1f}M tokens/s)")


if __name__ == "__main__":
    main()

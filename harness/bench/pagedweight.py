"""PagedWeight against the baselines under one device budget, on the bundled demo model.

    python -m harness.bench.pagedweight [--requests 32] [--rate 1.5] [--shares 0.6,0.4,0.3]

Runs `rag_long` on the demo model (demo tasks: RAG recall and closed-book questions, Poisson
arrivals so the KV demand rises and falls) first with `moe` and no budget (prefix caching off)
to measure the peak KV the traffic needs, then, for each share s, under the budget
dense + s x (full-precision expert bytes + that peak KV) with: `moe` (every expert at 16 bits,
the KV cache gets the rest, when that is positive), `offload` (experts on the host, K slots per
layer from the budget), `static-rtn` and `static-gptq` at the widest of 8/4/3/2 bits whose
experts leave the peak KV room, and `pagedweight` with both representations. Prints one row
per engine: accuracy per task, KL and top-1 agreement against the float32 reference, KV
capacity (tokens), peak device bytes against the budget, mean bits, output tokens/s and
host->device bytes per output token. One run each; tokens/s are noisy, the rest is exact.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "engines" / "demo_model"
CPU32 = {"device": "cpu", "dtype": "float32"}


def expert_bytes_at(bits: int, experts: int, per_expert_fp: int, group: int = 32) -> int:
    """Packed bytes of every routed expert at `bits` (codes + a scale and zero per group of
    the static engines' default group size): an estimate to pick the static widths."""
    params = per_expert_fp // 4
    return experts * (params * bits // 8 + params // group * 8)


def main() -> None:
    from harness.run import RunArgs, execute  # noqa: PLC0415
    from workloads.registry import WorkloadSpec  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=1.5)  # few requests in flight: KV comparable to experts
    parser.add_argument("--shares", default="0.6,0.4,0.3")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    spec = WorkloadSpec("rag_long", requests=args.requests, rate=args.rate, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="pwbench-bench-") as tmp:
        def run(engine: str, name: str, quality: bool = True, **options):
            _, result = execute(RunArgs(workload=spec, engine=engine, model=str(DEMO),
                                        engine_options={**CPU32, **options}, output=str(Path(tmp) / name),
                                        warmup=0, quality=quality))
            return result

        ref = run("moe", "reference", quality=False, prefix_caching=False)
        stats = ref["engine"]["model_stats"]
        dense = ref["engine"]["weight_bytes"] - 2 * 4 * int(stats["bytes_per_expert"])
        experts_fp = ref["engine"]["weight_bytes"] - dense
        peak_kv = ref["summary"]["memory"]["peak_kv_bytes"]
        print(f"demo model: dense {dense:,} B, experts {experts_fp:,} B at full precision, peak KV of the traffic "
              f"{peak_kv:,} B ({args.requests} rag_long requests at {args.rate:g}/s)")
        print_row(ref, "moe (no budget)")
        for share in (float(s) for s in args.shares.split(",")):
            budget = int(dense + share * (experts_fp + peak_kv))
            print(f"\nbudget {budget:,} B = dense + {share:.0%} of (experts + peak KV)")
            static_bits = next((b for b in (8, 4, 3, 2)
                                if expert_bytes_at(b, 8, int(stats["bytes_per_expert"])) + peak_kv <= budget - dense), 2)
            # group 32: the demo's experts are 64 wide, the static engines' default 128 does not divide it
            plans = [("moe", {}), ("offload", {}), ("static-rtn", {"bits": static_bits, "group_size": 32}),
                     ("static-gptq", {"bits": static_bits, "group_size": 32}), ("pagedweight", {"representation": "bitplanes"}),
                     ("pagedweight", {"representation": "requantize"})]
            for engine, options in plans:
                label = engine + "".join(f" {k}={v}" for k, v in options.items())
                try:
                    result = run(engine, f"{share}-{label.replace(' ', '_')}", budget_bytes=budget, **options)
                except Exception as exc:  # noqa: BLE001  (a row that cannot run says why)
                    print(f"{label:34s} does not run: {exc}")
                    continue
                print_row(result, label)


def print_row(run: dict, label: str) -> None:
    s = run["summary"]
    acc = s["accuracy"]
    tasks = "  ".join(f"{t} {a['accuracy']:.1%}" for t, a in acc.items())
    q = run.get("quality") or {}
    kl = f"KL {q['kl_mean']:.4f} top-1 {q['top1_agreement']:.1%}" if "kl_mean" in q else "KL -"
    mem = s["memory"]
    bits = s.get("expert_precision", {}).get("mean_bits")
    print(f"{label:34s} {tasks}  {kl}  KV {run['engine']['kv_capacity_tokens']:,} tok  "
          f"peak {mem.get('peak_device_bytes', 0):,} B  bits {'-' if bits is None else f'{bits:.2f}'}  "
          f"{s['output_tokens_per_s']:.1f} tok/s  h2d {s['engine']['h2d_bytes_per_output_token'] or 0:,.0f} B/tok")


if __name__ == "__main__":
    main()

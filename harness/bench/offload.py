"""`offload` at budgets holding 100%, 50% and 25% of the experts, next to `moe` (CPU, float32).

    python -m harness.bench.offload [--models demo,mixtral] [--requests 16] [--link-gbps 25]

For each model (the bundled demo model; a random Mixtral-shaped one, hidden 512, 8 experts,
top-2, 8 layers, built by harness.bench.engines.build_model) it runs the `offline_batch`
workload through the harness (`pwbench run`'s code path) with `moe` and with `offload`
under a device budget = dense weights + the share of every layer's experts + a fixed KV
reserve, the link model on at --link-gbps, and prints output tokens/s, the expert cache hit
rate, host->device bytes per output token, compute's wait for copies, and with --prefetch how
many prefetched experts were used. Numbers are from this one run.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "engines" / "demo_model"
SHARES = (1.0, 0.5, 0.25)


def sizes(model: str) -> tuple[int, int, int, int]:
    """(dense bytes, bytes per expert, MoE layers, experts per layer) of a float32 folder."""
    from engines.registry import create_engine

    engine = create_engine("offload", {"model": model, "device": "cpu", "dtype": "float32", "experts_per_layer": 1})
    engine.start()
    try:
        mc = engine.checkpoint.config
        per_expert = int(engine.info().model_stats["bytes_per_expert"])
        return engine.weights.nbytes(), per_expert, sum(mc.moe_layers), mc.num_experts
    finally:
        engine.stop()


def main() -> None:
    from harness.bench.engines import build_model
    from harness.run import RunArgs, execute
    from workloads.registry import WorkloadSpec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,mixtral")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--link-gbps", type=float, default=25.0)
    parser.add_argument("--prefetch", action="store_true", help="offload with next-layer router prefetch")
    args = parser.parse_args()
    spec = WorkloadSpec("offline_batch", requests=args.requests, input_range=(args.input_len, args.input_len),
                        output_tokens=args.output_len)
    with tempfile.TemporaryDirectory(prefix="pwbench-bench-") as tmp:
        for name in args.models.split(","):
            model = str(DEMO)
            if name == "mixtral":
                model = str(Path(tmp) / "mixtral-shaped")
                build_model(Path(model))
            dense, per_expert, layers, experts = sizes(model)
            # KV for every request at full length, in float32 (the demo's and the Mixtral's shapes).
            kv_reserve = 64 << 20
            print(f"\n{name}: dense {dense / 2**20:.1f} MiB, {layers} MoE layers x {experts} experts x "
                  f"{per_expert / 2**20:.2f} MiB, KV reserve {kv_reserve / 2**20:.0f} MiB, link "
                  f"{args.link_gbps:g} GB/s")
            print(f"{'engine':8s} {'experts':>8s} {'budget MiB':>10s} {'out tok/s':>10s} {'hit rate':>9s} "
                  f"{'h2d B/token':>12s} {'stall s':>8s} {'prefetch used':>14s}")
            runs = [("moe", 1.0, {})] + [
                ("offload", share, {"policy": "lru", "prefetch": args.prefetch, "link_gbps": args.link_gbps,
                                    "kv_reserve_bytes": kv_reserve}) for share in SHARES]
            for engine, share, options in runs:
                slots = max(1, int(experts * share))
                budget = dense + layers * slots * per_expert + kv_reserve
                folder, run = execute(RunArgs(
                    workload=spec, engine=engine, model=model,
                    engine_options={"device": "cpu", "dtype": "float32", "budget_bytes": budget, **options},
                    output=str(Path(tmp) / f"{name}-{engine}-{share}"), warmup=1, quality=False))
                if run["status"] != "complete":
                    raise SystemExit(f"{engine} at {share:.0%}: {run['status']} {run.get('error')}")
                s, m = run["summary"], run["summary"]["memory"]
                got = run["engine"]["model_stats"].get("expert_slots_per_layer", experts)
                assert got == slots, f"budget {budget} gave {got} slots, expected {slots}"
                hit = m.get("expert_cache_hit_rate")
                prefetch = f"{m['prefetch_used']}/{m['prefetch_issued']}" if "prefetch_issued" in m else "-"
                print(f"{engine:8s} {slots:>3d}/{experts:<4d} {budget / 2**20:10.1f} {s['output_tokens_per_s']:10.1f} "
                      f"{'-' if hit is None else f'{hit:.1%}':>9s} "
                      f"{s['engine']['h2d_bytes_per_output_token'] or 0:12,.0f} "
                      f"{m.get('copy_stall_s', 0.0):8.2f} "
                      f"{prefetch:>14s}")


if __name__ == "__main__":
    main()

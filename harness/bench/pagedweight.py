"""PagedWeight against the baselines under one device budget, on the bundled demo model.

    python -m harness.bench.pagedweight [--requests 48] [--rate 1.5] [--burstiness 4]
        [--direct-share 0.5] [--shares 0.6,0.4,0.3] [--engines moe,offload,...]

The traffic is `rag_long` on the demo model with `--direct-share` of the requests direct
questions (no retrieved context: on the demo model closed-book questions, the task that
loses most at low precision: 98.9% at full precision, 71.7% with 2-bit experts) and gamma
arrivals of `--burstiness`, so the long RAG prompts' KV demand comes in bursts and ebbs.
It runs `moe` with no budget (prefix caching off) to measure the peak KV the traffic needs,
then, for each share s, under the budget dense + s x (full-precision expert bytes + that peak
KV): `moe` (every expert at 16 bits, the KV cache gets the rest, when that is positive),
`offload` (experts on the host, one device slot per layer: the most KV at full precision), `static-rtn` and
`static-gptq` at the widest of 8/4/3/2 bits whose experts leave the peak KV room, and
`pagedweight` with both representations, `moegen` and `full` (KV in the host tier when their
plan says so: their KV capacity is then the host pool's). One row per engine: accuracy per task, KL and
top-1 agreement against the float32 reference (measured after the run on 16 held-out
prompts submitted at once under the same budget, so a pagedweight engine is at its most
demoted then), peak KV held (tokens) and the pool's capacity, peak device bytes, mean bits
over the run's steps, output tokens/s and host->device bytes per output token. One run
each; tokens/s are noisy, the rest is deterministic.
"""

from __future__ import annotations

import argparse
import tempfile
import tomllib
from pathlib import Path
from types import MappingProxyType

DEMO = Path(__file__).resolve().parents[2] / "engines" / "demo_model"
CPU32 = {"device": "cpu", "dtype": "float32"}
# Row name -> (engine, options), from pagedweight.toml (engine names live in data, not code),
# and the rows run when --engines is not given.
_TABLES = tomllib.loads(Path(__file__).with_suffix(".toml").read_text())
ENGINES = MappingProxyType({row: (t["engine"], dict(t.get("options", {}))) for row, t in _TABLES.items()})
DEFAULT_ROWS = tuple(row for row, t in _TABLES.items() if t.get("default", True))


def expert_bytes_at(bits: int, experts: int, per_expert_fp: int, group: int = 32) -> int:
    """Packed bytes of every routed expert at `bits` (codes + a scale and zero per group of
    the static engines' default group size): an estimate to pick the static widths."""
    params = per_expert_fp // 4
    return experts * (params * bits // 8 + params // group * 8)


def main() -> None:
    from harness.run import RunArgs, execute
    from workloads.registry import WorkloadSpec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=1.5)  # few requests in flight: KV comparable to experts
    parser.add_argument("--burstiness", type=float, default=4.0)
    parser.add_argument("--direct-share", type=float, default=0.5)
    parser.add_argument("--shares", default="0.6,0.4,0.3")
    # The budgets rest on this many KV tokens, not on the reference run's measured peak (it
    # moves with the machine's speed: open-loop arrivals), so every run of the bench uses
    # the same budgets; the measured peak is printed beside it.
    parser.add_argument("--kv-tokens", type=int, default=3000)
    parser.add_argument("--engines", default=",".join(DEFAULT_ROWS), help="rows to run, of " + ", ".join(ENGINES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    spec = WorkloadSpec("rag_long", requests=args.requests, rate=args.rate, seed=args.seed, arrival="gamma",
                        burstiness=args.burstiness, direct_share=args.direct_share)
    wanted = args.engines.split(",")
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
        kv_token = int(stats["kv_bytes_per_token"])
        peak_kv = args.kv_tokens * kv_token
        measured = ref["summary"]["memory"]["peak_kv_bytes"]
        print(f"demo model: dense {dense:,} B, experts {experts_fp:,} B at full precision, KV "
              f"{args.kv_tokens:,} tokens "
              f"= {peak_kv:,} B (the reference run held at most {measured // kv_token:,}; {args.requests} rag_long "
              f"requests at {args.rate:g}/s, gamma CV^2 {args.burstiness:g}, "
              f"{args.direct_share:.0%} direct questions)")
        print_row(ref, "moe (no budget)")
        for share in (float(s) for s in args.shares.split(",")):
            budget = int(dense + share * (experts_fp + peak_kv))
            print(f"\nbudget {budget:,} B = dense + {share:.0%} of (experts + peak KV) "
                  f"= {budget / (dense + experts_fp + peak_kv):.0%} of (full-precision weights + peak KV)")
            static_bits = next((b for b in (8, 4, 3, 2)
                                if expert_bytes_at(b, 8, int(stats["bytes_per_expert"])) + peak_kv <= budget - dense),
                               2)
            # the static engines at that width and at 4 bits (on this model 4 -> 2 bits frees only
            # 6% of the full-precision expert bytes: each group of 32 carries a 4-byte scale and zero)
            runs = [(engine, {**options, "bits": b} if engine.startswith("static-") else options)
                    for engine, options in (ENGINES[row] for row in wanted)
                    for b in (sorted({static_bits, 4}, reverse=True) if engine.startswith("static-") else [None])]
            for engine, options in runs:
                label = engine + "".join(f" {k}={v}" for k, v in options.items())
                try:
                    result = run(engine, f"{share}-{label.replace(' ', '_')}", budget_bytes=budget, **options)
                except Exception as exc:  # noqa: BLE001  (a row that cannot run says why)
                    print(f"{label:38s} does not run: {exc}")
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
    kv_token = run["engine"]["model_stats"]["kv_bytes_per_token"]
    failed = f"  FAILED {s['failed']}" if s.get("failed") else ""
    host = run["engine"]["model_stats"].get("plan_kv_on_host")  # moegen / full: the pool is in the host tier
    held = "host" if host else f"{mem.get('peak_kv_bytes', 0) // kv_token:,.0f}"
    print(f"{label:38s} {tasks}{failed}  {kl}  KV held {held} "
          f"of {run['engine']['kv_capacity_tokens']:,} tok{' (host)' if host else ''}  "
          f"peak {mem.get('peak_device_bytes', 0):,} B  bits {'-' if bits is None else f'{bits:.2f}'}  "
          f"{s['output_tokens_per_s']:.1f} tok/s  h2d {s['engine']['h2d_bytes_per_output_token'] or 0:,.0f} B/tok")


if __name__ == "__main__":
    main()

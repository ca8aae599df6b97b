"""`moegen` next to `offload` and `moe` on the Mixtral-shaped model (CPU, float32, link model).

    python -m harness.bench.moegen [--requests 128] [--input-len 128] [--output-len 32]
                                   [--decode-seqs 256] [--link-gbps 25] [--parts bytes,decode]

Measures this machine's peaks (`pwbench hw`'s measurement, into a temporary cache, so the
runs' efficiency figures and moegen's plan use them) right before each engine's run. The
speed of a shared machine drifts by a fifth within seconds, so in the decode part every
decode step is paired with the two peaks probed right after it (harness.hw.PeakProbe, outside
the step's time) and its roofline uses those. Then, on a random Mixtral-shaped
checkpoint (hidden 512, 8 experts, top-2, 8 layers; harness.bench.engines.build_model):

- **bytes**: `offline_batch` (every request at t=0, fixed lengths) through `moe` (no budget,
  everything resident), `offload` and `moegen` at one device budget = dense weights + a
  quarter of the expert weights + offload's default KV reserve (20% of budget - dense), the
  link model at --link-gbps for both: output tokens/s, host->device bytes per output token
  and their ratio, moegen's plan and its predicted against measured decode step time.
- **decode**: a decode-heavy run (--decode-seqs requests of 32 prompt and 64 output tokens)
  through `moe` and `moegen` (at a budget holding every expert; KV on the host), each
  engine's decode step time (p50) against this machine's roofline for that step:
  max(bytes read / bandwidth, FLOPs / FLOP rate), bytes and FLOPs as the summary's MBU/MFU
  count them, at the peaks probed right after the step; "of roofline" is the median of the
  steps' roofline / step time.

Timings are from this one run on a shared machine; bytes and plans are exact.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def run_one(tmp: Path, model: str, spec, engine: str, options: dict, tag: str, on_step=None) -> dict:
    from harness.run import RunArgs, execute

    _, run = execute(RunArgs(workload=spec, engine=engine, model=model,
                             engine_options={"device": "cpu", "dtype": "float32", **options},
                             output=str(tmp / tag), warmup=1, quality=False), on_step=on_step)
    if run["status"] != "complete":
        raise SystemExit(f"{engine}: {run['status']} {run.get('error')}")
    return run


def fresh_peaks() -> dict:
    """This machine's peaks measured now, cached for the next engine's start (its plan)."""
    from harness.hw import measure, save_cached

    peaks = measure("cpu")
    save_cached(peaks)
    return peaks


def decode_p50(folder: Path, probes: dict[int, dict] | None = None) -> tuple[float, float, float]:
    """Median decode-only step time, the median roofline time of those steps and the median
    of roofline / step time (s, s, share), at the peaks probed after each step (`probes`, by
    step index) or else the ones the run recorded."""
    import pandas as pd

    from harness.results import read_run

    run = read_run(folder)
    steps = pd.read_parquet(folder / "steps.parquet")
    dec = steps[(steps["prefill_tokens"] == 0) & (steps["decode_tokens"] > 0)]
    m, peaks = run["engine"]["model_stats"], run["environment"]["peaks"]

    def peak(key: str):  # per step when probed, else the run's one figure
        return pd.Series([probes[i][key] for i in dec.index], index=dec.index) if probes is not None else peaks[key]

    bw, rate = peak("memory_bandwidth_bytes_per_s"), peak("matmul_flops_per_s")
    read = dec["weight_bytes_read"] + dec["context_tokens"] * m["kv_bytes_per_token"]
    flops = 2 * m["active_params_per_token"] * dec["decode_tokens"]
    roof = pd.concat([read / bw, flops / rate], axis=1).max(axis=1)
    return float(dec["duration_s"].median()), float(roof.median()), float((roof / dec["duration_s"]).median())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--decode-seqs", type=int, default=256)
    parser.add_argument("--link-gbps", type=float, default=25.0)
    parser.add_argument("--parts", default="bytes,decode")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pwbench-bench-") as tmp_name:
        tmp = Path(tmp_name)
        os.environ["PWBENCH_CACHE"] = str(tmp / "cache")
        from harness.bench.engines import build_model
        from harness.bench.offload import sizes
        from workloads.registry import WorkloadSpec

        def show(peaks: dict) -> str:
            return (f"{peaks['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
                    f"{peaks['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s"
                    + (f", {peaks['op_overhead_s'] * 1e6:.1f} us per torch call" if "op_overhead_s" in peaks else ""))

        print(f"peaks: {show(fresh_peaks())}")

        model = str(tmp / "mixtral-shaped")
        build_model(Path(model))
        dense, per_expert, layers, experts = sizes(model)
        parts = args.parts.split(",")
        if "bytes" in parts:
            quarter = layers * experts * per_expert // 4
            budget = dense + int(quarter / 0.8) + 1  # offload: K = E/4 slots beside its 20% KV reserve
            spec = WorkloadSpec("offline_batch", requests=args.requests, input_range=(args.input_len, args.input_len),
                                output_tokens=args.output_len)
            context = args.input_len + args.output_len // 2
            link = {"link_gbps": args.link_gbps}
            print(f"\nbytes: {args.requests} requests x {args.input_len} in / {args.output_len} out at t=0; budget "
                  f"{budget / 2**20:.1f} MiB = dense {dense / 2**20:.1f} + quarter of the "
                  f"experts {quarter / 2**20:.1f} "
                  f"+ offload's KV reserve; link {args.link_gbps:g} GB/s")
            print(f"{'engine':8s} {'out tok/s':>10s} {'h2d B/token':>12s} "
                  f"{'decode step p50 ms':>19s} {'predicted ms':>13s}")
            results, peaks_at = {}, {}
            for engine, options in (("moe", {}), ("offload", {"budget_bytes": budget, **link}),
                                    ("moegen", {"budget_bytes": budget, "plan_context": context,
                                                "max_num_seqs": args.requests, "host_kv_gb": 0.5, **link})):
                peaks_at[engine] = fresh_peaks()  # what the run's figures (and moegen's plan) start from
                run = run_one(tmp, model, spec, engine, options, f"bytes-{engine}")
                s = run["summary"]
                results[engine] = run
                plan = s.get("plan", {})
                print(f"{engine:8s} {s['output_tokens_per_s']:10.1f} "
                      f"{s['engine']['h2d_bytes_per_output_token'] or 0:12,.0f} "
                      f"{decode_p50(tmp / f'bytes-{engine}')[0] * 1e3:19.1f} "
                      f"{(plan.get('decode_predicted_step_s_p50') or 0) * 1e3:13.1f}")
            print("peaks measured before each start: " + "; ".join(f"{e} {show(p)}" for e, p in peaks_at.items()))
            o, g = (results[e]["summary"] for e in ("offload", "moegen"))
            stats = results["moegen"]["engine"]["model_stats"]
            print(f"offload / moegen h2d bytes per output token: "
                  f"{o['engine']['h2d_bytes_per_output_token'] / g['engine']['h2d_bytes_per_output_token']:.1f}x; "
                  f"moegen / offload output tok/s: {g['output_tokens_per_s'] / o['output_tokens_per_s']:.2f}x")
            where = ("host, streamed to the device" if stats.get("plan_kv_streamed")
                     else "host") if stats["plan_kv_on_host"] \
                else "device"
            print(f"moegen plan: KV on {where}, batch {stats['plan_batch_seqs']:.0f}, "
                  f"micro-batch {stats['plan_micro_batch']:.0f}, ring {stats['plan_expert_slots']:.0f} slots, "
                  f"{stats['plan_resident_experts']:.0f}/{layers * experts} experts resident; "
                  f"predicted / measured, all steps {g['plan']['predicted_over_measured']:.2f}, decode steps "
                  f"{g['plan'].get('decode_predicted_over_measured', float('nan')):.2f}; expert copies "
                  f"{g['memory'].get('expert_copy_busy_s', 0):.2f} s on the link, "
                  f"{g['memory'].get('expert_copy_overlap_share', 0):.0%} hidden under compute (all copies, "
                  f"activations included: {g['memory'].get('copy_overlap_share', 0):.0%})")
        if "decode" in parts:
            n = args.decode_seqs
            spec = WorkloadSpec("offline_batch", requests=n, input_range=(32, 32), output_tokens=64)
            full = dense + layers * experts * per_expert + (1 << 20)
            print(f"\ndecode: {n} requests x 32 in / 64 out at t=0; each decode step's roofline = "
                  "max(bytes / bandwidth, "
                  f"FLOPs / FLOP rate) at the peaks probed right after it")
            from harness.hw import PeakProbe

            probe, rows = PeakProbe(), []
            for engine, options in (("moe", {"max_num_seqs": n}),
                                    ("moegen", {"max_num_seqs": n, "budget_bytes": full, "kv_placement": "host",
                                                "plan_context": 64, "host_kv_gb": 0.5})):
                print(f"peaks before {engine}'s start: {show(fresh_peaks())}")
                probes: dict[int, dict] = {}

                def after_step(records) -> None:
                    s = records.steps[-1]
                    if s["prefill_tokens"] == 0 and s["decode_tokens"] > 0:
                        probes[len(records.steps) - 1] = probe()

                run = run_one(tmp, model, spec, engine, options, f"decode-{engine}", after_step)
                rates = sorted(p["matmul_flops_per_s"] for p in probes.values())
                print(f"{engine}: matmul peak probed after its decode steps {rates[0] / 1e9:.0f}-{rates[-1] / 1e9:.0f} "
                      f"GFLOP/s (median {rates[len(rates) // 2] / 1e9:.0f})")
                rows.append((engine, run, *decode_p50(tmp / f"decode-{engine}", probes)))
            print(f"{'engine':8s} {'decode tok/s':>12s} {'step p50 ms':>12s} {'roofline ms':>12s} "
                  f"{'of roofline':>12s} {'predicted ms':>13s}")
            for engine, run, step, roof, share in rows:
                plan = run["summary"].get("plan", {})
                print(f"{engine:8s} {run['summary']['engine']['decode_tokens_per_s']:12.1f} {step * 1e3:12.1f} "
                      f"{roof * 1e3:12.1f} {share:12.0%} {(plan.get('decode_predicted_step_s_p50') or 0) * 1e3:13.1f}")


if __name__ == "__main__":
    main()

"""`moe` vs `hf` output throughput on a Mixtral-shaped random model (CPU, float32).

    python -m harness.bench.engines [--requests 64] [--input-len 128-1024] [--output-len 128]

Builds a random Mixtral-shaped checkpoint (hidden 512, 8 experts, top-2, 8 layers, ~115M
parameters; seeded) in a temporary folder, runs the `offline_batch` workload (all requests at
t=0, prompt lengths drawn from the range, fixed output length, ignore EOS) through both
engines with the harness, and prints each engine's output tokens/s and the ratio, measured in
this one run. The `hf` engine is transformers' generate() with static batches of
`--hf-batch` requests (left padding).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def build_model(folder: Path, seed: int = 0) -> None:
    import torch  # noqa: PLC0415
    from transformers import MixtralConfig, MixtralForCausalLM  # noqa: PLC0415

    config = MixtralConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
    )
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    model.save_pretrained(folder)


def main() -> None:
    from harness.run import RunArgs, execute  # noqa: PLC0415
    from workloads.registry import WorkloadSpec, parse_length_range  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--input-len", default="128-1024")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--engines", default="moe,hf", help="comma-separated; the first two are compared")
    args = parser.parse_args()
    engines = args.engines.split(",")
    per_engine = {"hf": {"max_batch_size": args.hf_batch}}  # static batch size of transformers' generate()
    spec = WorkloadSpec("offline_batch", requests=args.requests, input_range=parse_length_range(args.input_len),
                        output_tokens=args.output_len)
    with tempfile.TemporaryDirectory(prefix="pwbench-bench-") as tmp:
        model = Path(tmp) / "mixtral-shaped"
        build_model(model)
        results = {}
        for engine in engines:
            options = per_engine.get(engine, {})
            folder, run = execute(RunArgs(workload=spec, engine=engine, model=str(model), engine_options=options,
                                          output=str(Path(tmp) / engine), warmup=1, quality=False))
            s = run["summary"]
            results[engine] = s["output_tokens_per_s"]
            print(f"{engine:4s} output {s['output_tokens_per_s']:8.1f} tok/s  total {s['duration_s']:7.1f} s  "
                  f"TTFT p50 {s['ttft_ms']['p50'] / 1e3:6.1f} s  TPOT p50 {s['tpot_ms']['p50']:7.1f} ms  "
                  f"prefill {s['engine']['prefill_tokens_per_s'] or 0:8.1f} tok/s")
        if len(results) >= 2:
            a, b = engines[:2]
            print(f"{a} / {b} output tokens/s: {results[a] / results[b]:.2f}x")


if __name__ == "__main__":
    main()

"""`moe` vs `hf` output throughput on Mixtral- and DeepSeek-V3-shaped random models (CPU, float32).

    python -m harness.bench.engines [--requests 64] [--input-len 128-1024] [--output-len 128]
                                    [--models mixtral,deepseek_v3]

Builds each random checkpoint (seeded) in a temporary folder: Mixtral-shaped (hidden 512, 8
experts, top-2, 8 layers, ~115M parameters) and DeepSeek-V3-shaped (hidden 512, MLA with a
128-value latent, 32 fine-grained experts in 4 groups, top-4 from 2 groups, 1 shared expert,
a dense first layer, 8 layers). Runs the `offline_batch` workload (all requests at t=0,
prompt lengths drawn from the range, fixed output length, ignore EOS) through both engines
with the harness, and prints each engine's output tokens/s, the ratio, and the model
statistics the budgets rest on (KV bytes per token, bytes per expert), measured in this one
run. The `hf` engine is transformers' generate() with static batches of `--hf-batch`
requests (left padding).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

MODELS = ("mixtral", "deepseek_v3")


def build_model(folder: Path, arch: str = "mixtral", seed: int = 0, config_only: bool = False) -> None:
    """A seeded random checkpoint of `arch` in `folder`: "mixtral" and "deepseek_v3" as the module
    docstring says (float32), or "mixtral_layers": Mixtral-8x7B's own dimensions (hidden 4096, 8
    experts of 14336, top-2, 32 heads / 8 KV heads, vocab 32000) in 2 of its 32 layers, 2.9B
    parameters in bfloat16 (5.8 GB), built on the GPU when there is one: each step's GEMMs, expert
    bytes and copies are the real model's per layer, for validating a GPU's profile. With
    `config_only` only config.json (a simulated run needs no more)."""
    import torch
    import transformers

    dtype = torch.float32
    if arch == "mixtral_layers":
        config = transformers.MixtralConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
            num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
            rope_theta=1e6,
        )
        model_cls, dtype = transformers.MixtralForCausalLM, torch.bfloat16
    elif arch == "mixtral":
        config = transformers.MixtralConfig(
            vocab_size=32000, hidden_size=512, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
        )
        model_cls = transformers.MixtralForCausalLM
    elif arch == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            vocab_size=32000, hidden_size=512, intermediate_size=1536, moe_intermediate_size=192,
            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=32, n_group=4,
            topk_group=2, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=192,
            kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, max_position_embeddings=4096,
        )
        model_cls = transformers.DeepseekV3ForCausalLM
    else:
        raise SystemExit(f"--models: unknown model {arch!r}; choose from {', '.join(MODELS)}")
    if config_only:  # enough for a simulated run
        config.save_pretrained(folder)
        return
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda" if dtype != torch.float32 and torch.cuda.is_available() else "cpu"):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    print(f"model {arch}-shaped: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    model.save_pretrained(folder)


def main() -> None:
    from harness.run import RunArgs, execute
    from workloads.registry import WorkloadSpec, parse_length_range

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--input-len", default="128-1024")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--engines", default="moe,hf", help="comma-separated; the first two are compared")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    args = parser.parse_args()
    engines = args.engines.split(",")
    per_engine = {"hf": {"max_batch_size": args.hf_batch}}  # static batch size of transformers' generate()
    spec = WorkloadSpec("offline_batch", requests=args.requests, input_range=parse_length_range(args.input_len),
                        output_tokens=args.output_len)
    with tempfile.TemporaryDirectory(prefix="pwbench-bench-") as tmp:
        for arch in args.models.split(","):
            model = Path(tmp) / f"{arch}-shaped"
            build_model(model, arch)
            results = {}
            for engine in engines:
                options = per_engine.get(engine, {})
                folder, run = execute(RunArgs(workload=spec, engine=engine, model=str(model), engine_options=options,
                                              output=str(Path(tmp) / f"{arch}-{engine}"), warmup=1, quality=False))
                s = run["summary"]
                results[engine] = s["output_tokens_per_s"]
                print(f"{engine:4s} output {s['output_tokens_per_s']:8.1f} tok/s  total {s['duration_s']:7.1f} s  "
                      f"TTFT p50 {s['ttft_ms']['p50'] / 1e3:6.1f} s  TPOT p50 {s['tpot_ms']['p50']:7.1f} ms  "
                      f"prefill {s['engine']['prefill_tokens_per_s'] or 0:8.1f} tok/s")
                stats = run.get("engine", {}).get("model_stats") or {}
                if stats:
                    print(f"     KV {stats['kv_bytes_per_token']:,.0f} B/token, expert "
                          f"{stats['bytes_per_expert']:,.0f} B, "
                          f"active {stats['active_params_per_token'] / 1e6:.1f}M params/token")
            if len(results) >= 2:
                a, b = engines[:2]
                print(f"{arch}: {a} / {b} output tokens/s: {results[a] / results[b]:.2f}x")


if __name__ == "__main__":
    main()

"""Tiny random checkpoints of every supported architecture, written by transformers' own
config classes and save_pretrained: the layouts users have on disk, at test size."""

from __future__ import annotations

import json
from pathlib import Path

# Odd sizes on purpose: hidden 96, 6 experts, grouped-query attention, top-2 and top-3, a head
# dim that differs from hidden/heads (Qwen3), a dense layer between MoE layers (Qwen2-MoE).
ARCH_KWARGS: dict[str, dict] = {
    "mixtral": dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=64,
        num_local_experts=6, num_experts_per_tok=2, num_hidden_layers=2,
    ),
    "qwen2_moe": dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=72,
        moe_intermediate_size=40, shared_expert_intermediate_size=56, num_experts=6,
        num_experts_per_tok=3, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=72,
        moe_intermediate_size=40, num_experts=6, num_experts_per_tok=3, num_hidden_layers=2,
        norm_topk_prob=True,
    ),
    "olmoe": dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=48,
        num_experts=6, num_experts_per_tok=2, num_hidden_layers=2, clip_qkv=3.0,
    ),
    # 12 routed experts in 3 groups, top-4 from the best 2 groups, 1 shared expert, a dense
    # first layer; MLA with a low-rank query (q_lora_rank=None is a test variant).
    "deepseek_v3": dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=80,
        moe_intermediate_size=24, n_routed_experts=12, n_group=3, topk_group=2, num_experts_per_tok=4,
        n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, routed_scaling_factor=2.5,
    ),
    # Partial rotary (half of head dim 16), per-head q/k norm, q/k/v biases, grouped routing.
    "glm4_moe": dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=80,
        moe_intermediate_size=24, n_routed_experts=12, n_group=3, topk_group=2, num_experts_per_tok=4,
        n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3, use_qk_norm=True,
        attention_bias=True, routed_scaling_factor=1.5,
    ),
    # Attention sinks, sliding window 6 (shorter than most prompts) on alternate layers, biases
    # everywhere, clamped SwiGLU with gate/up interleaved, YaRN; sizes multiples of 32 for MXFP4.
    "gpt_oss": dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
        num_local_experts=6, num_experts_per_tok=2, num_hidden_layers=2, sliding_window=6, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False},
    ),
}
ARCHS = tuple(ARCH_KWARGS)
# Architectures whose experts are bias-free SwiGLU (every one but gpt-oss).
PLAIN_EXPERT_ARCHS = tuple(a for a in ARCHS if a != "gpt_oss")
# Every shape the acceptance grid covers: name -> (transformers architecture, overrides beside
# ARCH_KWARGS). Kimi K2 is DeepSeek-V3's architecture with more routed experts (384 vs 256),
# fewer heads (64 vs 128), one expert group and top-8; here 24 experts, 2 heads, top-6.
ARCH_CASES: dict[str, tuple[str, dict]] = {
    **{arch: (arch, {}) for arch in ARCHS},
    "deepseek_v3-no_q_lora": ("deepseek_v3", {"q_lora_rank": None}),
    "kimi_k2": ("deepseek_v3", {"n_routed_experts": 24, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6,
                                "num_attention_heads": 2, "num_key_value_heads": 2}),
}
VOCAB = 257
EOS = 2
# Engine options that match the float32 transformers reference on CPU. Tests that compare
# with it pass these, so on a CUDA host they still compare float32 with float32 (the engines
# would otherwise pick the GPU and bfloat16); the CUDA-marked variants live in tests/gpu.
CPU32 = {"device": "cpu", "dtype": "float32"}


def build_hf_model(arch: str, seed: int = 0, **overrides):
    """A random transformers model of `arch` (float32, eval mode)."""
    import torch
    import transformers

    cls_cfg, cls_model = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[arch]
    kwargs = dict(ARCH_KWARGS[arch], vocab_size=VOCAB, max_position_embeddings=512, eos_token_id=EOS,
                  bos_token_id=1, pad_token_id=0, initializer_range=0.08, tie_word_embeddings=False)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**kwargs)).eval()
    with torch.no_grad():
        # transformers initialises the routing correction bias to zeros; random values make the
        # tests see that it steers the choice and not the weights.
        gen = torch.Generator().manual_seed(seed)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3)
        # gpt-oss's biases and sinks start at zero too: random ones make them matter. The
        # attention and router biases stay small (0.05): at 0.5 the attention output biases
        # swamp the residual stream and every token routes to the same two of six experts.
        for name, param in model.named_parameters():
            if arch == "gpt_oss" and name.endswith(("bias", "sinks")):
                scale = 0.5 if ".experts." in name or name.endswith("sinks") else 0.05
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    if arch == "gpt_oss":
        # transformers before swiglu_limit / swiglu_alpha became config fields (5.17 has them as
        # constants, 7.0 and 1.702) ignores the config's clamp: the oracle must compute what the
        # config says, as the checkpoint's readers do. (On an H200 with 5.17 the engine's logits
        # were 0.80 off exactly as with limit 7.0 forced here.)
        for module in model.modules():
            if hasattr(module, "limit") and hasattr(module, "alpha"):
                module.limit = model.config.swiglu_limit
                module.alpha = getattr(model.config, "swiglu_alpha", 1.702)
    return model


def save_checkpoint(model, path: Path, layout: str = "per_expert") -> Path:
    """Write `model` as a HF folder: per_expert (save_pretrained), sharded, or fused 3-D experts."""
    path.mkdir(parents=True, exist_ok=True)
    if layout == "per_expert":
        model.save_pretrained(path)
    elif layout == "sharded":
        model.save_pretrained(path, max_shard_size="150KB")
    elif layout == "fused":
        from safetensors.torch import save_file

        model.save_pretrained(path)
        (path / "model.safetensors").unlink()
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
                 or not model.config.tie_word_embeddings}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        raise ValueError(layout)
    return path


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))

"""What the newer architectures need beyond token equality: MLA's KV cache holds the latent and
the rope key only, model statistics follow the real shapes, multi-token-prediction layers are
skipped by name and nothing else is."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import CPU32, build_hf_model, edit_config

from engines.base import EngineRequest, ModelLoadError
from engines.moe import MoEEngine, MoEEngineConfig

F32 = 4  # bytes


def test_mla_kv_cache_holds_latent_and_rope_key(checkpoints):
    engine = MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints("deepseek_v3")), block_size=4, kv_blocks=10))
    with engine:
        cfg = engine.checkpoint.config
        m = cfg.mla
        per_token = cfg.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * F32
        assert engine.info().model_stats["kv_bytes_per_token"] == per_token
        assert engine.kv.block_bytes == 4 * per_token
        assert engine.kv.nbytes() == sum(t.numel() * t.element_size() for t in engine.kv.k + engine.kv.v)
        assert engine.kv.nbytes() == 10 * 4 * per_token
        for k, v in zip(engine.kv.k, engine.kv.v):
            assert tuple(k.shape) == (1, 10, 4, m.kv_lora_rank) and tuple(v.shape) == (1, 10, 4, m.qk_rope_head_dim)
        # Full per-head K/V would take heads x (qk + v head dims): MLA's point, 5x less here.
        full = cfg.num_layers * cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * F32
        assert per_token * 5 == full
        assert engine.info().kv_cache_bytes == engine.kv.nbytes()


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "gpt_oss"])
def test_model_stats_follow_the_transformers_model(arch, checkpoints):
    hf = build_hf_model(arch)
    c = hf.config
    routed = {n for n, _ in hf.named_parameters() if ".mlp.experts." in n}
    dense = sum(p.numel() for n, p in hf.named_parameters() if n not in routed and "embed_tokens" not in n)
    dense += sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    if arch == "gpt_oss":  # experts with biases: gate_up [2I, D] + [2I], down [D, I] + [D]
        num_experts, inter, moe_layers = c.num_local_experts, c.intermediate_size, c.num_hidden_layers
        per_expert = 3 * c.hidden_size * inter + 2 * inter + c.hidden_size
    else:
        num_experts, inter = c.n_routed_experts, c.moe_intermediate_size
        moe_layers = c.num_hidden_layers - c.first_k_dense_replace
        per_expert = 3 * c.hidden_size * inter
    assert sum(hf.get_parameter(n).numel() for n in routed) == moe_layers * num_experts * per_expert
    if arch == "deepseek_v3":
        kv = c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim)
    else:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim
    with MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints(arch)))) as engine:
        stats = engine.info().model_stats
    assert stats["dense_weight_bytes"] == dense * F32
    assert stats["bytes_per_expert"] == per_expert * F32
    assert stats["active_params_per_token"] == dense + moe_layers * c.num_experts_per_tok * per_expert
    assert stats["kv_bytes_per_token"] == kv * F32


def _add_mtp_layer(folder, num_layers: int) -> None:
    path = folder / "model.safetensors"
    state = load_file(path)
    state[f"model.layers.{num_layers}.eh_proj.weight"] = torch.zeros(8, 8)
    state[f"model.layers.{num_layers}.enorm.weight"] = torch.ones(8)
    save_file(state, path, metadata={"format": "pt"})


def test_multi_token_prediction_layers_are_skipped_and_named(checkpoints, copy_checkpoint, caplog):
    original = checkpoints("deepseek_v3")
    folder = copy_checkpoint(original)
    _add_mtp_layer(folder, 3)

    def tokens(path):
        with MoEEngine(MoEEngineConfig(**CPU32, model=str(path))) as engine:
            engine.add_request(EngineRequest("a", (5, 6, 7), 6, ignore_eos=True))
            out = []
            while engine.has_unfinished():
                out += [t for o in engine.step().outputs for t in o.new_token_ids]
            return out

    with caplog.at_level(logging.INFO, logger="engines.runtime.checkpoint"):
        assert tokens(folder) == tokens(original)
    assert "skipped 2 tensors of 1 multi-token-prediction layer(s)" in caplog.text
    # Without MTP layers in the config, a layer past the last is a tensor nothing uses.
    edit_config(folder, num_nextn_predict_layers=0)
    with pytest.raises(ModelLoadError, match="do not belong"):
        MoEEngine(MoEEngineConfig(**CPU32, model=str(folder))).start()

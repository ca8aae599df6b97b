"""The config-only presets: each config.json parses with pwbench's own parser, its parameter
total (from engines.runtime.shape.model_shape) matches the published total within 2%, and a
preset's name resolves to its folder wherever a model folder is expected."""

from __future__ import annotations

import json

import pytest

from engines.common.demo import resolve_model
from engines.runtime.config import parse_config
from engines.runtime.shape import model_shape
from engines.sim.presets import PRESETS, PRESETS_DIR, preset_path

# Published total parameters (B) and where they are published (engines/sim/presets/SOURCES.md).
PUBLISHED = {
    "mixtral-8x7b": (46.7, "Mistral AI, Mixtral of experts (Dec 2023): 46.7B total, 12.9B active"),
    "mixtral-8x22b": (141, "Mistral AI, Mixtral 8x22B (Apr 2024): 141B total, 39B active"),
    "qwen1.5-moe-a2.7b": (14.3, "Qwen1.5-MoE-A2.7B model card: 14.3B total"),
    "qwen3-30b-a3b": (30.5, "Qwen3-30B-A3B model card: 30.5B total, 3.3B active"),
    "qwen3-235b-a22b": (235, "Qwen3-235B-A22B model card: 235B total, 22B active"),
    "deepseek-v3": (671, "DeepSeek-V3 README_WEIGHTS: 671B main model (MTP module extra)"),
    "kimi-k2": (1040, "Kimi K2: 1.04T total (tech report figure, as quoted by agentwiki; model card: 1T)"),
    "gpt-oss-20b": (20.91, "OpenAI gpt-oss model card: 20.91B total"),
    "gpt-oss-120b": (116.83, "OpenAI gpt-oss model card: 116.83B total"),
    "olmoe-1b-7b": (6.9, "OLMoE paper (arXiv:2409.02060): 6.9B total, 1.3B active"),
    "glm-4.5-air": (106, "GLM-4.5 README: GLM-4.5-Air 106B total, 12B active"),
}


def shape(name: str):
    path = preset_path(name) / "config.json"
    return parse_config(json.loads(path.read_text()), str(path), None)


def test_presets_are_the_ones_named():
    assert set(PRESETS) == set(PUBLISHED) and all(p.parent == PRESETS_DIR for p in PRESETS.values())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parses_and_totals_match_published(name):
    s = model_shape(shape(name), 2)
    total = s.dense_bytes / 2 + s.moe_layers * s.experts * s.expert_bytes / 2
    published, source = PUBLISHED[name]
    assert abs(total / 1e9 - published) / published < 0.02, f"{name}: {total / 1e9:.2f}B vs {published}B ({source})"


def test_brief_numbers():
    # ../shared/BRIEF.md: Mixtral-8x7B hidden 4096, 32 layers, 8 experts top-2, expert 14336, 32/8 heads,
    # vocab 32000, one expert ~352 MB in bf16; DeepSeek-V3 61 layers (3 dense), 256 routed + 1 shared,
    # top-8 in 8 groups (top-4 groups), expert 2048, kv_lora_rank 512, rope key 64, vocab 129280.
    m = shape("mixtral-8x7b")
    assert (m.hidden_size, m.num_layers, m.num_experts, m.top_k, m.moe_intermediate_size, m.num_heads,
            m.num_kv_heads, m.vocab_size) == (4096, 32, 8, 2, 14336, 32, 8, 32000)
    assert model_shape(m, 2).expert_bytes == 3 * 4096 * 14336 * 2 == pytest.approx(352e6, rel=0.01)
    d = shape("deepseek-v3")
    assert (d.num_layers, sum(d.moe_layers), d.num_experts, d.shared_expert_intermediate_size, d.top_k,
            d.n_group, d.topk_group, d.mla.kv_lora_rank, d.mla.qk_rope_head_dim, d.vocab_size) == \
        (61, 58, 256, 2048, 8, 8, 4, 512, 64, 129280)
    k = shape("kimi-k2")
    assert (k.num_experts, k.num_heads, k.hidden_size) == (384, 64, 7168)
    q30, q235 = shape("qwen3-30b-a3b"), shape("qwen3-235b-a22b")
    assert (q30.hidden_size, q30.num_layers, q30.num_experts, q30.top_k, q30.moe_intermediate_size) == \
        (2048, 48, 128, 8, 768)
    assert (q235.hidden_size, q235.num_layers, q235.num_experts, q235.top_k, q235.moe_intermediate_size) == \
        (4096, 94, 128, 8, 1536)
    g120, g20 = shape("gpt-oss-120b"), shape("gpt-oss-20b")
    assert (g120.hidden_size, g120.num_layers, g120.num_experts, g120.top_k) == (2880, 36, 128, 4)
    assert (g20.num_layers, g20.num_experts) == (24, 32)
    assert g120.sliding_windows[:2] == (128, None)  # alternating 128-token sliding and full attention


def test_resolve_model_knows_presets_and_a_folder_wins(tmp_path, monkeypatch):
    assert resolve_model("mixtral-8x7b") == str(PRESETS_DIR / "mixtral-8x7b")
    assert resolve_model("demo").endswith("demo_model")  # the demo names resolve as before
    monkeypatch.chdir(tmp_path)
    (tmp_path / "deepseek-v3").mkdir()
    assert resolve_model("deepseek-v3") == "deepseek-v3"
    with pytest.raises(ValueError, match="mixtral-8x7b"):
        preset_path("mixtral")

"""Per-expert, fused 3-D and sharded checkpoints of the same model load to the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import ARCHS

from engines.runtime.checkpoint import load_weights, open_checkpoint
from engines.runtime.transfer import TransferLedger

CPU = torch.device("cpu")


def load(folder):
    ckpt = open_checkpoint(folder)
    return ckpt, *load_weights(ckpt, CPU, torch.float32, TransferLedger(CPU))


@pytest.mark.parametrize("arch", ARCHS)
def test_layouts_agree(arch, checkpoints):
    per_expert = checkpoints(arch, "per_expert")
    fused = checkpoints(arch, "fused")
    sharded = checkpoints(arch, "sharded")
    # The fixtures really are three different layouts.
    assert (sharded / "model.safetensors.index.json").is_file()
    shards = set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 1
    ck_fused = open_checkpoint(fused)
    assert any(k.endswith("experts.gate_up_proj") for k in ck_fused.key_files)
    if arch != "gpt_oss":  # gpt-oss has no per-expert layout: save_pretrained writes it fused
        assert any(".experts.0." in k for k in open_checkpoint(per_expert).key_files)

    _, dense_a, experts_a = load(per_expert)
    for other in (fused, sharded):
        _, dense_b, experts_b = load(other)
        assert experts_a.keys() == experts_b.keys()
        for i in experts_a:
            assert torch.equal(experts_a[i].gate_up, experts_b[i].gate_up)
            assert torch.equal(experts_a[i].down, experts_b[i].down)
        assert torch.equal(dense_a.embed, dense_b.embed) and torch.equal(dense_a.lm_head, dense_b.lm_head)
        for la, lb in zip(dense_a.layers, dense_b.layers):
            assert torch.equal(la.attn.o, lb.attn.o) and torch.equal(la.attn_norm, lb.attn_norm)


@pytest.mark.slow  # three layouts generated end to end (~20 s on 2 cores); test_layouts_agree compares the weights
def test_fused_and_sharded_generate_the_same(checkpoints):
    from harness.generate import GenerateArgs, run_generate

    outs = [
        run_generate(GenerateArgs("moe", str(checkpoints("qwen2_moe", layout)), [[4, 5, 6], [9] * 12], 12,
                                  ignore_eos=True))
        for layout in ("per_expert", "fused", "sharded")
    ]
    assert outs[0] == outs[1] == outs[2]

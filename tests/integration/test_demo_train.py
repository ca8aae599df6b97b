"""`pwbench demo train` on a tiny configuration: the long-context stage's RoPE change against
transformers' own model built with the new theta, `--from` (long-context stage on a saved
curriculum checkpoint) against the from-scratch run, weight for weight, and the first phase's
token-level tasks against targets recomputed from their definitions. The deepseek_v3
architecture (the demo-fine preset): the routers' recorded choices against a loop reference
of group-limited routing applied to transformers' own router logits, the balance loss and the
bias update against hand-computed numbers, and a few-step run that transformers loads back."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from harness.demo.train import (
    PRESETS,
    TrainConfig,
    _curriculum_end,
    build_model,
    circuit_batch,
    collate,
    forward_loss,
    router_tap,
    sequence_balance_loss,
    set_rope_theta,
    train,
    update_router_bias,
)
from harness.errors import HarnessError

TINY = TrainConfig(
    steps=4, hidden=32, heads=2, kv_heads=1, expert_intermediate=32, eval_every=2, eval_samples=2,
    circuit_max_steps=2, circuit_sequences=4,
    copy_tokens=128, pairs_tokens=128, retrieval_tokens=256, level0_retrieval_tokens=128, book_tokens=128,
    long_steps=2, long_retrieval_tokens=512, book_in_context_tokens=256, long_rope_theta=1e6,
)
# The demo-fine preset's architecture at TINY's size: 1 dense + 2 MoE layers, 8 routed experts
# in 4 groups (2 chosen), top-4, one shared expert, MLA with a 16-wide KV latent.
TINY_FINE = replace(TINY, **{**PRESETS["demo-fine"], **{k: getattr(TINY, k) for k in (
    "steps", "eval_every", "eval_samples", "circuit_max_steps", "retrieval_tokens", "long_steps")},
    **dict(hidden=32, heads=2, experts=8, expert_intermediate=16, dense_intermediate=32, kv_lora_rank=16,
           qk_nope_dim=8, qk_rope_dim=8, v_head_dim=8, curriculum_steps=0)})


@pytest.mark.parametrize("tiny", [TINY, TINY_FINE], ids=["mixtral", "deepseek_v3"])
def test_set_rope_theta_matches_a_model_built_with_that_theta(tiny):
    # No embedding offset: at init it dominates every token's input, so theta would barely move the logits.
    model = build_model(replace(tiny, embed_offset=0.0)).eval()
    config = model.config.to_dict()
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    oracle = type(model)(type(model.config).from_dict(config)).eval()
    oracle.load_state_dict(model.state_dict())
    ids = torch.randint(4, model.config.vocab_size, (2, 300))
    with torch.no_grad():
        before = model(ids).logits
        set_rope_theta(model, 1e6)
        after = model(ids).logits
        expected = oracle(ids).logits
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(before, after, atol=1e-3)  # the change reaches the forward pass
    assert model.config.rope_parameters["rope_theta"] == 1e6


def test_circuit_tasks_have_the_targets_their_definitions_give():
    import random

    batch = circuit_batch(random.Random(3), 16)
    assert {name: len(seqs) for name, seqs in batch.items()} == {"copy": 16, "kv": 16, "skip": 16}
    for ids, mask in batch["skip"]:  # target = the token two back
        targets = [t for t in range(len(ids)) if mask[t]]
        assert targets and all(ids[t] == ids[t - 2] for t in targets)
    for ids, mask in batch["copy"]:  # w . w: target = the token n + 1 back, n = len(w)
        n = sum(mask)
        assert len(ids) == 2 * n + 2 and all(ids[t] == ids[t - n - 1] for t in range(len(ids)) if mask[t])
    for ids, mask in batch["kv"]:  # target = the token after the key's first occurrence
        targets = [t for t in range(len(ids)) if mask[t]]
        assert 2 <= len(targets) <= 8
        for t in targets:
            first = ids.index(ids[t - 1])
            assert first < t - 1 and ids[t] == ids[first + 1]


def test_embedding_offset_is_one_shared_direction():
    plain = build_model(replace(TINY, embed_offset=0.0)).model.embed_tokens.weight
    shifted = build_model(TINY).model.embed_tokens.weight
    diff = (shifted - plain).detach()
    torch.testing.assert_close(diff, diff[0].expand_as(diff))  # the same vector on every row
    assert diff[0].norm().item() == pytest.approx(TINY.embed_offset * 0.02 * TINY.hidden ** 0.5, rel=1e-5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-train")
    lines: list[str] = []
    full = train(TINY, root / "full", log=lines.append)
    train(replace(TINY, long_steps=0), root / "curriculum", log=lambda _: None)
    resumed = train(TINY, root / "resumed", log=lambda _: None, start_from=root / "curriculum")
    return root, full, resumed, lines


@pytest.mark.slow  # the `runs` fixture trains three tiny models (~100 s on 2 cores)
def test_from_scratch_and_from_checkpoint_give_the_same_weights(runs):
    root, full, resumed, _ = runs
    a, b = load_file(root / "full" / "model.safetensors"), load_file(root / "resumed" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert [p["step"] for p in full["curve"]] == [p["step"] for p in resumed["curve"]] == [2, 4, 6]
    assert [p.get("stage", "curriculum") for p in full["curve"]] == ["curriculum", "curriculum", "long_context"]
    assert [p.get("phase") for p in full["curve"]] == ["circuit", None, None]  # circuit_max_steps=2
    assert "loss_kv" in full["curve"][0] and "loss_retrieval" in full["curve"][1]
    assert full["complete"] and resumed["complete"]


@pytest.mark.slow  # `runs`: see above; `demo train` stays in the default run via the bad-folder test
def test_trained_folder_records_the_stage_and_loads(runs):
    from transformers import AutoTokenizer, MixtralForCausalLM

    root, _, _, lines = runs
    folder = root / "full"
    assert json.loads((folder / "config.json").read_text())["rope_parameters"]["rope_theta"] == 1e6
    report = json.loads((folder / "training.json").read_text())
    assert report["config"]["long_steps"] == 2 and report["complete"]
    long_point = report["curve"][-1]
    for key in ("recall_512_1024_acc", "closed_book_acc", "closed_book_in_context_acc", "copy_acc"):
        assert 0.0 <= long_point[key] <= 1.0
    assert json.loads(lines[-1]) == long_point  # the log line is the recorded point
    MixtralForCausalLM.from_pretrained(folder)
    AutoTokenizer.from_pretrained(folder)


@pytest.mark.slow  # `runs`: see above
def test_from_rejects_other_settings_and_extended_models(runs, tmp_path):
    root, _, _, _ = runs
    with pytest.raises(HarnessError, match="curriculum settings differ.*lr"):
        train(replace(TINY, lr=2e-3), tmp_path / "x", start_from=root / "curriculum")
    with pytest.raises(HarnessError, match="already went through the long-context stage"):
        train(TINY, tmp_path / "y", start_from=root / "full")
    with pytest.raises(HarnessError, match="long_steps is 0"):
        train(replace(TINY, long_steps=0), tmp_path / "v", start_from=root / "curriculum")
    with pytest.raises(HarnessError, match="no training.json"):
        train(TINY, tmp_path / "z", start_from=tmp_path)
    (tmp_path / "training.json").write_text("{not json")
    with pytest.raises(HarnessError, match="not a `pwbench demo train` report"):
        train(TINY, tmp_path / "w", start_from=tmp_path)
    assert not (tmp_path / "w").exists() and not (tmp_path / "v").exists()  # nothing written on failure


def test_cli_from_a_bad_folder_is_one_line(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "harness.cli", "demo", "train", "--from", str(tmp_path),
                          "--set", "long_steps=600", "--output", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().startswith("error:") and "no training.json" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "out").exists()


def test_deepseek_model_has_the_asked_shape():
    from transformers import DeepseekV3ForCausalLM

    model = build_model(TINY_FINE)
    assert type(model) is DeepseekV3ForCausalLM
    c = model.config
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group, c.n_shared_experts) == (8, 4, 4, 2, 1)
    assert (c.kv_lora_rank, c.q_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (16, None, 8, 8, 8)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["DeepseekV3MLP", "DeepseekV3MoE",
                                                                          "DeepseekV3MoE"]
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape == (8, 2 * 16, 32)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the Mixtral demo


def _grouped_topk_reference(logits: torch.Tensor, bias: torch.Tensor, groups: int, topk_group: int,
                            k: int) -> list[set[int]]:
    """DeepSeek-V3's node-limited routing, one token at a time: score = sigmoid + bias; a group's
    score is the sum of its two best; keep the best topk_group groups; the top k experts in them."""
    chosen = []
    per = logits.shape[-1] // groups
    for row in logits:
        score = (row.sigmoid() + bias).tolist()
        group_score = [sum(sorted(score[g * per:(g + 1) * per])[-2:]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -group_score[g])[:topk_group]
        pool = [e for g in kept for e in range(g * per, (g + 1) * per)]
        chosen.append(set(sorted(pool, key=lambda e: -score[e])[:k]))
    return chosen


def test_router_tap_counts_the_routers_choices_without_padding():
    import random

    model = build_model(TINY_FINE).train()
    tap = router_tap(model)
    with torch.no_grad():  # a bias that changes the choices, so the reference must apply it
        for gate in tap.gates:
            gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    batch = circuit_batch(random.Random(5), 3)["kv"]  # three sequences of different lengths: padding
    forward_loss(model, batch, 1e-4)
    assert tap.take() == []  # forward_loss consumed the records
    ids, attn, _ = collate(batch)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, output_router_logits=True).router_logits
    keep = attn.reshape(-1).bool()
    assert len(logits) == len(tap.gates) == 2
    for layer_logits, gate, load in zip(logits, tap.gates, tap.loads):
        expected = torch.zeros(8)
        for experts in _grouped_topk_reference(layer_logits[keep], gate.e_score_correction_bias, 4, 2, 4):
            expected[list(experts)] += 1
        assert torch.equal(load, expected)
        assert load.sum().item() == 4 * int(attn.sum())


def test_sequence_balance_loss_matches_hand_computed_values():
    # One sequence of 2 real tokens + 1 pad, 4 experts, top-2. Sigmoid(0) = 0.5 for every expert
    # but expert 0 (logit ln 3: sigmoid 0.75), so token scores normalize to (0.75, .5, .5, .5) / 2.25.
    ln3 = torch.log(torch.tensor(3.0)).item()
    logits = torch.tensor([[ln3, 0, 0, 0], [ln3, 0, 0, 0], [9.0, 9, 9, 9]])
    chosen = torch.tensor([[0, 1], [0, 2], [3, 2]])
    attn = torch.tensor([[1, 1, 0]])
    # f = E / (K T) * counts = 4 / 4 * (2, 1, 1, 0); P = (1/3, 2/9, 2/9, 2/9)
    expected = 2 * (1 / 3) + 1 * (2 / 9) + 1 * (2 / 9) + 0
    assert sequence_balance_loss(logits, chosen, attn, 2).item() == pytest.approx(expected, rel=1e-6)


def test_bias_update_moves_each_expert_toward_the_mean_load():
    model = build_model(TINY_FINE)
    tap = router_tap(model)
    tap.loads[0].copy_(torch.tensor([5.0, 1, 3, 3, 3, 3, 3, 3]))  # mean 3
    update_router_bias(tap, 0.01)
    assert tap.gates[0].e_score_correction_bias.tolist() == pytest.approx([-0.01, 0.01, 0, 0, 0, 0, 0, 0])
    assert tap.gates[1].e_score_correction_bias.tolist() == [0.0] * 8  # equal loads (zero): no move
    assert all(load.sum().item() == 0 for load in tap.loads)  # counted afresh each step


def test_bad_deepseek_settings_are_one_line_errors():
    with pytest.raises(HarnessError, match="n_group=3"):
        build_model(replace(TINY_FINE, n_group=3))
    with pytest.raises(HarnessError, match="topk_group=1 .*top_k=4"):
        build_model(replace(TINY_FINE, topk_group=1))
    with pytest.raises(HarnessError, match="dense_layers=3"):
        build_model(replace(TINY_FINE, dense_layers=3))
    with pytest.raises(HarnessError, match="arch='llama'"):
        replace(TINY_FINE, arch="llama")


def test_curriculum_steps_end_the_stage_after_the_circuit():
    cfg = replace(TINY_FINE, steps=100, curriculum_steps=6, circuit_max_steps=50)
    assert _curriculum_end(cfg, [{"step": 2, "phase": "circuit"}, {"step": 4, "phase": "circuit"},
                                 {"step": 6}]) == 10
    assert _curriculum_end(replace(cfg, curriculum_steps=0), [{"step": 4, "phase": "circuit"}]) == 100
    assert _curriculum_end(replace(cfg, steps=8), [{"step": 4, "phase": "circuit"}]) == 8  # steps caps it


@pytest.mark.slow  # a 4 + 1-step deepseek_v3 run (4 s on 2 quiet cores, 20 s shared)
def test_deepseek_run_balances_saves_and_loads(tmp_path):
    from transformers import DeepseekV3ForCausalLM

    cfg = replace(TINY_FINE, steps=20, circuit_max_steps=2, curriculum_steps=2, long_steps=1)
    report = train(cfg, tmp_path / "fine", log=lambda _: None)
    assert [p["step"] for p in report["curve"]] == [2, 4, 5]  # circuit gives up at 2, 2 more, 1 long-context
    assert [p.get("phase") for p in report["curve"]] == ["circuit", None, None] and report["complete"]
    saved = load_file(tmp_path / "fine" / "model.safetensors")
    for layer in (1, 2):  # 5 steps of +-1e-3 per step: the bias moved and was saved
        bias = saved[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
        assert bias.abs().max().item() > 0 and bias.abs().max().item() <= 5 * cfg.bias_update_rate + 1e-7
    # DeepSeek-V3's own checkpoint layout (one tensor per expert and projection), which transformers
    # loads back completely, the routers' biases included.
    assert saved["model.layers.2.mlp.experts.7.gate_proj.weight"].shape == (16, 32)
    assert not any(name.startswith("model.layers.0.mlp.experts") for name in saved)  # the dense first layer
    model, info = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "fine", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(model.model.layers[2].mlp.gate.e_score_correction_bias,
                       saved["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert json.loads((tmp_path / "fine" / "training.json").read_text())["config"]["arch"] == "deepseek_v3"

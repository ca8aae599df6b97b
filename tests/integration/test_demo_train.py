"""`pwbench demo train` on a tiny configuration: the long-context stage's RoPE change against
transformers' own Mixtral built with the new theta, `--from` (long-context stage on a saved
curriculum checkpoint) against the from-scratch run, weight for weight, and the first phase's
token-level tasks against targets recomputed from their definitions."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from harness.demo.train import TrainConfig, build_model, circuit_batch, set_rope_theta, train
from harness.errors import HarnessError

TINY = TrainConfig(
    steps=4, hidden=32, heads=2, kv_heads=1, expert_intermediate=32, eval_every=2, eval_samples=2,
    circuit_max_steps=2, circuit_sequences=4,
    copy_tokens=128, pairs_tokens=128, retrieval_tokens=256, level0_retrieval_tokens=128, book_tokens=128,
    long_steps=2, long_retrieval_tokens=512, book_in_context_tokens=256, long_rope_theta=1e6,
)


def test_set_rope_theta_matches_a_model_built_with_that_theta():
    from transformers import MixtralForCausalLM

    # No embedding offset: at init it dominates every token's input, so theta would barely move the logits.
    model = build_model(replace(TINY, embed_offset=0.0)).eval()
    config = model.config.to_dict()
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    oracle = MixtralForCausalLM(type(model.config).from_dict(config)).eval()
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

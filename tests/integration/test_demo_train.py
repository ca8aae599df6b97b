"""`pwbench demo train` on a tiny configuration: the long-context stage's RoPE change against
transformers' own Mixtral built with the new theta, and `--from` (long-context stage on a saved
curriculum checkpoint) against the from-scratch run, weight for weight."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from harness.demo_train import TrainConfig, build_model, set_rope_theta, train
from harness.results import HarnessError

TINY = TrainConfig(
    steps=4, hidden=32, heads=2, kv_heads=1, expert_intermediate=32, eval_every=2, eval_samples=2,
    copy_tokens=128, pairs_tokens=128, retrieval_tokens=256, level0_retrieval_tokens=128, book_tokens=128,
    long_steps=2, long_retrieval_tokens=512, book_in_context_tokens=256,
)


def test_set_rope_theta_matches_a_model_built_with_that_theta():
    from transformers import MixtralForCausalLM

    model = build_model(TINY).eval()
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-train")
    lines: list[str] = []
    full = train(TINY, root / "full", log=lines.append)
    train(replace(TINY, long_steps=0), root / "curriculum", log=lambda _: None)
    resumed = train(TINY, root / "resumed", log=lambda _: None, start_from=root / "curriculum")
    return root, full, resumed, lines


def test_from_scratch_and_from_checkpoint_give_the_same_weights(runs):
    root, full, resumed, _ = runs
    a, b = load_file(root / "full" / "model.safetensors"), load_file(root / "resumed" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert [p["step"] for p in full["curve"]] == [p["step"] for p in resumed["curve"]] == [2, 4, 6]
    assert [p.get("stage", "curriculum") for p in full["curve"]] == ["curriculum", "curriculum", "long_context"]
    assert full["complete"] and resumed["complete"]


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


def test_from_rejects_other_settings_and_extended_models(runs, tmp_path):
    root, _, _, _ = runs
    with pytest.raises(HarnessError, match="curriculum settings differ.*lr"):
        train(replace(TINY, lr=2e-3), tmp_path / "x", start_from=root / "curriculum")
    with pytest.raises(HarnessError, match="already has RoPE theta"):
        train(TINY, tmp_path / "y", start_from=root / "full")
    with pytest.raises(HarnessError, match="no training.json"):
        train(TINY, tmp_path / "z", start_from=tmp_path)
    (tmp_path / "training.json").write_text("{not json")
    with pytest.raises(HarnessError, match="not a `pwbench demo train` report"):
        train(TINY, tmp_path / "w", start_from=tmp_path)
    assert not (tmp_path / "w").exists()  # nothing written on failure


def test_cli_from_a_bad_folder_is_one_line(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "harness.cli", "demo", "train", "--from", str(tmp_path),
                          "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().startswith("error:") and "no training.json" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "out").exists()

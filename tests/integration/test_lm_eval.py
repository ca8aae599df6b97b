"""lm-eval over pwbench engines, offline: log-likelihoods against transformers, and task
accuracy through lm-eval equal to pwbench's own scorer on the same examples."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tiny_models import CPU32, build_hf_model, save_checkpoint

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def demo_vocab_model(tmp_path_factory):
    """A random Mixtral with the demo vocabulary and tokenizer (accuracy near 0, plumbing real)."""
    from workloads.demo.language import build_tokenizer, demo_language

    folder = tmp_path_factory.mktemp("demo-vocab")
    model = build_hf_model("mixtral", vocab_size=len(demo_language().vocab), max_position_embeddings=2048)
    save_checkpoint(model, folder)
    build_tokenizer(folder)
    return folder, model


class _Req:
    def __init__(self, *args):
        self.args = args


def test_loglikelihood_matches_transformers(demo_vocab_model):
    from harness.lmeval.model import PwbenchLM
    from workloads.demo.language import BOS_ID, demo_language

    folder, model = demo_vocab_model
    lang = demo_language()
    pairs = [("question : what is the color of suhas ? answer :", " red"), ("the report grew", " in the north ."),
             ("repeat : a", " b")]
    lm = PwbenchLM(engine="moe", model=str(folder), **CPU32)
    try:
        got = lm.loglikelihood([_Req(c, x) for c, x in pairs])
        rolling = lm.loglikelihood_rolling([_Req("the market grew in the west .")])
    finally:
        lm.engine.stop()
    for (context, cont), (logprob, greedy) in zip(pairs, got):
        ctx, tgt = [BOS_ID] + lang.encode(context), lang.encode(cont)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ctx + tgt])).logits[0].float().log_softmax(-1)
        rows = logits[len(ctx) - 1 : len(ctx) + len(tgt) - 1]
        expected = rows.gather(1, torch.tensor(tgt)[:, None]).sum().item()
        assert logprob == pytest.approx(expected, abs=1e-3)
        assert greedy == bool((rows.argmax(-1) == torch.tensor(tgt)).all())
    ids = [BOS_ID] + lang.encode("the market grew in the west .")
    with torch.inference_mode():
        lp = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert rolling[0] == pytest.approx(lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum().item(), abs=1e-3)


@pytest.mark.slow  # ~30 s on 2 cores; test_demo_model.py's lm-eval test checks `pwbench eval` the same way
def test_pwbench_eval_offline_matches_own_scorer(tmp_path):
    """`pwbench eval --model DIR --output` (lm-eval's simple_evaluate, offline) reports the
    same exact match as pwbench's own scorer on the same held-out examples. The bundled model
    scores far from 0 on both tasks, so agreement says something (a random model scores 0)."""
    from engines.common.demo import DEMO_MODEL_DIR
    from engines.moe import MoEEngine, MoEEngineConfig
    from harness.demo.eval import EvalSpec, demo_samples, run_samples

    if not (DEMO_MODEL_DIR / "config.json").is_file():
        pytest.skip("engines/demo_model is not built (pwbench demo train)")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "ds"))
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", "eval", "--model", str(DEMO_MODEL_DIR), "--tasks", "demo_copy,demo_rag",
         "--samples", "12", "--set", "device=cpu", "--set", "dtype=float32", "--output", str(tmp_path / "run"),
         "--json"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    saved = json.loads((tmp_path / "run" / "lm_eval.json").read_text())
    engine = MoEEngine(MoEEngineConfig(**CPU32, model=str(DEMO_MODEL_DIR)))
    with engine:
        for name, task in (("demo_copy", "copy"), ("demo_rag", "rag_recall")):
            own, _ = run_samples(engine, demo_samples(task, EvalSpec(samples=12)))
            assert own >= 0.5, f"{task}: the bundled model scores {own}; the comparison would be weak"
            assert metrics[name]["exact_match"] == pytest.approx(own)
            assert saved["metrics"][name] == metrics[name]  # lm_eval.json holds what was printed

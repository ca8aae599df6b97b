"""`pwbench generate` end to end: JSON contract, prompt order, text prompts, both engines agree."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tiny_models import build_hf_model


def pwbench(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return proc


def last_json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hf_greedy(arch: str, prompt: list[int], n: int) -> list[int]:
    model = build_hf_model(arch)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow  # both engines in subprocesses (~33 s on 2 cores); test_readable_output stays fast
def test_json_outputs_in_given_order_for_both_engines(checkpoints):
    folder = str(checkpoints("qwen2_moe"))
    prompts = ["4,5,6,7", "9", "30,31,32,33,34,35,36,37,38,39,40"]
    args = ["generate", "--model", folder, "--max-new-tokens", "16", "--ignore-eos", "--json", "--device", "cpu"]
    for p in prompts:
        args += ["--prompt-ids", p]
    moe = last_json(pwbench(*args, "--engine", "moe"))
    hf = last_json(pwbench(*args, "--engine", "hf"))
    assert [o["prompt_ids"] for o in moe["outputs"]] == [[int(x) for x in p.split(",")] for p in prompts]
    for got, p in zip(moe["outputs"], prompts):
        assert got["output_ids"] == hf_greedy("qwen2_moe", [int(x) for x in p.split(",")], 16)
        assert got["finish_reason"] == "length"
    assert [o["output_ids"] for o in hf["outputs"]] == [o["output_ids"] for o in moe["outputs"]]


def test_text_prompts_with_tokenizer_interleave_with_ids(checkpoints, copy_checkpoint):
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = copy_checkpoint(checkpoints("mixtral"))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, 257)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    proc = pwbench("generate", "--model", str(folder), "--prompt", "w10 w11 w12", "--prompt-ids", "7,8",
                   "--prompt", "w40", "--max-new-tokens", "5", "--ignore-eos", "--json", "--device", "cpu")
    outs = last_json(proc)["outputs"]
    assert [o["prompt_ids"] for o in outs] == [[10, 11, 12], [7, 8], [40]]
    assert outs[0]["prompt_text"] == "w10 w11 w12"
    assert outs[0]["text"] == " ".join(f"w{t}" if t >= 4 else list(vocab)[t] for t in outs[0]["output_ids"])
    assert outs[0]["output_ids"] == hf_greedy("mixtral", [10, 11, 12], 5)


@pytest.mark.slow  # three generate subprocesses (~21 s on 2 cores)
def test_sampling_is_seeded(checkpoints):
    folder = str(checkpoints("olmoe"))
    args = ["generate", "--model", folder, "--prompt-ids", "5,6,7", "--max-new-tokens", "12", "--temperature", "1.0",
            "--top-k", "50", "--json", "--ignore-eos"]
    a = last_json(pwbench(*args, "--seed", "3"))
    b = last_json(pwbench(*args, "--seed", "3"))
    c = last_json(pwbench(*args, "--seed", "4"))
    assert a == b
    assert a["outputs"][0]["output_ids"] != c["outputs"][0]["output_ids"]


def test_readable_output(checkpoints):
    proc = pwbench("generate", "--model", str(checkpoints("mixtral")), "--prompt-ids", "5,6", "--max-new-tokens", "3")
    assert "[0] prompt: [5, 6]" in proc.stdout and "(3 tokens" in proc.stdout

"""Every bad input of `pwbench generate` gives one line on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import edit_config


def pwbench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=120)


def assert_user_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_missing_folder(tmp_path):
    assert_user_error(pwbench("generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1,2"), "does not exist")


def test_folder_without_config(tmp_path):
    assert_user_error(pwbench("generate", "--model", str(tmp_path), "--prompt-ids", "1"), "config.json")


def test_missing_shard(checkpoints, copy_checkpoint):
    folder = copy_checkpoint(checkpoints("mixtral", "sharded"))
    shard = sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))[-1]
    (folder / shard).unlink()
    assert_user_error(pwbench("generate", "--model", str(folder), "--prompt-ids", "1,2"), shard, "missing")


def test_unsupported_architecture(checkpoints, copy_checkpoint):
    folder = copy_checkpoint(checkpoints("mixtral"))
    edit_config(folder, model_type="llama")
    assert_user_error(
        pwbench("generate", "--model", str(folder), "--prompt-ids", "1"),
        "'llama'", "deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe",
    )


@pytest.mark.parametrize("change, fragments", [
    # DeepSeek-V2's routing variants: the one-line error names the field and what is supported.
    ({"topk_method": "group_limited_greedy"}, ("topk_method 'group_limited_greedy'", "supported: 'noaux_tc'")),
    ({"scoring_func": "softmax"}, ("scoring_func 'softmax'", "supported: 'sigmoid'")),
    ({"model_type": "deepseek_v2"}, ("'deepseek_v2' is not supported", "deepseek_v3, glm4_moe")),
    ({"n_group": 5}, ("n_group=5", "n_routed_experts=12")),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     ("rope_type 'longrope'", "supported: default, yarn")),
])
def test_unsupported_deepseek_variants(change, fragments, checkpoints, copy_checkpoint):
    folder = copy_checkpoint(checkpoints("deepseek_v3"))
    edit_config(folder, **change)
    assert_user_error(pwbench("generate", "--model", str(folder), "--prompt-ids", "1"), *fragments)


def test_tensor_of_wrong_shape(checkpoints, copy_checkpoint):
    folder = copy_checkpoint(checkpoints("olmoe"))
    tensors = load_file(folder / "model.safetensors")
    key = "model.layers.1.self_attn.k_proj.weight"
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert_user_error(pwbench("generate", "--model", str(folder), "--prompt-ids", "1"), key, "[31, 96]", "[32, 96]")


def test_missing_tensor(checkpoints, copy_checkpoint):
    folder = copy_checkpoint(checkpoints("qwen3_moe"))
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert_user_error(pwbench("generate", "--model", str(folder), "--prompt-ids", "1"), "experts.3.up_proj", "missing")


def test_tensor_the_architecture_does_not_use(checkpoints, copy_checkpoint):
    """A tensor no part of the model reads (here a Qwen3-style q_norm in a Mixtral folder) is
    refused by name, not silently ignored."""
    folder = copy_checkpoint(checkpoints("mixtral"))
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert_user_error(pwbench("generate", "--model", str(folder), "--prompt-ids", "1"),
                      "1 tensors do not belong to a mixtral model", "model.layers.1.self_attn.q_norm.weight")


def test_quantized_checkpoint_is_refused(checkpoints, copy_checkpoint):
    folder = copy_checkpoint(checkpoints("mixtral"))
    edit_config(folder, quantization_config={"quant_method": "gptq", "bits": 4})
    assert_user_error(pwbench("generate", "--engine", "moe", "--model", str(folder), "--prompt-ids", "1"),
                      "quantized", "gptq")


def test_corrupt_config_json(checkpoints, copy_checkpoint):
    folder = copy_checkpoint(checkpoints("mixtral"))
    (folder / "config.json").write_text('{"model_type": "mixtral",\n  "hidden_size": 96,,\n}')
    assert_user_error(pwbench("generate", "--model", str(folder), "--prompt-ids", "1"), "config.json", "line 2")


@pytest.mark.parametrize("engine", ["moe", pytest.param("hf", marks=pytest.mark.slow)])  # hf: ~15 s
def test_token_ids_outside_vocabulary(engine, checkpoints):
    folder = checkpoints("mixtral")
    assert_user_error(
        pwbench("generate", "--model", str(folder), "--engine", engine, "--prompt-ids", "1,2,257"),
        "token id 257", "[0, 257)",
    )


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--prompt-ids", "1,x"], "comma-separated integers"),
        (["--prompt-ids", "1", "--engine", "vllm-magic"],
         "valid engines: dummy, full, hf, moe, moegen, offload, openai, pagedweight, static-awq"),
        (["--prompt-ids", "1", "--set", "block_size"], "key=value"),
        (["--prompt-ids", "1", "--set", "blocksize=4"], "valid options:"),
        (["--prompt-ids", "1", "--set", "block_size=four"], "expects int"),
        (["--prompt-ids", "1", "--dtype", "float8"], "float32, float16, bfloat16"),
        pytest.param(["--prompt-ids", "1", "--device", "cuda"], "--device cpu",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
        (["--prompt", "hello"], "tokenizer.json"),
        ([], "at least one"),
    ],
)
def test_bad_options(args, fragment, checkpoints):
    assert_user_error(pwbench("generate", "--model", str(checkpoints("mixtral")), *args), fragment)


DEMO = "engines/demo_model"


@pytest.mark.parametrize("engine, budget, fragments", [
    ("offload", "1MiB",
     ("too small for engine offload", "at least 1.13 MiB (1180672 bytes)", "one expert per MoE layer",
                         "one KV block")),
    ("moe", "1.5MiB", ("too small for engine moe", "every routed expert", "engine offload keeps experts on the host")),
    ("hf", "1GiB", ("engine hf does not manage device memory", "offload")),
    ("moe", "6Mx", ("cannot read '6Mx' as a size", "6MiB")),
    ("offload", None, ("engine offload needs a device budget (--budget SIZE)",)),
    ("moegen", "1MiB", ("too small for engine moegen", "at least 1.02 MiB (1065984 bytes)", "one expert ring slot")),
    ("moegen", None, ("engine moegen needs a device budget (--budget SIZE)",)),
])
def test_bad_budgets(engine, budget, fragments):
    """Too small (the minimum stated, part by part), not a size, an engine that has no budget,
    offload or moegen without one: one line each. 1180672 = dense 967,680 + 2 x 98,304 + 16,384
    bytes; 1065984 = dense 967,680 + one ring slot of 98,304 (moegen's KV can live on the host)."""
    args = ["generate", "--model", DEMO, "--prompt-ids", "5,6,7", "--engine", engine]
    assert_user_error(pwbench(*args, *(["--budget", budget] if budget else [])), *fragments)


def test_budget_above_the_minimum_but_below_what_the_options_keep():
    """offload told to keep all 4 experts of each layer: 967,680 dense + 2 x 4 x 98,304 + one KV block
    16,384 = 1,770,496 bytes, over a 1.5 MiB budget that its least (1.13 MiB) fits; the error says so
    rather than that 1.13 MiB is needed."""
    args = ["generate", "--model", DEMO, "--prompt-ids", "5,6,7", "--engine", "offload", "--budget", "1.5MiB",
            "--set", "experts_per_layer=4"]
    assert_user_error(pwbench(*args), "too small for engine offload on this model with these options",
                      "need 1.69 MiB (1770496 bytes)", "the least the engine takes is 1.13 MiB")


@pytest.mark.parametrize("args, fragments", [
    (["--budget", "1MiB"],
     ("too small for engine moegen", "at least 1.02 MiB (1065984 bytes)", "one expert ring slot")),
    (["--budget", "4MiB", "--set", "kv_placment=host"], ("has no option 'kv_placment'", "kv_placement")),
    (["--budget", "4MiB", "--set", "kv_placement=gpu"], ("kv_placement must be one of auto, device, host",)),
    (["--budget", "4MiB", "--engine", "offload"], ("--engine 'offload' has no plan", "moegen")),
    (["--budget", "4MiB", "--gpu", "H900"], ("--gpu 'H900' is not in the datasheet table", "H200")),
    (["--budget", "lots"], ("cannot read 'lots' as a size",)),
])
def test_bad_plan_options(args, fragments):
    assert_user_error(pwbench("plan", *args), *fragments)

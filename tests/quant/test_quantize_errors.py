"""Bad input to `pwbench quantize` and to the static engines: one `error:` line naming what is
supported, exit code 2, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file
from tiny_models import edit_config

from engines.quant.calibrate import QuantizeOptions
from engines.quant.export import quantize_folder


def pwbench_error(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=180)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.fixture(scope="module")
def gptq_folder(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("bad") / "gptq"
    quantize_folder(checkpoints("mixtral"), out, QuantizeOptions("gptq", 4, 32), [[5, 6, 7, 8] * 8], device="cpu")
    return out


@pytest.fixture
def damaged(gptq_folder, tmp_path):
    dst = tmp_path / "q"
    shutil.copytree(gptq_folder, dst)
    return dst


@pytest.mark.parametrize("args, fragments", [
    (["--bits", "5"], ["bits", "(2, 3, 4, 8)", "got 5"]),
    (["--group-size", "100"], ["group_size", "(32, 64, 128)", "got 100"]),
    (["--method", "smoothquant"], ["'smoothquant'", "rtn, gptq, awq"]),
    (["--format", "awq", "--bits", "3"], ["AWQ", "4-bit", "--format gptq"]),
    (["--format", "exl2"], ["'exl2'", "gptq, awq, compressed-tensors"]),
    (["--method", "rtn", "--act-order"], ["act_order", "gptq"]),
    (["--group-size", "64"], ["group_size 64 must divide", "96"]),  # hidden size 96
])
def test_quantize_option_errors(args, fragments, checkpoints, tmp_path):
    base = {"--method": "gptq", "--group-size": "32"}
    for flag, _value in zip(args[::2], args[1::2]):
        base.pop(flag, None)
    argv = [a for kv in base.items() for a in kv]
    line = pwbench_error("quantize", "--model", str(checkpoints("mixtral")), "--output", str(tmp_path / "o"),
                         "--calib-samples", "2", "--calib-len", "16", *argv, *args)
    for fragment in fragments:
        assert fragment in line, line
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # kept under the README's ~12 min; CI's slow step runs it
def test_quantize_refuses_an_existing_output_and_a_quantized_input(gptq_folder, checkpoints):
    assert "already exists" in pwbench_error("quantize", "--model", str(checkpoints("mixtral")), "--method", "rtn",
                                             "--group-size", "32", "--output", str(gptq_folder))
    assert "already quantized" in pwbench_error("quantize", "--model", str(gptq_folder), "--method", "rtn",
                                                "--group-size", "32", "--output", str(gptq_folder.parent / "x"))


@pytest.mark.slow  # kept under the README's ~12 min; CI's slow step runs it
def test_a_quantized_folder_needs_no_engine_flag(gptq_folder):
    """`pwbench generate --model GPTQ_DIR` picks static-gptq, says so in one line, and generates
    what `--engine static-gptq` generates."""
    def gen(*extra):
        return subprocess.run([sys.executable, "-m", "harness.cli", "generate", "--model", str(gptq_folder),
                               "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--json", *extra],
                              capture_output=True, text=True, timeout=180)

    picked, named = gen(), gen("--engine", "static-gptq")
    assert picked.returncode == 0 and named.returncode == 0, picked.stderr
    notes = [line for line in picked.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "gptq-quantized" in notes[0] and "engine static-gptq" in notes[0]
    assert json.loads(picked.stdout.splitlines()[-1]) == json.loads(named.stdout.splitlines()[-1])


def generate_error(folder, engine: str = "static-gptq", *sets: str) -> str:
    return pwbench_error("generate", "--engine", engine, "--model", str(folder), "--prompt-ids", "1,2",
                         *[a for s in sets for a in ("--set", s)])


def test_missing_quantized_tensor_is_named(damaged):
    tensors = load_file(damaged / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.4.down_proj.qzeros"]
    save_file(tensors, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    line = generate_error(damaged)
    assert "model.layers.1.mlp.experts.4.down_proj.qzeros" in line and "missing" in line


@pytest.mark.parametrize("change, fragments", [
    ({"quant_method": "bitsandbytes"}, ["'bitsandbytes'", "gptq, awq, compressed-tensors"]),
    ({"bits": 5}, ["bits 5", "2, 3, 4, 8"]),
    ({"group_size": 16}, ["group_size 16", "32, 64, 128, -1"]),  # -1: GPTQ's one group per row
    ({"checkpoint_format": "marlin"}, ["'marlin'", "gptq, gptq_v2"]),
])
def test_bad_quantization_config(damaged, change, fragments):
    config = json.loads((damaged / "config.json").read_text())
    edit_config(damaged, quantization_config={**config["quantization_config"], **change})
    line = generate_error(damaged)
    for fragment in fragments:
        assert fragment in line, line


@pytest.fixture(scope="module")
def rtn_folders(checkpoints, tmp_path_factory):
    """An AWQ-format and a compressed-tensors folder (RTN codes: only the format matters here)."""
    root = tmp_path_factory.mktemp("formats")
    folders = {}
    for fmt in ("awq", "compressed-tensors"):
        folders[fmt] = root / fmt
        quantize_folder(checkpoints("mixtral"), folders[fmt], QuantizeOptions("rtn", 4, 32), [[5, 6, 7, 8] * 4],
                        fmt=fmt, device="cpu")
    return folders


@pytest.mark.parametrize("fmt, change, fragments", [
    ("awq", {"version": "gemv"}, ["version 'gemv'", "supported: gemm"]),
    ("awq", {"version": "exllama"}, ["version 'exllama'", "supported: gemm"]),
    ("compressed-tensors", {"format": "int-quantized"}, ["format 'int-quantized'", "supported: pack-quantized"]),
    ("compressed-tensors", {"format": "marlin-24"}, ["format 'marlin-24'", "supported: pack-quantized"]),
])
def test_unsupported_awq_version_and_compressed_tensors_format(rtn_folders, tmp_path, fmt, change, fragments):
    folder = tmp_path / fmt
    shutil.copytree(rtn_folders[fmt], folder)
    config = json.loads((folder / "config.json").read_text())
    edit_config(folder, quantization_config={**config["quantization_config"], **change})
    engine = "static-awq" if fmt == "awq" else "static-gptq"
    line = generate_error(folder, engine)
    for fragment in fragments:
        assert fragment in line, line


@pytest.mark.slow  # ~18 s on 2 cores; the other quantized-folder errors stay in the default run
def test_engine_and_folder_must_agree(damaged, checkpoints):
    assert "use --engine static-gptq" in generate_error(damaged, "static-awq")
    line = generate_error(damaged, "moe")
    assert "quantized" in line and "static-gptq" in line
    assert "--set bits=N" in generate_error(checkpoints("mixtral"))
    assert "already quantized" in generate_error(damaged, "static-gptq", "bits=3", "group_size=32")
    assert "(2, 3, 4, 8)" in generate_error(checkpoints("mixtral"), "static-rtn", "bits=6", "group_size=32")


def test_quantize_defaults_to_the_bundled_model_with_a_group_size_that_fits(tmp_path):
    """No --model, no --group-size: the bundled demo model (hidden 128, expert width 64), whose
    widths 128 does not divide, gets group size 64, the largest standard one dividing both, and
    a note saying so."""
    out = tmp_path / "q"
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "quantize", "--method", "rtn", "--output", str(out),
                           "--calib-samples", "2", "--calib-len", "16", "--quiet"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "group_size 128 does not divide the expert widths 128/64" in proc.stderr
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 64

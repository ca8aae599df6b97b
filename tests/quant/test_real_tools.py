"""The real tools as oracles for quantized folders, both ways, run from their own venv.

GPTQModel (GPTQ and AutoAWQ-GEMM folders) and llm-compressor / compressed-tensors
(pack-quantized folders) pin numpy, transformers and torch versions the project does not use,
so they live in `.venv-tools` (made by `.ci/real_tools.sh`; another interpreter with
PWBENCH_TOOLS_PYTHON). Each tool runs in a subprocess with that interpreter (scripts in
tests/quant/tools/, which import no pwbench); the two sides share only folders and
safetensors files under tmp_path. Without the venv every test here skips and says so.

(a) a folder the tool writes (its own quantizer and saver, on a tiny random Mixtral) loads in
    pwbench: every layer pwbench dequantizes equals the tool's own dequantized weight exactly,
    and the static engine's logits equal the tool's model run on the same tokens;
(b) a folder `pwbench quantize` writes is read by the tool: same two checks the other way.

GPTQModel 7.6 reads only `dynamic` to find a folder's full-precision layers (not
`modules_in_block_to_quantize` / `modules_to_not_convert`) and refuses asymmetric GPTQ v1
folders that another quantizer wrote; these tests found both. pwbench's folders therefore
carry a `dynamic` rule excluding everything but the routed experts and write asymmetric GPTQ
as gptq_v2, and (b) hands GPTQModel each folder exactly as `pwbench quantize` wrote it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import build_hf_model, save_checkpoint

from engines.base import EngineRequest
from engines.quant.hf_format import read_linear, read_scheme
from engines.quant.qweight import dequantize
from engines.registry import create_engine

pytestmark = [pytest.mark.real_tools, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(__file__).parent / "tools"
TOOLS_PYTHON = Path(os.environ.get("PWBENCH_TOOLS_PYTHON", ROOT / ".venv-tools" / "bin" / "python"))
GROUP = 32
PROMPTS = [[5, 9, 14, 200, 37, 88, 3, 41], [100, 101, 102], list(range(20, 44))]
NEW_TOKENS = 4
# What a pwbench folder must say for GPTQModel to keep everything but the routed experts full
# precision: its `dynamic` negative match, the only exclusion GPTQModel reads when loading.
ONLY_EXPERTS = {r"-:^(?!(?:.*\.)?mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj)$).*": {}}


@pytest.fixture(scope="module")
def tool_versions() -> dict[str, str | None]:
    """{module: version or None} in the tools venv; skips everything when there is none."""
    if not TOOLS_PYTHON.exists():
        skip(f"real-tool oracles need the tools venv: {TOOLS_PYTHON} is missing (make it with "
                    "`bash .ci/real_tools.sh`, or point PWBENCH_TOOLS_PYTHON at a python with gptqmodel==7.6.0 "
                    "and llmcompressor==0.14.0.1)")
    probe = ("import importlib.metadata as m, json\nout = {}\n"
             "for mod, dist in [('gptqmodel', 'gptqmodel'), ('llmcompressor', 'llmcompressor'), "
             "('compressed_tensors', 'compressed-tensors')]:\n"
             "    try:\n        __import__(mod); out[mod] = m.version(dist)\n"
             "    except Exception as exc:\n        out[mod] = None\n"
             "print(json.dumps(out))")
    proc = subprocess.run([str(TOOLS_PYTHON), "-c", probe], capture_output=True, text=True, timeout=300,
                          env=tool_env())
    if proc.returncode:
        skip(f"the tools venv python {TOOLS_PYTHON} does not run: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def skip(reason: str) -> None:
    """Skip, or fail where the real-tool step asked for the tools (.ci/real_tools.sh sets it)."""
    if os.environ.get("PWBENCH_REAL_TOOLS_REQUIRED"):
        pytest.fail(reason)
    pytest.skip(reason)


def need(versions: dict, module: str) -> None:
    if not versions.get(module):
        skip(f"{module} is not importable in the tools venv {TOOLS_PYTHON} (re-run `bash .ci/real_tools.sh`)")


def tool_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(GPTQMODEL_CPU_WORKERS="2", OMP_NUM_THREADS="2", CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def tool(script: str, *args: str) -> str:
    # cwd: GPTQModel writes a logs/ folder into the working directory.
    proc = subprocess.run([str(TOOLS_PYTHON), str(TOOLS / script), *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=tool_env(), cwd=tempfile.gettempdir())
    assert proc.returncode == 0, f"{script} {args[0]} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def pwbench(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny random Mixtral folders: hidden 96 (GPTQ, compressed-tensors), and hidden 128 for
    GPTQModel's AWQ, whose clip search needs every output width to be a multiple of 64; and a
    Qwen2-MoE (shared expert, one dense MLP layer: full precision beside the experts)."""
    root = tmp_path_factory.mktemp("real-tools-src")
    return {
        "mixtral": save_checkpoint(build_hf_model("mixtral"), root / "mixtral"),
        "mixtral128": save_checkpoint(build_hf_model("mixtral", hidden_size=128, num_attention_heads=4),
                                      root / "mixtral128"),
        "qwen2_moe": save_checkpoint(build_hf_model("qwen2_moe", moe_intermediate_size=64), root / "qwen2_moe"),
    }


# --- pwbench's side ---------------------------------------------------------------------------


def pwbench_weights(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Each quantized layer as pwbench's reader dequantizes it (float32 [out, in])."""
    config = json.loads((folder / "config.json").read_text())
    scheme = read_scheme(config["quantization_config"], str(folder))
    tensors: dict[str, torch.Tensor] = {}
    for f in folder.glob("*.safetensors"):
        tensors.update(load_file(f))
    out = {}
    for name in names:
        qw = read_linear(lambda suffix: tensors.get(f"{name}.{suffix}"), scheme, name)
        assert qw is not None, f"pwbench finds no {scheme.fmt} tensors for {name}"
        out[name] = dequantize(qw, torch.float32)
    return out


def quantized_prefixes(folder: Path, first: str) -> set[str]:
    keys = set()
    for f in folder.glob("*.safetensors"):
        keys |= set(load_file(f))
    return {k[: -len(first) - 1] for k in keys if k.endswith("." + first)}


def pwbench_greedy(engine: str, folder: Path) -> tuple[dict[int, list[int]], dict[int, torch.Tensor], dict]:
    e = create_engine(engine, {"model": str(folder), "device": "cpu", "dtype": "float32"})
    e.start()
    for j, p in enumerate(PROMPTS):
        e.add_request(EngineRequest(f"r{j}", tuple(p), NEW_TOKENS, ignore_eos=True, return_logits=True))
    tokens = {j: [] for j in range(len(PROMPTS))}
    logits = {j: [] for j in range(len(PROMPTS))}
    while e.has_unfinished():
        for out in e.step().outputs:
            j = int(out.request_id[1:])
            tokens[j] += out.new_token_ids
            logits[j].append(out.logits)
    info = e.info().config["quantization"]
    e.stop()
    return tokens, {j: torch.cat(v) for j, v in logits.items()}, info


def compare(folder: Path, result: Path, first_tensor: str, logits_tol: float | None,
            tokens: dict | None = None, logits: dict | None = None) -> None:
    """The tool's weights (and logits, if it gave them) against pwbench's reading of `folder`."""
    got = load_file(result)
    names = sorted(k.split(":", 1)[1] for k in got if k.startswith("weight:"))
    assert set(names) == quantized_prefixes(folder, first_tensor)  # the tool read every quantized layer
    ours = pwbench_weights(folder, names)
    for name in names:
        assert torch.equal(ours[name], got[f"weight:{name}"]), f"{name}: max |diff| " \
            f"{(ours[name] - got[f'weight:{name}']).abs().max().item():.3g}"
    if logits_tol is None:
        return
    for j, p in enumerate(PROMPTS):
        # the tool ran prompt + the first NEW_TOKENS-1 generated tokens: its last NEW_TOKENS rows
        # are the logits pwbench's engine produced step by step (prefill, then decode)
        want = got[f"logits:{j}"][len(p) - 1:]
        assert want.shape == logits[j].shape
        torch.testing.assert_close(logits[j], want, rtol=logits_tol, atol=logits_tol)


def sequences(tokens: dict[int, list[int]]) -> str:
    return json.dumps([p + tokens[j][:-1] for j, p in enumerate(PROMPTS)])


# --- (a) the tool writes, pwbench reads --------------------------------------------------------

GPTQ_A = {  # bits, symmetric, act-order
    "4bit-sym": (4, True, False),
    "3bit-asym-act-order": (3, False, True),
}


@pytest.mark.parametrize("case", list(GPTQ_A))
def test_gptqmodel_gptq_folder_serves_in_pwbench_as_in_gptqmodel(case, tool_versions, models, tmp_path):
    need(tool_versions, "gptqmodel")
    bits, sym, act_order = GPTQ_A[case]
    out = tmp_path / "gptqmodel"
    tool("gptqmodel_tool.py", "quantize", models["mixtral"], out, "--method", "gptq", "--bits", bits,
         "--group-size", GROUP, *([] if sym else ["--asym"]), *(["--act-order"] if act_order else []))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["sym"], qc["desc_act"]) == ("gptq", bits, sym, act_order)
    assert qc["meta"]["quantizer"][0].startswith("gptqmodel:")
    tokens, logits, info = pwbench_greedy("static-gptq", out)
    assert info["format"] == "gptq" and info["bits"] == bits
    assert len(info["dequantized_at_load"]) == 8  # GPTQModel quantizes attention too: dequantized at load
    tool("gptqmodel_tool.py", "read", out, tmp_path / "tool.safetensors", "--prompts", sequences(tokens))
    compare(out, tmp_path / "tool.safetensors", "qweight", 1e-4, tokens, logits)


def test_gptqmodel_awq_folder_serves_in_pwbench_as_in_gptqmodel(tool_versions, models, tmp_path):
    need(tool_versions, "gptqmodel")
    out = tmp_path / "gptqmodel-awq"
    tool("gptqmodel_tool.py", "quantize", models["mixtral128"], out, "--method", "awq", "--bits", 4,
         "--group-size", GROUP, "--asym")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["version"], qc["zero_point"]) == ("awq", "gemm", True)
    tokens, logits, info = pwbench_greedy("static-awq", out)
    assert info["format"] == "awq"
    tool("gptqmodel_tool.py", "read", out, tmp_path / "tool.safetensors", "--prompts", sequences(tokens))
    # GPTQModel's CPU AWQ kernel multiplies in fp16 whatever the model dtype: logits to ~1e-3
    compare(out, tmp_path / "tool.safetensors", "qweight", 1e-2, tokens, logits)


CT_A = {"4bit-asym": (4, False)}


@pytest.mark.parametrize("case", list(CT_A))
def test_llmcompressor_folder_dequantizes_in_pwbench_as_in_compressed_tensors(case, tool_versions, models, tmp_path):
    need(tool_versions, "llmcompressor")
    bits, sym = CT_A[case]
    out = tmp_path / "llmcompressor"
    tool("llmcompressor_tool.py", "quantize", models["mixtral"], out, "--bits", bits, "--group-size", GROUP,
         *(["--sym"] if sym else []))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    tool("llmcompressor_tool.py", "read", out, tmp_path / "tool.safetensors")
    compare(out, tmp_path / "tool.safetensors", "weight_packed", None)
    tokens, _, info = pwbench_greedy("static-gptq", out)  # and the whole folder serves (GPTQ-made)
    assert info["format"] == "compressed-tensors" and len(info["dequantized_at_load"]) == 8
    assert all(len(t) == NEW_TOKENS for t in tokens.values())


# --- (b) pwbench writes, the tool reads --------------------------------------------------------


@pytest.fixture(scope="module")
def pwbench_folders(models, tmp_path_factory):
    """pwbench quantize outputs, made once: name -> folder."""
    root = tmp_path_factory.mktemp("pwbench-out")
    made = {}

    def make(name: str, src: str, *flags: str) -> Path:
        if name not in made:
            out = root / name
            pwbench("quantize", "--model", str(models[src]), "--group-size", str(GROUP), "--calib-samples", "8",
                    "--calib-len", "64", "--output", str(out), "--quiet", *flags)
            made[name] = out
        return made[name]

    return make


B_CASES = {  # source model, pwbench flags, checkpoint_format it must write (GPTQ)
    "gptq-default": ("mixtral", ["--method", "gptq", "--format", "gptq"], "gptq_v2"),  # 4-bit asymmetric
    "gptq-4bit-sym-act-order": ("mixtral", ["--method", "gptq", "--bits", "4", "--sym", "--act-order",
                                            "--format", "gptq"], "gptq"),
    "gptq-3bit-asym-act-order": ("mixtral", ["--method", "gptq", "--bits", "3", "--act-order", "--format", "gptq"],
                                 "gptq_v2"),
    "awq": ("mixtral128", ["--method", "awq", "--bits", "4", "--format", "awq"], None),
    # the shared expert and the dense MLP (mlp.gate_proj, ...) must stay full precision too
    "gptq-qwen2_moe": ("qwen2_moe", ["--method", "gptq", "--format", "gptq"], "gptq_v2"),
}


@pytest.mark.parametrize("case", list(B_CASES))
def test_pwbench_folder_as_written_reads_in_gptqmodel_as_in_pwbench(case, tool_versions, pwbench_folders, tmp_path):
    """The folder exactly as `pwbench quantize` wrote it: GPTQModel loads it (only the experts
    quantized), dequantizes every expert layer to pwbench's weights and runs pwbench's logits."""
    need(tool_versions, "gptqmodel")
    src, flags, checkpoint_format = B_CASES[case]
    folder = pwbench_folders(case, src, *flags)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["dynamic"] == ONLY_EXPERTS
    if checkpoint_format:
        assert qc["checkpoint_format"] == checkpoint_format and qc["meta"]["quantizer"][0].startswith("pwbench:")
    tokens, logits, _ = pwbench_greedy(f"static-{qc['quant_method']}", folder)
    tool("gptqmodel_tool.py", "read", folder, tmp_path / "tool.safetensors", "--prompts", sequences(tokens))
    # GPTQModel's CPU AWQ kernel multiplies in fp16 whatever the model dtype: logits to ~1e-3
    compare(folder, tmp_path / "tool.safetensors", "qweight", 1e-2 if case == "awq" else 1e-4, tokens, logits)


CT_B = {"4bit-asym-gptq": ["--method", "gptq", "--bits", "4"],
        "3bit-sym-rtn": ["--method", "rtn", "--bits", "3", "--sym"]}


@pytest.mark.parametrize("case", list(CT_B))
def test_pwbench_compressed_tensors_folder_decompresses_in_the_library_as_in_pwbench(case, tool_versions,
                                                                                     pwbench_folders, tmp_path):
    need(tool_versions, "compressed_tensors")
    folder = pwbench_folders(f"ct-{case}", "mixtral", *CT_B[case], "--format", "compressed-tensors")
    tool("llmcompressor_tool.py", "read", folder, tmp_path / "tool.safetensors")
    compare(folder, tmp_path / "tool.safetensors", "weight_packed", None)

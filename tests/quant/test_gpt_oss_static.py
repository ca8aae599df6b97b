"""The static-quantization engines on gpt-oss: experts with biases and a clamped SwiGLU.

The folder written at start holds every expert per projection with its bias copied bit for bit
from the source (engines/quant/export.py); the engine serves what it reads back. Oracles:
transformers' GptOssForCausalLM holding the folder's weights dequantized by the format's reader
(at 4 bits: same greedy tokens, logits within 1e-3), and transformers on the full-precision
checkpoint (at 8 bits: tokens agree up to the reference's first near tie, as in
tests/integration/test_every_architecture.py).
"""

from __future__ import annotations

import pytest
import torch
from engine_runs import generate
from safetensors.torch import load_file
from tiny_models import build_hf_model

from engines.base import EngineRequest
from engines.quant.hf_format import read_linear, read_scheme
from engines.quant.qweight import dequantize
from engines.runtime.checkpoint import open_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 9, 14], list(range(20, 43)), [3, 250, 17, 4, 9, 33, 61, 200, 90, 44, 11, 7]]
NEW_TOKENS = 8
NEAR_TIE = 0.05
CALIB = {"group_size": 32, "calib_samples": 4, "calib_len": 32}
PROJ = ("gate_proj", "up_proj", "down_proj")


def requests(logits: bool = False) -> list[EngineRequest]:
    return [EngineRequest(f"p{i}", tuple(p), NEW_TOKENS, ignore_eos=True, return_logits=logits)
            for i, p in enumerate(PROMPTS)]


def hf_generate(model) -> list[tuple[list[int], torch.Tensor]]:
    out = []
    with torch.inference_mode():
        for p in PROMPTS:
            g = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            out.append((g.sequences[0, len(p):].tolist(), torch.cat(g.logits).float()))
    return out


def dequantized_twin(folder):
    """transformers' gpt-oss holding the quantized folder's weights: dense tensors as stored,
    experts dequantized by the format's reader and fused back (gate/up columns interleaved)."""
    ckpt = open_checkpoint(folder)
    scheme = read_scheme(ckpt.config.quantization, "test")
    tensors = load_file(folder / "model.safetensors")
    model = build_hf_model("gpt_oss")
    with torch.no_grad():
        state = model.state_dict()
        for key, t in tensors.items():
            if key in state:
                state[key].copy_(t)
        for i, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for e in range(ex.gate_up_proj.shape[0]):
                p = f"model.layers.{i}.mlp.experts.{e}."
                gate, up, down = (dequantize(read_linear(lambda s, n=n: tensors.get(f"{p}{n}.{s}"), scheme, n),
                                             torch.float32) for n in PROJ)
                ex.gate_up_proj[e, :, 0::2], ex.gate_up_proj[e, :, 1::2] = gate.T, up.T
                gate_bias, up_bias = (tensors[f"{p}{n}.bias"] for n in PROJ[:2])
                ex.gate_up_proj_bias[e, 0::2], ex.gate_up_proj_bias[e, 1::2] = gate_bias, up_bias
                ex.down_proj[e], ex.down_proj_bias[e] = down.T, tensors[p + "down_proj.bias"]
    return model


def test_folder_holds_exact_biases_and_loads_back(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    src = checkpoints("gpt_oss")
    outputs, _, info = generate("static-rtn", src, requests(), bits=8, **CALIB)
    folder = open_checkpoint(info.config["quantization"]["folder"]).path
    source, written = load_file(src / "model.safetensors"), load_file(folder / "model.safetensors")
    assert not [k for k in written if k.endswith(("gate_up_proj", "gate_up_proj_bias", "down_proj_bias"))]
    for i in range(2):
        gate_up, down = (source[f"model.layers.{i}.mlp.experts.{n}_bias"] for n in ("gate_up_proj", "down_proj"))
        for e in range(gate_up.shape[0]):
            p = f"model.layers.{i}.mlp.experts.{e}."
            assert torch.equal(written[p + "gate_proj.bias"], gate_up[e, 0::2])
            assert torch.equal(written[p + "up_proj.bias"], gate_up[e, 1::2])
            assert torch.equal(written[p + "down_proj.bias"], down[e])
            assert written[p + "gate_proj.bias"].dtype == gate_up.dtype
    assert set(outputs) == {"p0", "p1", "p2"}


def test_rtn_8_bits_matches_transformers_up_to_a_near_tie(checkpoints, tmp_path, monkeypatch):
    """Stated tolerance: each prompt's greedy tokens equal transformers' full-precision ones up to
    the first step where the reference's top-1 minus top-2 logit is under NEAR_TIE (8-bit
    rounding moves these logits by ~1e-3, so it can flip only a near tie; after a flip the
    sequences part and nothing later is compared)."""
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    outputs, _, _ = generate("static-rtn", checkpoints("gpt_oss"), requests(), bits=8, **CALIB)
    for i, (want, logits) in enumerate(hf_generate(build_hf_model("gpt_oss"))):
        top2 = logits.topk(2, dim=-1).values
        near = next((t for t, gap in enumerate((top2[:, 0] - top2[:, 1]).tolist()) if gap < NEAR_TIE), NEW_TOKENS)
        got = outputs[f"p{i}"]
        agreed = next((n for n, (a, b) in enumerate(zip(got, want)) if a != b), NEW_TOKENS)
        assert agreed >= near, f"prompt {i}: diverged at {agreed} before the first near tie {near}: {got} vs {want}"


@pytest.mark.parametrize("engine", ["static-rtn", "static-gptq", "static-awq"])
def test_4_bit_folder_serves_what_it_stores(engine, checkpoints, tmp_path, monkeypatch):
    """Same tokens and logits as transformers holding the folder's dequantized weights (AWQ: with
    its input scales folded into the norm and the router, exactly as written)."""
    from engines.registry import create_engine

    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    options = {"model": str(checkpoints("gpt_oss")), "device": "cpu", "dtype": "float32", "bits": 4, **CALIB}
    eng = create_engine(engine, options)
    got: dict[str, tuple[list[int], list[torch.Tensor]]] = {f"p{i}": ([], []) for i in range(len(PROMPTS))}
    with eng:
        for r in requests(logits=True):
            eng.add_request(r)
        while eng.has_unfinished():
            for o in eng.step().outputs:
                got[o.request_id][0].extend(o.new_token_ids)
                got[o.request_id][1].append(o.logits)
        folder = eng.checkpoint.path
        experts = eng.experts.weights(0)
        assert experts.clamp == eng.checkpoint.config.swiglu_clamp and experts.gate_up_bias is not None
    for i, (tokens, logits) in enumerate(hf_generate(dequantized_twin(folder))):
        assert got[f"p{i}"][0] == tokens, (engine, i)
        assert (torch.cat(got[f"p{i}"][1]) - logits).abs().max().item() <= 1e-3

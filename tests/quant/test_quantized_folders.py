"""Folders written by `pwbench quantize`, served by the static engines.

Oracle: each format's published definition, written out below in plain tensor ops (GPTQ v1 and
v2 qweight/qzeros/scales/g_idx, AutoAWQ GEMM's interleaved nibbles, compressed-tensors
pack-quantized), dequantizes the folder into a dense checkpoint that the full-precision `moe`
engine runs; the static engine on the quantized folder must generate the same tokens with the
same logits. Also: quantizing at start equals loading the cache, and resident expert bytes
match the format's arithmetic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engines.base import EngineRequest
from engines.registry import create_engine

pytestmark = pytest.mark.usefixtures("one_thread")

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column AWQ_ORDER[i] of its 8
SHIFTS = torch.arange(8, dtype=torch.int32) * 4
GROUP = 32
CASES = {  # method, format, extra flags
    "gptq": ("gptq", "gptq", ["--act-order"]),  # asymmetric: gptq_v2
    "gptq-sym": ("gptq", "gptq", ["--sym"]),  # symmetric: gptq (v1)
    "awq": ("awq", "awq", []),
    "compressed-tensors": ("rtn", "compressed-tensors", []),
}


def pwbench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    return proc


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., w] -> the 8 nibbles of each word, lowest first: [..., w, 8]."""
    return (words.unsqueeze(-1) >> SHIFTS) & 0xF


def dense_gptq(t: dict, checkpoint_format: str = "gptq") -> torch.Tensor:
    """GPTQ, 4 bits: qweight [in/8, out] packs inputs; qzeros [G, out/8] packs zero - 1 (v1,
    checkpoint_format "gptq") or zero (v2, "gptq_v2")."""
    codes = nibbles(t["qweight"].T).reshape(t["qweight"].shape[1], -1)  # [out, in]
    zeros = nibbles(t["qzeros"]).reshape(t["qzeros"].shape[0], -1) + (checkpoint_format == "gptq")  # [G, out]
    g = t["g_idx"].long()
    return (codes - zeros[g].T) * t["scales"].float()[g].T


def dense_awq(t: dict) -> torch.Tensor:
    """AutoAWQ GEMM: qweight [in, out/8] and qzeros [G, out/8] pack outputs in AWQ_ORDER."""
    def unpack(words):
        v = nibbles(words)
        out = torch.empty_like(v)
        out[..., AWQ_ORDER] = v
        return out.reshape(words.shape[0], -1)

    codes, zeros = unpack(t["qweight"]), unpack(t["qzeros"])  # [in, out], [G, out]
    g = torch.arange(codes.shape[0]) // GROUP
    return ((codes - zeros[g]) * t["scales"].float()[g]).T


def dense_compressed_tensors(t: dict) -> torch.Tensor:
    """pack-quantized: weight_packed [out, in/8] (codes = signed value + 8), zero points packed along out."""
    out, inp = t["weight_shape"].tolist()
    codes = nibbles(t["weight_packed"]).reshape(out, inp)
    zeros = nibbles(t["weight_zero_point"].T).reshape(-1, out).T  # [out, G]
    g = torch.arange(inp) // GROUP
    return (codes - zeros[:, g]) * t["weight_scale"].float()[:, g]


DENSE = {"gptq": dense_gptq, "awq": dense_awq, "compressed-tensors": dense_compressed_tensors}


def dequantized_copy(folder, fmt, dst):
    """The quantized folder as a dense float32 checkpoint, experts dequantized by the oracle above."""
    tensors = load_file(folder / "model.safetensors")
    dense, experts = {}, {}
    for key, t in tensors.items():
        if ".experts." in key:
            prefix, suffix = key.rsplit(".", 1)
            experts.setdefault(prefix, {})[suffix] = t
        else:
            dense[key] = t
    config = json.loads((folder / "config.json").read_text())
    qc = config.pop("quantization_config")
    for prefix, parts in experts.items():
        args = (qc["checkpoint_format"],) if fmt == "gptq" else ()
        dense[prefix + ".weight"] = DENSE[fmt](parts, *args).float().contiguous()
    dst.mkdir()
    save_file(dense, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def greedy(engine_name: str, options: dict, prompts, n: int = 10):
    engine = create_engine(engine_name, {"device": "cpu", "dtype": "float32", **options})
    engine.start()
    for j, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{j}", tuple(p), n, ignore_eos=True, return_logits=True))
    tokens = {f"r{j}": [] for j in range(len(prompts))}
    logits = {f"r{j}": [] for j in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            logits[out.request_id].append(out.logits)
    info = engine.info()
    engine.stop()
    return tokens, {k: torch.cat(v) for k, v in logits.items()}, info


PROMPTS = [[5, 9, 14, 200, 37, 88, 3, 41], [100, 101, 102], list(range(20, 60))]


@pytest.mark.parametrize("case", [c if c in ("gptq", "compressed-tensors") else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES])  # the other cases: CI's slow step
def test_quantized_folder_generates_like_its_dequantized_copy(case, checkpoints, tmp_path):
    src = checkpoints("mixtral")
    method, fmt, flags = CASES[case]
    out = tmp_path / f"q-{case}"
    pwbench("quantize", "--model", str(src), "--method", method, "--format", fmt, "--bits", "4",
            "--group-size", str(GROUP), "--calib-samples", "8", "--calib-len", "128", "--output", str(out), *flags)
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no partial folder left behind
    assert {"config.json", "generation_config.json", "model.safetensors", "quantize_report.json"} <= {
        p.name for p in out.iterdir()}
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == fmt
    if fmt == "gptq":  # asymmetric zero points as gptq_v2 (GPTQModel loads no other's asymmetric v1)
        assert (qc["sym"], qc["checkpoint_format"]) == ((True, "gptq") if case == "gptq-sym" else (False, "gptq_v2"))
    if fmt in ("gptq", "awq"):  # GPTQModel's only exclusion rule: everything but the routed experts
        assert qc["dynamic"] == {r"-:^(?!(?:.*\.)?mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj)$).*": {}}
    report = json.loads((out / "quantize_report.json").read_text())
    assert report["method"] == method and len(report["layers"]) == 2
    for layer in report["layers"]:
        assert sum(e["routed"] for e in layer["experts"]) == 2 * report["calibration"]["tokens"]

    with safe_open(out / "model.safetensors", "pt") as f:
        shapes = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}
    D, I = 96, 64
    expected = {
        "gptq": {"qweight": ([D // 8, I], "I32"), "qzeros": ([D // GROUP, I // 8], "I32"),
                 "scales": ([D // GROUP, I], "F16"), "g_idx": ([D], "I32")},
        "awq": {"qweight": ([D, I // 8], "I32"), "qzeros": ([D // GROUP, I // 8], "I32"),
                "scales": ([D // GROUP, I], "F16")},
        "compressed-tensors": {"weight_packed": ([I, D // 8], "I32"), "weight_scale": ([I, D // GROUP], "F16"),
                               "weight_zero_point": ([I // 8, D // GROUP], "I32"), "weight_shape": ([2], "I64")},
    }[fmt]
    assert {k.rsplit(".", 1)[1]: v for k, v in shapes.items() if ".layers.1.mlp.experts.5.up_proj." in k} == expected
    assert "model.layers.0.mlp.gate.weight" in shapes and not any("block_sparse_moe" in k for k in shapes)

    fp = load_file(src / "model.safetensors")
    q = load_file(out / "model.safetensors")
    for key, t in fp.items():
        name = key.replace("block_sparse_moe", "mlp")
        if ".experts." in key:
            continue
        if fmt == "awq" and (name.endswith("post_attention_layernorm.weight") or name.endswith("mlp.gate.weight")):
            continue
        assert torch.equal(q[name], t), name
    if fmt == "awq":  # the input scale moved from the norm into the router: their product is unchanged
        for i in range(2):
            norm, router = (f"model.layers.{i}.post_attention_layernorm.weight", f"model.layers.{i}.mlp.gate.weight")
            fp_router = fp[router.replace("mlp", "block_sparse_moe")]
            assert not torch.equal(q[norm], fp[norm])
            torch.testing.assert_close(q[router] * q[norm], fp_router * fp[norm], rtol=1e-5, atol=1e-6)

    dense = dequantized_copy(out, fmt, tmp_path / "dense")
    want_tokens, want_logits, _ = greedy("moe", {"model": str(dense)}, PROMPTS)
    got_tokens, got_logits, info = greedy(f"static-{method}", {"model": str(out)}, PROMPTS)
    assert got_tokens == want_tokens
    for k in want_logits:
        torch.testing.assert_close(got_logits[k], want_logits[k], rtol=1e-4, atol=1e-4)
    assert info.config["quantization"]["format"] == fmt and info.config["quantization"]["dequantized_at_load"] == []

    if case == "gptq":  # and from the command line
        proc = pwbench("generate", "--engine", "static-gptq", "--model", str(out), "--max-new-tokens", "10",
                       "--ignore-eos", "--json", *[a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))])
        outputs = json.loads(proc.stdout.strip().splitlines()[-1])["outputs"]
        assert [o["output_ids"] for o in outputs] == [want_tokens[f"r{j}"] for j in range(len(PROMPTS))]


def test_static_rtn_quantized_at_start_equals_its_cache(checkpoints, tmp_path):
    options = {"model": str(checkpoints("mixtral")), "bits": 4, "group_size": GROUP, "cache_dir": str(tmp_path),
               "calib_samples": 4, "calib_len": 64}
    first_tokens, first_logits, first = greedy("static-rtn", options, PROMPTS)
    (cache,) = tmp_path.iterdir()
    stamp = (cache / "model.safetensors").stat().st_mtime_ns
    again_tokens, again_logits, again = greedy("static-rtn", options, PROMPTS)
    assert first.config["quantization"]["quantized_at_start"] and not again.config["quantization"]["quantized_at_start"]
    assert first.config["quantization"]["folder"] == again.config["quantization"]["folder"] == str(cache)
    assert (cache / "model.safetensors").stat().st_mtime_ns == stamp and len(list(tmp_path.iterdir())) == 1
    assert again_tokens == first_tokens
    for k in first_logits:
        assert torch.equal(again_logits[k], first_logits[k])
    # Another method or option is another cache entry.
    greedy("static-rtn", {**options, "bits": 3}, PROMPTS[:1], n=1)
    assert len(list(tmp_path.iterdir())) == 2


def test_resident_expert_bytes_of_static_gptq_at_4_bits(checkpoints, tmp_path):
    src = checkpoints("mixtral")
    out = tmp_path / "q"
    pwbench("quantize", "--model", str(src), "--method", "gptq", "--group-size", str(GROUP), "--calib-samples", "4",
            "--calib-len", "64", "--output", str(out), "--quiet")
    _, _, info = greedy("static-gptq", {"model": str(out)}, PROMPTS[:1], n=1)
    D, I, E, L = 96, 64, 6, 2

    def matrix_bytes(out_f: int, in_f: int) -> int:
        groups = in_f // GROUP
        codes = out_f * in_f * 4 // 8  # 4 bits per weight, packed densely in int32 words
        scales = out_f * groups * 2  # one float16 scale per group
        zeros = out_f * -(-groups * 4 // 32) * 4  # one 4-bit zero per group, in int32 words per row
        return codes + scales + zeros  # no g_idx: without act-order it is k // group_size

    per_expert = 2 * matrix_bytes(I, D) + matrix_bytes(D, I)
    assert per_expert == 2 * (3072 + 384 + 256) + (3072 + 384 + 384) == 11264
    assert info.model_stats["bytes_per_expert"] == per_expert
    fp16_per_expert = 3 * I * D * 2
    assert Fraction(per_expert, fp16_per_expert) == Fraction(11, 36)  # 0.3056 at these tiny shapes
    assert info.weight_bytes == info.model_stats["dense_weight_bytes"] + 257 * D * 4 + E * L * per_expert


def test_transformers_loads_our_folder_where_its_backend_is_installed(checkpoints, tmp_path):
    """transformers' own loader as the oracle, when a quantization backend is importable here.

    Measured with compressed-tensors 0.20.1 beside transformers 5.24: its loader keeps Mixtral's
    experts fused (gate_up_proj [E, 2I, D]) and reports every per-expert quantized tensor as
    unexpected, i.e. random experts; GPTQ and AWQ backends need gptqmodel / autoawq (CUDA)."""
    import importlib.util

    backends = [m for m in ("gptqmodel", "compressed_tensors") if importlib.util.find_spec(m)]
    if not backends:
        pytest.skip("no transformers quantization backend (gptqmodel, compressed_tensors) in this environment")
    import transformers

    fmt = "gptq" if backends[0] == "gptqmodel" else "compressed-tensors"
    method = "gptq" if fmt == "gptq" else "rtn"
    out = tmp_path / "q"
    pwbench("quantize", "--model", str(checkpoints("mixtral")), "--method", method, "--format", fmt,
            "--group-size", str(GROUP), "--calib-samples", "4", "--calib-len", "64", "--output", str(out), "--quiet")
    model, loading = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    prompt = PROMPTS[0]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
    tokens, _, _ = greedy(f"static-{method}", {"model": str(out)}, [prompt])
    assert tokens["r0"] == want


@pytest.mark.slow  # kept under the README's ~12 min; CI's slow step runs it
def test_older_gptq_names_and_quantized_attention_load(checkpoints, tmp_path):
    """An AutoGPTQ-era Mixtral folder: `block_sparse_moe.experts.N.{w1,w3,w2}`, symmetric v1
    (what pwbench writes for --sym) and a quantized q_proj. It must serve exactly what the
    GPTQModel-named folder serves, with q_proj dequantized."""
    from engines.quant.convert import to_gptq
    from engines.quant.qweight import quantize_rtn

    out = tmp_path / "q"
    pwbench("quantize", "--model", str(checkpoints("mixtral")), "--method", "gptq", "--sym", "--group-size",
            str(GROUP), "--calib-samples", "4", "--calib-len", "64", "--output", str(out), "--quiet")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["checkpoint_format"] == "gptq"
    old = tmp_path / "old"
    old.mkdir()
    for f in out.iterdir():
        if f.name not in ("model.safetensors", "quantize_report.json"):  # no report: quant_method says gptq
            (old / f.name).write_bytes(f.read_bytes())
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    tensors = {}
    for key, t in load_file(out / "model.safetensors").items():
        key = key.replace(".mlp.", ".block_sparse_moe.")
        for new, legacy in names.items():
            key = key.replace(f".{new}.", f".{legacy}.")
        tensors[key] = t
    q_proj = "model.layers.1.self_attn.q_proj"
    packed = to_gptq(quantize_rtn(tensors.pop(q_proj + ".weight"), 4, GROUP, symmetric=True))
    tensors.update({f"{q_proj}.{k}": v for k, v in packed.items()})
    save_file(tensors, str(old / "model.safetensors"), metadata={"format": "pt"})

    # The oracle: the GPTQ-named folder with q_proj replaced by its dequantized weight.
    ref = tmp_path / "ref"
    ref.mkdir()
    for f in out.iterdir():
        if f.name != "model.safetensors":
            (ref / f.name).write_bytes(f.read_bytes())
    ref_tensors = load_file(out / "model.safetensors")
    ref_tensors[q_proj + ".weight"] = dense_gptq(packed).contiguous()
    save_file(ref_tensors, str(ref / "model.safetensors"), metadata={"format": "pt"})

    got_tokens, got_logits, info = greedy("static-gptq", {"model": str(old)}, PROMPTS)
    want_tokens, want_logits, _ = greedy("static-gptq", {"model": str(ref)}, PROMPTS)
    assert got_tokens == want_tokens
    for k in want_logits:
        torch.testing.assert_close(got_logits[k], want_logits[k], rtol=1e-5, atol=1e-5)
    assert info.config["quantization"]["dequantized_at_load"] == [q_proj]


def test_awq_folds_its_input_scale_into_everything_that_reads_the_norm(checkpoints, tmp_path):
    """Qwen2-MoE: the router, the shared expert's gate/up and its sigmoid gate read the
    post-attention norm too; each must take the scale back (W·norm unchanged), the dense
    layer (mlp_only_layers) and every other tensor must stay as they were."""
    from engines.quant.calibrate import QuantizeOptions, random_prompts
    from engines.quant.export import quantize_folder

    src = checkpoints("qwen2_moe", moe_intermediate_size=64)
    out = tmp_path / "awq"
    quantize_folder(src, out, QuantizeOptions("awq", 4, GROUP), random_prompts(257, 4, 64, 0, (2,)), device="cpu")
    fp, q = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    alphas = {str(r["layer"]): r["awq_alpha"] for r in json.loads((out / "quantize_report.json").read_text())["layers"]}
    assert sorted(alphas) == ["0", "2"] and any(alphas.values())  # alpha 0 is s = 1: nothing to fold
    reads_norm = ("mlp.gate.weight", "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                  "mlp.shared_expert_gate.weight")
    for key, t in fp.items():
        if ".experts." in key:
            continue
        layer = key.split(".")[2] if key.startswith("model.layers.") else None
        norm = f"model.layers.{layer}.post_attention_layernorm.weight"
        if alphas.get(layer) and key.endswith(reads_norm):
            torch.testing.assert_close(q[key] * q[norm], t * fp[norm], rtol=1e-5, atol=1e-7)
            assert not torch.equal(q[key], t), key
        elif alphas.get(layer) and key == norm:
            assert not torch.equal(q[key], t), key
        else:
            assert torch.equal(q[key], t), key

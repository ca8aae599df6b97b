"""gpt-oss folders with MXFP4 experts, written here from the format definition: loaded with no
flag (dequantized), or kept in MXFP4 on the device (engine moe with expert_format=mxfp4, and
the static engines, which serve the folder as stored).

MXFP4 (OCP Microscaling Formats v1.0): blocks of 32 values share one E8M0 scale byte
(2^(byte - 127)); each value is an FP4 E2M1 code, two per uint8, low nibble first. The
quantizer below follows that definition (smallest power of two that brings the block's
largest magnitude within FP4's 6.0, then round to the nearest code). Oracles: transformers'
own MXFP4 loader (GptOssForCausalLM with Mxfp4Config(dequantize=True), which on a CPU without
kernels dequantizes at load) for tokens and logits, `convert_moe_packed_tensors` for the bytes.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import CPU32, build_hf_model

from engines.base import EngineError, EngineRequest
from engines.moe import MoEEngine, MoEEngineConfig
from engines.registry import create_engine
from engines.runtime.mxfp4 import dequantize_mxfp4

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
PROMPTS = [[5, 9, 14], list(range(20, 43)), [3, 250, 17, 4, 9, 33, 61, 2, 90, 44, 1]]
NEW_TOKENS = 16
LOGIT_TOL = 1e-3


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., C] float -> (blocks [..., C/32, 16] uint8, scales [..., C/32] uint8)."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)  # nearest FP4 value
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def hf_tokens(model, prompt):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(MXFP4 folder, its dequantized full-precision twin, the packed tensors written)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("mxfp4")
    model = build_hf_model("gpt_oss", seed=3)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(experts, name)  # in memory [E, in, out]; MXFP4 rows are [E, out, in]
                blocks, scales = quantize_mxfp4(param.transpose(1, 2).contiguous())
                theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # -> [E, in, out]
                assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2), theirs)
                assert (theirs - param).abs().max() <= param.abs().max() / 4  # coarse, yet close
                param.copy_(theirs)  # the twin holds exactly the dequantized values
                prefix = f"model.layers.{i}.mlp.experts.{name}"
                packed[prefix + "_blocks"], packed[prefix + "_scales"] = blocks, scales
    twin, mxfp4 = root / "twin", root / "mxfp4"
    model.save_pretrained(twin)
    model.save_pretrained(mxfp4)
    state = {k: v for k, v in load_file(mxfp4 / "model.safetensors").items()
             if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**state, **packed}, mxfp4 / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mxfp4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    return mxfp4, twin, packed


@pytest.fixture(scope="module")
def expected(folders):
    """transformers loading the MXFP4 folder itself (dequantized at load, float32)."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    model = GptOssForCausalLM.from_pretrained(folders[0], quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf_tokens(model, p) for p in PROMPTS]


def run(engine) -> tuple[dict[str, tuple[list[int], torch.Tensor]], dict[str, int]]:
    """(request -> tokens and logits, the weight bytes the engine held: dense, experts, info)."""
    got = {str(i): ([], []) for i in range(len(PROMPTS))}
    with engine:
        for i, p in enumerate(PROMPTS):
            engine.add_request(EngineRequest(str(i), tuple(p), NEW_TOKENS, ignore_eos=True, return_logits=True))
        while engine.has_unfinished():
            for o in engine.step().outputs:
                got[o.request_id][0].extend(o.new_token_ids)
                got[o.request_id][1].append(o.logits)
        info = engine.info()
        held = {"dense": engine.weights.nbytes(), "experts": engine.experts.device_bytes(), "info": info.weight_bytes,
                "format": info.config.get("quantization", {}).get("format")}
    return {k: (tokens, torch.cat(logits)) for k, (tokens, logits) in got.items()}, held


def check(got, expected) -> None:
    for i, (tokens, logits) in enumerate(expected):
        assert got[str(i)][0] == tokens, i
        assert (got[str(i)][1] - logits).abs().max().item() <= LOGIT_TOL


def packed_bytes(folder_tensors: dict[str, torch.Tensor]) -> int:
    """4-bit blocks + scale bytes of every expert matrix, as the folder stores them."""
    return sum(t.numel() for t in folder_tensors.values())


def test_mxfp4_folder_dequantized_and_its_twin_match_transformers(folders, expected):
    mxfp4, twin, _ = folders
    for folder in (mxfp4, twin):
        engine = MoEEngine(MoEEngineConfig(**CPU32, model=str(folder), block_size=4, max_num_batched_tokens=16))
        check(run(engine)[0], expected)


@pytest.mark.parametrize("engine_name", ["moe", "static-rtn"])
def test_mxfp4_served_packed_matches_transformers(engine_name, folders, expected):
    """Experts stay MXFP4 on the device: same tokens and logits as transformers' own MXFP4
    dequantization; the expert bytes held are the folder's 4-bit blocks and scale bytes plus
    the biases, exactly."""
    mxfp4, _, packed = folders
    options = {"expert_format": "mxfp4"} if engine_name == "moe" else {}
    engine = create_engine(engine_name, {**CPU32, "model": str(mxfp4), "block_size": 4,
                                         "max_num_batched_tokens": 16, **options})
    got, held = run(engine)
    check(got, expected)
    cfg = engine.checkpoint.config
    biases = cfg.num_layers * cfg.num_experts * (2 * cfg.moe_intermediate_size + cfg.hidden_size) * 4  # float32
    assert held["experts"] == packed_bytes(packed) + biases
    assert held["info"] == held["dense"] + packed_bytes(packed) + biases
    assert held["format"] == (None if engine_name == "moe" else "mxfp4")


def test_served_mxfp4_weights_are_the_checkpoints(folders):
    """What the device holds dequantizes to transformers' reading of the checkpoint, bit for bit
    (gate rows first: the checkpoint interleaves gate and up rows)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    mxfp4, _, packed = folders
    engine = MoEEngine(MoEEngineConfig(**CPU32, model=str(mxfp4), expert_format="mxfp4", kv_blocks=4))
    with engine:
        for i in engine.experts.layers():
            served = engine.experts.weights(i).dequantize(torch.float32)
            p = f"model.layers.{i}.mlp.experts."
            gate_up = convert_moe_packed_tensors(packed[p + "gate_up_proj_blocks"], packed[p + "gate_up_proj_scales"],
                                                 dtype=torch.float32)  # [E, D, 2I], gate/up columns alternate
            down = convert_moe_packed_tensors(packed[p + "down_proj_blocks"], packed[p + "down_proj_scales"],
                                              dtype=torch.float32)  # [E, I, D]
            assert torch.equal(served.gate_up, torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]), -1).transpose(1, 2))
            assert torch.equal(served.down, down.transpose(1, 2))


def test_expert_format_mxfp4_needs_an_mxfp4_folder(folders):
    _, twin, _ = folders
    with pytest.raises(EngineError, match=r"expert_format=mxfp4 .* use expert_format=dense"):
        MoEEngine(MoEEngineConfig(**CPU32, model=str(twin), expert_format="mxfp4")).start()
    with pytest.raises(EngineError, match=r"expert_format must be one of dense, mxfp4"):
        MoEEngine(MoEEngineConfig(**CPU32, model=str(twin), expert_format="fp4")).start()


def test_static_engines_refuse_bits_on_an_mxfp4_folder(folders):
    with pytest.raises(EngineError, match=r"MXFP4 experts, served as stored; --set bits"):
        create_engine("static-gptq", {**CPU32, "model": str(folders[0]), "bits": 4}).start()

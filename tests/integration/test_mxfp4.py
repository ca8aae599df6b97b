"""A gpt-oss folder with MXFP4 experts, written here from the format definition, loads with no
flag and gives the tokens and logits of its dequantized full-precision twin in transformers.

MXFP4 (OCP Microscaling Formats v1.0): blocks of 32 values share one E8M0 scale byte
(2^(byte - 127)); each value is an FP4 E2M1 code, two per uint8, low nibble first. The
quantizer below follows that definition (smallest power of two that brings the block's
largest magnitude within FP4's 6.0, then round to the nearest code); transformers'
`convert_moe_packed_tensors` (CPU) checks our reading of the bytes.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file
from tiny_models import CPU32, build_hf_model

from engines.base import EngineRequest
from engines.moe import MoEEngine, MoEEngineConfig
from engines.runtime.mxfp4 import dequantize_mxfp4

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
PROMPTS = [[5, 9, 14], list(range(20, 43)), [3, 250, 17, 4, 9, 33, 61, 2, 90, 44, 1]]
NEW_TOKENS = 32


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


def test_mxfp4_folder_matches_its_dequantized_twin(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = build_hf_model("gpt_oss", seed=3)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(experts, name)  # in memory [E, in, out]; MXFP4 rows are [E, out, in]
                blocks, scales = quantize_mxfp4(param.transpose(1, 2).contiguous())
                theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # -> [E, in, out]
                ours = dequantize_mxfp4(blocks, scales, torch.float32)
                assert torch.equal(ours.transpose(1, 2), theirs)
                assert (theirs - param).abs().max() <= param.abs().max() / 4  # coarse, yet close
                param.copy_(theirs)  # the twin holds exactly the dequantized values
                prefix = f"model.layers.{i}.mlp.experts.{name}"
                packed[prefix + "_blocks"], packed[prefix + "_scales"] = blocks, scales
    twin, mxfp4 = tmp_path / "twin", tmp_path / "mxfp4"
    model.save_pretrained(twin)
    model.save_pretrained(mxfp4)
    state = {k: v for k, v in load_file(mxfp4 / "model.safetensors").items()
             if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**state, **packed}, mxfp4 / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mxfp4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mxfp4 / "config.json").write_text(json.dumps(config))

    with torch.inference_mode():
        expected = [hf_tokens(model, p) for p in PROMPTS]
    for folder in (mxfp4, twin):
        engine = MoEEngine(MoEEngineConfig(**CPU32, model=str(folder), block_size=4, max_num_batched_tokens=16))
        got = {str(i): ([], []) for i in range(len(PROMPTS))}
        with engine:
            for i, p in enumerate(PROMPTS):
                engine.add_request(EngineRequest(str(i), tuple(p), NEW_TOKENS, ignore_eos=True, return_logits=True))
            while engine.has_unfinished():
                for o in engine.step().outputs:
                    got[o.request_id][0].extend(o.new_token_ids)
                    got[o.request_id][1].append(o.logits)
        for i, (tokens, logits) in enumerate(expected):
            assert got[str(i)][0] == tokens, (folder.name, i)
            assert (torch.cat(got[str(i)][1]) - logits).abs().max().item() <= 1e-3

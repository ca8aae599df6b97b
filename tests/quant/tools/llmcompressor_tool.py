"""llm-compressor / compressed-tensors' side of tests/quant/test_real_tools.py (tools venv).

    python llmcompressor_tool.py quantize SRC OUT --bits B --group-size G [--sym]
        llm-compressor's GPTQModifier (oneshot, CPU) quantizes every Linear of SRC except
        lm_head and the router, and saves OUT compressed (pack-quantized).
    python llmcompressor_tool.py read FOLDER RESULT.safetensors
        compressed-tensors' own PackedQuantizationCompressor.decompress on every quantized
        layer of FOLDER: `weight:NAME` [out, in] float32.

No logits here: transformers 5.17 + compressed-tensors 0.19 load a per-expert MoE folder with
the experts fused and left at random init (they are reported missing), so the library has no
model-level reader to compare with; the per-layer decompressor is its reader.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gptqmodel_tool import with_tokenizer


def quantize(args: argparse.Namespace) -> None:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out = Path(args.src), Path(args.out)
    work = with_tokenizer(src, out.parent / f".{out.name}.src")
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    model = AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32)
    g = torch.Generator().manual_seed(args.seed)
    n, length = args.calib_samples, args.calib_len
    ds = Dataset.from_dict({"input_ids": [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)],
                            "attention_mask": [[1] * length] * n})
    weights = QuantizationArgs(num_bits=args.bits, type="int", symmetric=args.sym, strategy="group",
                               group_size=args.group_size)
    recipe = GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                          ignore=["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"])
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=length, num_calibration_samples=n,
            processor=AutoTokenizer.from_pretrained(work))
    model.save_pretrained(out, save_compressed=True)
    if work != src:
        shutil.rmtree(work)


def read(args: argparse.Namespace) -> None:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as C
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file, save_file

    folder = Path(args.folder)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**group["weights"]))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    result = {}
    for key in sorted(k for k in tensors if k.endswith(".weight_packed")):
        prefix = key[: -len(".weight_packed")]
        local = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        # fp16 scales widened to float32 (exact) so the library's product is not rounded to fp16.
        local["weight_scale"] = local["weight_scale"].float()
        result[f"weight:{prefix}"] = C.decompress(local, scheme)["weight"].float().contiguous()
    save_file(result, args.result)
    print(json.dumps({"layers": len(result)}))


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quantize")
    q.add_argument("src")
    q.add_argument("out")
    q.add_argument("--bits", type=int, default=4)
    q.add_argument("--group-size", type=int, default=32)
    q.add_argument("--sym", action="store_true")
    q.add_argument("--calib-samples", type=int, default=8)
    q.add_argument("--calib-len", type=int, default=64)
    q.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("read")
    r.add_argument("folder")
    r.add_argument("result")
    args = p.parse_args()
    torch.manual_seed(0)
    {"quantize": quantize, "read": read}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

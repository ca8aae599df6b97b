"""GPTQModel's side of tests/quant/test_real_tools.py; runs under the tools venv (.ci/real_tools.sh).

    python gptqmodel_tool.py quantize SRC OUT --method gptq|awq --bits B --group-size G [--asym] [--act-order]
        GPTQModel quantizes the full-precision folder SRC on CPU and saves OUT (its own writer).
    python gptqmodel_tool.py read FOLDER RESULT.safetensors --prompts '[[5, 9], [100]]'
        GPTQModel loads the quantized FOLDER with its torch (CPU) kernels and writes, for every
        quantized linear layer, its own dequantized weight `weight:NAME` [out, in] (float32) and,
        for every prompt j, the model's logits `logits:j` [T, vocab] (float32).

Nothing here imports pwbench: the two sides share only files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch


def add_tokenizer(folder: Path, vocab_size: int) -> None:
    """GPTQModel's loader insists on a tokenizer; the tiny test models have none. A word-level
    one over the ids (`t3` is id 3) is enough: calibration is passed as token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<pad>").save_pretrained(folder)


def with_tokenizer(src: Path, scratch: Path) -> Path:
    if (src / "tokenizer.json").exists() or (src / "tokenizer_config.json").exists():
        return src
    shutil.copytree(src, scratch)
    add_tokenizer(scratch, json.loads((src / "config.json").read_text())["vocab_size"])
    return scratch


def quantize(args: argparse.Namespace) -> None:
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.quantization.config import AWQConfig, GPTQConfig

    src, out = Path(args.src), Path(args.out)
    work = with_tokenizer(src, out.parent / f".{out.name}.src")
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(args.seed)
    calib = [{"input_ids": torch.randint(3, vocab, (args.calib_len,), generator=g).tolist(),
              "attention_mask": [1] * args.calib_len} for _ in range(args.calib_samples)]
    common = dict(bits=args.bits, group_size=args.group_size, sym=not args.asym)
    if args.method == "gptq":
        qc = GPTQConfig(**common, desc_act=args.act_order)
    else:
        qc = AWQConfig(**common)
    # GPTQ calibrates in float32 on CPU; AWQ's CPU (torch) kernel takes fp16/bf16 models only.
    dtype = torch.float32 if args.method == "gptq" else torch.float16
    model = GPTQModel.load(str(work), qc, device="cpu", dtype=dtype)
    # AUTO picks the CUDA GEMM kernel for AWQ; the torch kernels run on CPU.
    backend = BACKEND.GPTQ_TORCH if args.method == "gptq" else BACKEND.AWQ_TORCH
    model.quantize(calib, batch_size=1, backend=backend)
    model.save(str(out))
    if work != src:
        shutil.rmtree(work)


def restore_full_precision(hf: torch.nn.Module, folder: Path) -> None:
    """Put back the folder's float32 tensors (embeddings, norms, router, lm_head) that the fp16
    load rounded; quantized layers are untouched (their scales are fp16 on disk anyway)."""
    from safetensors.torch import load_file

    params = dict(hf.named_parameters())
    params.update(dict(hf.named_buffers()))
    stored = {k: v for k, v in load_file(folder / "model.safetensors").items() if v.dtype == torch.float32}
    unknown = sorted(set(stored) - set(params))
    if unknown:
        raise SystemExit(f"float tensors in {folder} that GPTQModel's model does not have: {unknown[:4]}")
    with torch.no_grad():
        for k, v in stored.items():
            params[k].copy_(v)


def dequantized(module: torch.nn.Module) -> torch.Tensor:
    """The layer's weight [in, out] as GPTQModel's own code dequantizes it, in float32.

    GPTQ: TorchLinear.dequantize_weight (what its forward multiplies by). AWQ: AwqTorchLinear's
    forward calls packing_utils.dequantize_gemm; it is called here with the fp16 scales widened
    to float32 (exact), so the product is not rounded back to fp16."""
    if hasattr(module, "dequantize_weight"):
        return module.dequantize_weight()
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    return dequantize_gemm(module.qweight, module.qzeros, module.scales.float(), module.bits, module.group_size)


def read(args: argparse.Namespace) -> None:
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from safetensors.torch import save_file

    folder = Path(args.folder)
    work = with_tokenizer(folder, Path(args.result).parent / f".{folder.name}.tok")
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    backend = BACKEND.GPTQ_TORCH if qc["quant_method"] == "gptq" else BACKEND.AWQ_TORCH
    # The torch kernels accept fp16/bf16 models only; load at fp16 (scales are stored fp16), then
    # run the loaded modules in float32 so weights and logits compare with pwbench's float32.
    model = GPTQModel.load(str(work), device="cpu", backend=backend, dtype=torch.float16)
    hf = model.model.to(torch.float32)
    hf.eval()
    restore_full_precision(hf, folder)
    result: dict[str, torch.Tensor] = {}
    kinds = set()
    for name, module in hf.named_modules():
        if isinstance(module, BaseQuantLinear):
            kinds.add(type(module).__name__)
            result[f"weight:{name}"] = dequantized(module).T.float().contiguous()
    with torch.no_grad():
        for j, prompt in enumerate(json.loads(args.prompts)):
            logits = hf(torch.tensor([prompt])).logits[0]
            result[f"logits:{j}"] = logits.float().contiguous()
    save_file(result, args.result, metadata={"kernels": ",".join(sorted(kinds))})
    print(json.dumps({"kernels": sorted(kinds), "layers": sum(k.startswith("weight:") for k in result)}))


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quantize")
    q.add_argument("src")
    q.add_argument("out")
    q.add_argument("--method", choices=("gptq", "awq"), default="gptq")
    q.add_argument("--bits", type=int, default=4)
    q.add_argument("--group-size", type=int, default=32)
    q.add_argument("--asym", action="store_true")
    q.add_argument("--act-order", action="store_true")
    q.add_argument("--calib-samples", type=int, default=8)
    q.add_argument("--calib-len", type=int, default=64)
    q.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("read")
    r.add_argument("folder")
    r.add_argument("result")
    r.add_argument("--prompts", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    {"quantize": quantize, "read": read}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

"""Quantize a full-precision Hugging Face folder into a quantized one: `quantize_folder`.

Loads the folder, quantizes its routed experts (calibrate.py), and writes config.json with the
format's quantization_config, model.safetensors with every expert under the name GPTQModel and
llm-compressor use (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.*`; Mixtral's
`block_sparse_moe.` becomes `mlp.` as in transformers 5), every other tensor as it was (AWQ:
its input scales folded into norm, router and shared expert), the other files (tokenizer,
generation config) and quantize_report.json. All of it goes to a temporary folder renamed into
place at the end, so a failed run leaves no half-written model. Calibration prompts come from
the caller: engines do not read workloads.

gpt-oss experts (fused, gate/up interleaved, with biases) go out per expert like everyone
else's, each projection with its bias copied bit for bit from the source: `experts.E.gate_proj.bias`
(even gate_up columns), `up_proj.bias` (odd ones), `down_proj.bias`; the clamp stays in
config.json. This is llm-compressor's module layout for gpt-oss (LinearExpert, de-interleaved the
same way) without its extra `experts.` level; no tool publishes a packed gpt-oss expert layout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from engines.base import EngineError
from engines.common.device import dtype_name, resolve_device, resolve_dtype
from engines.common.folders import REPORT_FILE
from engines.quant.calibrate import LayerReport, QuantizedModel, QuantizeOptions, check_model, quantize_model
from engines.quant.convert import AWQ_BITS
from engines.quant.hf_format import FORMATS, FolderScheme, quantization_config, rows, write_linear
from engines.quant.qweight import PER_ROW
from engines.runtime.checkpoint import Checkpoint, load_weights, open_checkpoint
from engines.runtime.transfer import TransferLedger

DEFAULT_FORMAT = {"rtn": "gptq", "gptq": "gptq", "awq": "awq"}
REPORT_SCHEMA = 1
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.")
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth)$|model\.safetensors\.index\.json$|config\.json$")
# AWQ: tensors reading the post-attention RMSNorm's output, which take its scale s back.
_NORM = "post_attention_layernorm.weight"
_READS_NORM = ("mlp.gate.weight", "mlp.router.weight", "mlp.shared_expert.gate_proj.weight",
               "mlp.shared_expert.up_proj.weight", "mlp.shared_expert_gate.weight")


def folder_scheme(options: QuantizeOptions, fmt: str | None) -> FolderScheme:
    """The on-disk scheme for these options; errors name what the format cannot hold."""
    fmt = fmt or DEFAULT_FORMAT[options.method]
    if fmt not in FORMATS:
        raise EngineError(f"format {fmt!r} is not supported; supported: {', '.join(FORMATS)}")
    if fmt == "awq" and options.bits not in AWQ_BITS:
        raise EngineError(f"AWQ checkpoints hold {'/'.join(map(str, AWQ_BITS))}-bit weights only, got bits "
                          f"{options.bits}; use --format gptq or compressed-tensors")
    if fmt == "awq" and options.group_size == PER_ROW:
        raise EngineError("AWQ checkpoints here hold group sizes 32/64/128; one group per row (-1) needs --format gptq "
                          "or compressed-tensors")
    if fmt == "awq" and options.act_order:
        raise EngineError("AWQ checkpoints have no act-order g_idx; use --format gptq or compressed-tensors")
    # GPTQ zero points: asymmetric layers go out as gptq_v2 (zero as is), symmetric ones as v1
    # (zero - 1, which every GPTQ reader takes). GPTQModel, which transformers 5 also loads GPTQ
    # folders through, refuses asymmetric v1 unless its meta.quantizer names GPTQModel itself
    # (7.6: "only supported if produced by gptqmodel"), and v1 cannot hold a zero point of 0
    # exactly (it wraps, see convert.to_gptq); v2 has neither problem.
    ckpt_format = "gptq_v2" if fmt == "gptq" and not options.symmetric else "gptq"
    return FolderScheme(fmt, options.bits, options.group_size, options.symmetric, options.act_order, ckpt_format)


def preflight(src: str | Path, out: str | Path, options: QuantizeOptions,
              fmt: str | None) -> tuple[Checkpoint, FolderScheme]:
    """Every check that needs no calibration: the source, the output folder, the format."""
    scheme = folder_scheme(options, fmt)
    if Path(out).expanduser().exists():
        raise EngineError(f"output folder {out} already exists; choose a new --output")
    ckpt = open_checkpoint(src)
    if ckpt.config.quantization:
        raise EngineError(f"{ckpt.path} is already quantized (quant_method "
                          f"{ckpt.config.quantization.get('quant_method')!r}); quantize a full-precision folder")
    cfg = ckpt.config
    check_model(options, cfg)
    if scheme.fmt == "awq" and (cfg.hidden_size % 8 or cfg.moe_intermediate_size % 8):
        raise EngineError("AWQ packs 8 output columns per word: hidden_size and moe_intermediate_size must be "
                          "multiples of 8; use --format gptq or compressed-tensors")
    return ckpt, scheme


def quantize_folder(src: str | Path, out: str | Path, options: QuantizeOptions, prompts: Sequence[Sequence[int]], *,
                    fmt: str | None = None, device: str | None = None, dtype: str | None = None,
                    calibration: Mapping[str, Any] | None = None,
                    progress: Callable[[LayerReport], None] | None = None) -> dict[str, Any]:
    """Write the quantized folder `out` (which must not exist); returns the report it also saves."""
    ckpt, scheme = preflight(src, out, options, fmt)
    out, cfg = Path(out).expanduser(), ckpt.config
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    start = time.perf_counter()
    weights, dense = load_weights(ckpt, dev, dt, TransferLedger(dev))
    result = quantize_model(cfg, weights, dense, prompts, options, progress)
    del weights, dense
    report = {
        "schema_version": REPORT_SCHEMA, "method": options.method, "format": scheme.fmt, "bits": options.bits,
        "group_size": options.group_size, "sym": options.symmetric, "act_order": options.act_order,
        "damp_percent": options.damp_percent, "min_expert_tokens": options.min_expert_tokens,
        "source_model": str(ckpt.path), "device": str(dev), "dtype": dtype_name(dt),
        "calibration": {**(calibration or {}), "prompts": len(prompts), "tokens": result.tokens},
        "quantize_s": round(time.perf_counter() - start, 3),
        "mean_rel_error": _mean([r.rel_error for r in result.layers]),
        "mean_rtn_rel_error": _mean([r.rtn_rel_error for r in result.layers]),
        "layers": [_layer_json(r) for r in result.layers],
    }
    write_quantized(ckpt, result, scheme, out, report)
    return report


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _layer_json(r: LayerReport) -> dict[str, Any]:
    return {"layer": r.layer, "rel_error": r.rel_error, "rtn_rel_error": r.rtn_rel_error, "awq_alpha": r.awq_alpha,
            "experts": [{"expert": e, "routed": n, "added": a} for e, (n, a) in enumerate(zip(r.routed, r.added))]}


def write_quantized(ckpt: Checkpoint, result: QuantizedModel, scheme: FolderScheme, out: Path,
                    report: Mapping[str, Any]) -> None:
    """Write the folder into `.{name}.partial-PID` beside `out`, then rename it to `out`."""
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        tensors = _dense_tensors(ckpt, result)
        tensors.update(_expert_tensors(ckpt, result, scheme))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = dict(ckpt.raw_config)
        modules = [f"mlp.experts.{e}.{p}" for e in range(ckpt.config.num_experts) for p in PROJECTIONS]
        meta = {"quantizer": [f"pwbench:{_version()}"], "method": report["method"]}
        config["quantization_config"] = quantization_config(scheme, modules, meta)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in sorted(ckpt.path.iterdir()):
            if f.is_file() and not _WEIGHT_FILES.fullmatch(f.name) and f.name != REPORT_FILE:
                shutil.copy2(f, tmp / f.name)
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _version() -> str:
    try:
        return metadata.version("pwbench")
    except metadata.PackageNotFoundError:
        return "dev"


def _dense_tensors(ckpt: Checkpoint, result: QuantizedModel) -> dict[str, Tensor]:
    """Every non-expert tensor as stored, under its transformers-5 name; AWQ scales folded in."""
    tensors: dict[str, Tensor] = {}
    folded: dict[int, int] = {}
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, "pt")) for f in set(ckpt.key_files.values())}
        for key, file in sorted(ckpt.key_files.items()):
            m = _EXPERT_KEY.match(key)
            if m and int(m.group(1)) in result.experts:
                continue
            name = key.replace(".block_sparse_moe.", ".mlp.")
            tensors[name] = _fold(name, handles[file].get_tensor(key), result.input_scales, folded)
    short = [i for i in result.input_scales if folded.get(i, 0) < 2]
    if short:  # the norm and the router at least: anything less means a layout we do not know
        raise EngineError(f"AWQ: could not fold the input scale of layer {short[0]} into its norm and router")
    return tensors


def _fold(name: str, t: Tensor, scales: Mapping[int, Tensor], folded: dict[int, int]) -> Tensor:
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m is None or int(m.group(1)) not in scales:
        return t
    i, rest = int(m.group(1)), m.group(2)
    s = scales[i].to("cpu", torch.float32)
    if rest == _NORM:
        t = (t.float() / s).to(t.dtype)
    elif rest in _READS_NORM:
        t = (t.float() * s).to(t.dtype)
    else:
        return t
    folded[i] = folded.get(i, 0) + 1
    return t


def _expert_tensors(ckpt: Checkpoint, result: QuantizedModel, scheme: FolderScheme) -> dict[str, Tensor]:
    inter = ckpt.config.moe_intermediate_size
    tensors: dict[str, Tensor] = {}
    for i, experts in sorted(result.experts.items()):
        for e in range(experts.num_experts):
            gate_up = experts.gate_up.expert(e).to("cpu")
            parts = (rows(gate_up, 0, inter), rows(gate_up, inter, 2 * inter), experts.down.expert(e).to("cpu"))
            for proj, qw in zip(PROJECTIONS, parts):
                for suffix, t in write_linear(qw, scheme).items():
                    tensors[f"model.layers.{i}.mlp.experts.{e}.{proj}.{suffix}"] = t.contiguous()
    if ckpt.config.expert_bias:
        tensors.update(_expert_biases(ckpt, sorted(result.experts)))
    return tensors


def _expert_biases(ckpt: Checkpoint, layers: list[int]) -> dict[str, Tensor]:
    """gpt-oss's expert biases from the source files, bit for bit, split per expert and projection."""
    tensors: dict[str, Tensor] = {}
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, "pt")) for f in set(ckpt.key_files.values())}

        def source(key: str) -> Tensor:
            return handles[ckpt.key_files[key]].get_tensor(key)

        for i in layers:
            p = f"model.layers.{i}.mlp.experts."
            gate_up, down = source(p + "gate_up_proj_bias"), source(p + "down_proj_bias")  # [E, 2I], [E, D]
            for e in range(gate_up.shape[0]):
                for proj, bias in zip(PROJECTIONS, (gate_up[e, 0::2], gate_up[e, 1::2], down[e])):
                    tensors[f"{p}{e}.{proj}.bias"] = bias.contiguous()
    return tensors

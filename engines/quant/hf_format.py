"""Quantized Hugging Face folders: `quantization_config` and per-layer tensor names, both ways.

Reads the scheme a folder declares (GPTQ / AutoAWQ / compressed-tensors, as the real tools
write `quantization_config`) and turns one linear layer's tensors into a QuantizedWeight and
back (the bit layouts themselves are convert.py's). Which layers hold which tensors, and
reading files, is the loader's job (engines/runtime/checkpoint.py) and the writer's (export.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from engines.quant.convert import (
    AWQ_BITS,
    GPTQ_CHECKPOINT_FORMATS,
    from_awq,
    from_compressed_tensors,
    from_gptq,
    to_awq,
    to_compressed_tensors,
    to_gptq,
)
from engines.quant.qweight import PER_ROW, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, QuantFormatError, QuantizedWeight

FORMATS = ("gptq", "awq", "compressed-tensors")
AWQ_VERSIONS = ("gemm",)
CT_FORMATS = ("pack-quantized",)
# Tensors of one quantized linear layer `prefix.NAME`: required, then optional.
REQUIRED = {
    "gptq": ("qweight", "qzeros", "scales"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape"),
}
OPTIONAL = {"gptq": ("g_idx",), "awq": (), "compressed-tensors": ("weight_zero_point", "weight_g_idx")}
# What every format stores scales in on disk (compressed-tensors: the model dtype; we pick fp16
# too, so a folder's numbers do not depend on the format it was written in).
SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class FolderScheme:
    """What a folder's quantization_config says about its quantized layers."""

    fmt: str  # quant_method: gptq | awq | compressed-tensors (| mxfp4, MXFP4_SCHEME)
    bits: int
    group_size: int
    symmetric: bool
    act_order: bool = False
    checkpoint_format: str = "gptq"  # GPTQ only: gptq (v1 zero points) | gptq_v2

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return REQUIRED[self.fmt] + OPTIONAL[self.fmt]


# A gpt-oss MXFP4 folder (quant_method "mxfp4"): experts only, E2M1 codes with one power-of-two
# scale per 32 inputs (engines/runtime/mxfp4.py reads it; none of the tensor names above apply).
MXFP4_SCHEME = FolderScheme("mxfp4", bits=4, group_size=32, symmetric=True)


def _field(qc: Mapping[str, Any], key: str, default: Any) -> Any:
    value = qc.get(key, default)
    return default if value is None else value


def _check_int(value: Any, name: str, supported: tuple[int, ...]) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value not in supported:
        raise QuantFormatError(f"{name} {value!r} is not supported; supported: {', '.join(map(str, supported))}")
    return value


def read_scheme(qc: Mapping[str, Any] | None, source: str) -> FolderScheme:
    """config.json's quantization_config -> FolderScheme; errors name the field and what is supported."""
    if not isinstance(qc, Mapping):
        raise QuantFormatError(f"{source}: quantization_config must be a JSON object")
    method = qc.get("quant_method")
    if method not in FORMATS:
        raise QuantFormatError(f"{source}: quantization_config.quant_method {method!r} is not supported; "
                               f"supported: {', '.join(FORMATS)}")
    where = f"{source}: quantization_config"
    if method == "compressed-tensors":
        return _read_compressed_tensors(qc, where)
    # AutoGPTQ and AutoAWQ default to group size 128 when the key is absent; GPTQ's -1 is per row.
    sizes = SUPPORTED_GROUP_SIZES + ((PER_ROW,) if method == "gptq" else ())
    group_size = _check_int(_field(qc, "group_size", 128), f"{where}.group_size", sizes)
    if method == "awq":
        bits = _check_int(_field(qc, "bits", 4), f"{where}.bits", AWQ_BITS)
        version = str(_field(qc, "version", "gemm")).lower()
        if version not in AWQ_VERSIONS:
            raise QuantFormatError(f"{where}.version {version!r} is not supported; "
                                   f"supported: {', '.join(AWQ_VERSIONS)}")
        if not _field(qc, "zero_point", True):
            raise QuantFormatError(f"{where}.zero_point false is not supported; supported: true (AutoAWQ GEMM)")
        return FolderScheme("awq", bits, group_size, symmetric=False)
    bits = _check_int(_field(qc, "bits", 4), f"{where}.bits", SUPPORTED_BITS)
    fmt = _field(qc, "checkpoint_format", "gptq")
    if fmt not in GPTQ_CHECKPOINT_FORMATS:
        raise QuantFormatError(f"{where}.checkpoint_format {fmt!r} is not supported; "
                               f"supported: {', '.join(GPTQ_CHECKPOINT_FORMATS)}")
    return FolderScheme("gptq", bits, group_size, bool(_field(qc, "sym", True)), bool(_field(qc, "desc_act", False)),
                        fmt)


def _read_compressed_tensors(qc: Mapping[str, Any], where: str) -> FolderScheme:
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise QuantFormatError(f"{where}.config_groups: missing or empty")
    weights = [g.get("weights") if isinstance(g, Mapping) else None for g in groups.values()]
    if any(w != weights[0] for w in weights) or not isinstance(weights[0], Mapping):
        raise QuantFormatError(f"{where}.config_groups: groups with different weight schemes are not supported; "
                               "supported: one weight scheme for every quantized layer")
    w = weights[0]
    fmt = _field(qc, "format", None) or next(iter(groups.values())).get("format")
    if fmt not in CT_FORMATS:
        raise QuantFormatError(f"{where}.format {fmt!r} is not supported; supported: {', '.join(CT_FORMATS)}")
    strategy = _field(w, "strategy", "group")
    if _field(w, "type", "int") != "int" or strategy not in ("group", "channel"):
        raise QuantFormatError(f"{where} weights type {w.get('type')!r} strategy {w.get('strategy')!r} is not "
                               "supported; supported: type int, strategy group or channel")
    bits = _check_int(_field(w, "num_bits", None), f"{where} weights.num_bits", SUPPORTED_BITS)
    group_size = PER_ROW if strategy == "channel" else _check_int(
        _field(w, "group_size", None), f"{where} weights.group_size", SUPPORTED_GROUP_SIZES)
    return FolderScheme("compressed-tensors", bits, group_size, bool(_field(w, "symmetric", True)),
                        _field(w, "actorder", None) is not None)


def read_linear(get: Callable[[str], Tensor | None], scheme: FolderScheme, name: str) -> QuantizedWeight | None:
    """One layer's tensors (`get(suffix)`, None when absent) -> record; None if a required one is missing."""
    t = {suffix: get(suffix) for suffix in scheme.tensor_names}
    if any(t[s] is None for s in REQUIRED[scheme.fmt]):
        return None
    if scheme.fmt == "gptq":
        return from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits=scheme.bits,
                         group_size=scheme.group_size, sym=scheme.symmetric, name=name,
                         checkpoint_format=scheme.checkpoint_format)
    if scheme.fmt == "awq":
        return from_awq(t["qweight"], t["qzeros"], t["scales"], bits=scheme.bits, group_size=scheme.group_size,
                        name=name)
    return from_compressed_tensors(t["weight_packed"], t["weight_scale"], t["weight_shape"], t["weight_zero_point"],
                                   t["weight_g_idx"], bits=scheme.bits, group_size=scheme.group_size,
                                   symmetric=scheme.symmetric, name=name)


def write_linear(qw: QuantizedWeight, scheme: FolderScheme) -> dict[str, Tensor]:
    """record -> {suffix: tensor} as the format's tools write one linear layer (scales in fp16)."""
    if scheme.fmt == "gptq":
        return to_gptq(qw, checkpoint_format=scheme.checkpoint_format, scale_dtype=SCALE_DTYPE)
    if scheme.fmt == "awq":
        return to_awq(qw, scale_dtype=SCALE_DTYPE)
    return to_compressed_tensors(replace(qw, scales=qw.scales.to(SCALE_DTYPE)))


def rows(qw: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """Output rows [start, stop) of one matrix (gate or up out of gate_up); g_idx is per column."""
    if qw.lead:
        raise QuantFormatError(f"rows: expects one matrix, got a stack {list(qw.lead)}")
    zeros = None if qw.zeros is None else qw.zeros[start:stop]
    return replace(qw, qdata=qw.qdata[start:stop], scales=qw.scales[start:stop], zeros=zeros,
                   shape=(stop - start, qw.shape[1]))


def only_experts_dynamic(expert_modules: list[str]) -> dict[str, dict[str, Any]]:
    r"""GPTQModel's `dynamic` rule keeping every module but `expert_modules` full precision.

    GPTQModel (7.6) reads only `dynamic` to find full-precision layers when it loads a folder; it
    ignores modules_in_block_to_quantize and modules_to_not_convert, so without this rule it
    builds quantized modules for attention, routers and shared experts and then finds no
    tensors for them (GPTQ: refuses to load; AWQ: loads them unfilled). One negative rule
    (`-:` skips what it matches): any module whose name does not end in one of `expert_modules`
    with its numbers (expert and layer indices) read as `\d+`. GPTQModel matches it from the
    start of the full module name (PCRE), e.g. for "mlp.experts.0.gate_proj":
    `-:^(?!(?:.*\.)?mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj)$).*`.
    """
    leaves: dict[str, list[str]] = {}  # parent pattern -> leaf names, in first-seen order
    for name in expert_modules:
        parent, _, leaf = name.rpartition(".")
        key = r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in parent.split(".")) if parent else ""
        if leaf not in leaves.setdefault(key, []):
            leaves[key].append(leaf)
    if not leaves:
        raise QuantFormatError("only_experts_dynamic: no expert modules")
    alternatives = [f"{key}\\.(?:{'|'.join(map(re.escape, ls))})" if key else f"(?:{'|'.join(map(re.escape, ls))})"
                    for key, ls in leaves.items()]
    body = alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"
    return {f"-:^(?!(?:.*\\.)?{body}$).*": {}}


def quantization_config(scheme: FolderScheme, expert_modules: list[str], extra: Mapping[str, Any]) -> dict[str, Any]:
    """The quantization_config the format's own tools write, for a folder whose quantized layers
    are `expert_modules` (names inside a decoder layer, e.g. "mlp.experts.0.gate_proj").

    Attention, routers and shared experts stay full precision; each format says so its own way
    (GPTQ: modules_in_block_to_quantize; AWQ: modules_to_not_convert; compressed-tensors: targets),
    and GPTQ and AWQ say it once more as GPTQModel reads it (`dynamic`, see only_experts_dynamic;
    transformers' GPTQConfig / AwqConfig and read_scheme ignore the key).
    `extra` lands where the format keeps tool metadata (GPTQ `meta`; others ignore it).
    """
    if scheme.fmt == "gptq":
        return {
            "quant_method": "gptq", "bits": scheme.bits, "group_size": scheme.group_size, "sym": scheme.symmetric,
            "desc_act": scheme.act_order, "checkpoint_format": scheme.checkpoint_format, "static_groups": False,
            "true_sequential": True, "lm_head": False, "pack_dtype": "int32",
            "modules_in_block_to_quantize": [expert_modules], "dynamic": only_experts_dynamic(expert_modules),
            "meta": dict(extra),
        }
    if scheme.fmt == "awq":
        return {
            "quant_method": "awq", "bits": scheme.bits, "group_size": scheme.group_size, "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": ["self_attn", "mlp.gate", "mlp.router", "shared_expert", "lm_head"],
            "dynamic": only_experts_dynamic(expert_modules),
        }
    per_row = scheme.group_size == PER_ROW
    weights = {"num_bits": scheme.bits, "type": "int", "symmetric": scheme.symmetric,
               "strategy": "channel" if per_row else "group", "group_size": None if per_row else scheme.group_size,
               "actorder": "group" if scheme.act_order else None,
               "dynamic": False, "observer": "minmax", "block_structure": None}
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                                      "weights": weights, "input_activations": None, "output_activations": None,
                                      "format": "pack-quantized"}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None,
    }

"""Engines `static-gptq`, `static-awq`, `static-rtn`: the `moe` runtime with every routed expert
quantized before serving and kept resident on the device (the static-quantization baselines).

Given a quantized folder (GPTQ, AWQ or compressed-tensors) they serve it as stored, refusing
one quantized with another method; a gpt-oss folder with MXFP4 experts (the released format)
is served as stored by any of them, its experts kept in MXFP4 on the device. gpt-oss experts
quantized here keep their biases and the clamped SwiGLU exact. A group_size that does not divide
the expert widths becomes the largest supported one that does, else one group per row (GPTQ's
-1), and the run's notes say so. Given a full-precision folder and `--set bits=N` they
quantize it at start with their method into ~/.cache/pwbench/quantized/<method>-<hash of
model, method, options> ($PWBENCH_CACHE or `cache_dir` move it) and reuse that folder next
time; the engine always serves what was read back from disk, so a first run and a cached run
compute the same. Calibration at start uses seeded random-token prompts (engines do not read
workloads); for workload calibration run `pwbench quantize` and pass its folder.

Under --simulate nothing is quantized or written: the dense weights are shapes on the meta
device and each MoE layer's experts a QuantizedExperts record of meta tensors shaped as
load_quantized_weights would read them back from the folder these options would write (same
method, bits, fitted group_size, the method's default format, sym), so the expert bytes the
simulator counts are the measured engine's. A gpt-oss MXFP4 folder is sized as stored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from engines.base import EngineError
from engines.common import folders
from engines.common.device import dtype_name
from engines.quant.calibrate import QuantizeOptions, check_model, random_prompts
from engines.quant.convert import AWQ_BITS
from engines.quant.export import DEFAULT_FORMAT, PROJECTIONS, REPORT_SCHEMA, folder_scheme, quantize_folder
from engines.quant.hf_format import MXFP4_SCHEME, SCALE_DTYPE, FolderScheme, quantization_config, read_scheme
from engines.quant.load import QuantizedLoad, load_mxfp4_folder, load_quantized_weights, quantized_backend
from engines.quant.qweight import (
    PER_ROW,
    SUPPORTED_GROUP_SIZES,
    QuantizedExperts,
    QuantizedWeight,
    packed_words,
    resolve_group,
)
from engines.runtime.checkpoint import Checkpoint, ExpertLoader, TensorReader, load_model, open_checkpoint
from engines.runtime.config import ModelConfig
from engines.runtime.engine import EngineParts, Loaded, Opened, RuntimeConfig, RuntimeEngine, resident_parts
from engines.runtime.mxfp4 import is_mxfp4


@dataclass(frozen=True)
class StaticQuantConfig(RuntimeConfig):
    """The runtime's options plus how to quantize a full-precision folder at start (ignored, or checked
    against the folder, when the folder is already quantized)."""

    bits: int | None = None  # None: the model folder must be quantized already
    group_size: int = 128
    sym: bool = False
    act_order: bool = False  # static-gptq only
    damp_percent: float = 0.01  # static-gptq only
    calib_samples: int = 64  # random-token calibration prompts ...
    calib_len: int = 512  # ... of this many tokens (capped by the model's length)
    calib_seed: int = 0
    cache_dir: str | None = None  # None: $PWBENCH_CACHE/quantized or ~/.cache/pwbench/quantized


class StaticQuantEngine(RuntimeEngine):
    method: ClassVar[str]
    config_cls = StaticQuantConfig
    simulates = True

    def load(self, cfg: StaticQuantConfig) -> Loaded:
        """The quantized folder (given, or quantized now from a full-precision one and cached)."""
        opened = self.open(cfg)
        source, device, dtype, ledger = opened
        self.device, self.dtype = device, dtype
        self.group_note: str | None = None
        self.sim_note: str | None = None
        if self.simulation is not None:
            return self._simulated_load(opened)
        folder, self.quantized_at_start = self._quantized_folder(source)
        checkpoint = open_checkpoint(folder)
        if is_mxfp4(checkpoint.config):
            self.quantized: QuantizedLoad = load_mxfp4_folder(checkpoint, device, dtype, ledger)
        else:
            self._check_method(checkpoint)
            self.quantized = load_quantized_weights(checkpoint, device, dtype, ledger)
        return Loaded(checkpoint, self.quantized.weights, device, dtype, ledger,
                      backend=quantized_backend(self.quantized.experts), source=source)

    def build(self, cfg: StaticQuantConfig, loaded: Loaded) -> EngineParts:
        s = self.quantized.scheme
        parts = resident_parts(cfg, loaded, loaded.backend)
        parts.notes += [note for note in (self.group_note, self.sim_note) if note]
        # Non-expert layers stored quantized run dequantized at the model dtype.
        parts.info_config = {"quantization": {
            "method": self.method, "format": s.fmt, "bits": s.bits, "group_size": s.group_size, "sym": s.symmetric,
            "act_order": s.act_order, "folder": None if self.simulation is not None else str(loaded.checkpoint.path),
            "quantized_at_start": self.quantized_at_start, "dequantized_at_load": list(self.quantized.dequantized),
        }}
        return parts

    # -- simulated (--simulate): what a quantized load would hold, as meta tensors ---------------
    def _simulated_load(self, opened: Opened) -> Loaded:
        """Dense weights and packed experts sized as the folder this start would serve, without
        quantizing or writing one (the model folder may hold only config.json)."""
        source, device, dtype, ledger = opened
        self.quantized_at_start = False
        if is_mxfp4(source.config):
            self._given_scheme(source)  # refuses --set bits, as a measured start does
            self.quantized = load_mxfp4_folder(source, device, dtype, ledger)
        else:
            if source.config.quantization:
                scheme = self._given_scheme(source)
                self._check_method(source)
            else:
                options, fmt = self._quantize_options(source)
                check_model(options, source.config)
                scheme = stored_scheme(folder_scheme(options, fmt), source.config)
            weights, experts = load_model(source, device, dtype, ledger, _meta_experts_loader(scheme))
            self.quantized = QuantizedLoad(weights, experts, scheme, ())
        what = "as stored" if source.config.quantization else f"as a {self.method}-quantized folder would hold them"
        s = self.quantized.scheme
        self.sim_note = (f"simulated: routed experts sized {what} ({s.fmt}, bits {s.bits}, group_size {s.group_size}, "
                         f"sym {s.symmetric}); nothing was quantized or written")
        return Loaded(source, self.quantized.weights, device, dtype, ledger,
                      backend=quantized_backend(self.quantized.experts), source=source)

    # -- which folder to serve -------------------------------------------------------------------
    def _given_scheme(self, src: Checkpoint) -> FolderScheme:
        """The scheme of an already-quantized folder, refusing --set bits/group_size that differ."""
        cfg = self.config
        mxfp4 = is_mxfp4(src.config)
        scheme = MXFP4_SCHEME if mxfp4 else read_scheme(src.config.quantization, str(src.path / "config.json"))
        if mxfp4 and cfg.bits is not None:
            raise EngineError(f"{src.path} holds MXFP4 experts, served as stored; --set bits applies to "
                              "full-precision folders only (drop it)")
        if cfg.bits is not None and (cfg.bits, cfg.group_size) != (scheme.bits, scheme.group_size):
            raise EngineError(
                f"{src.path} is already quantized ({scheme.fmt}, bits {scheme.bits}, group_size "
                f"{scheme.group_size}); --set bits/group_size apply to full-precision folders only"
            )
        return scheme

    def _quantize_options(self, src: Checkpoint) -> tuple[QuantizeOptions, str]:
        """How a full-precision folder is quantized at start: the options (group size fitted to
        the expert widths, noted when changed) and the on-disk format."""
        cfg = self.config
        if cfg.bits is None:
            raise EngineError(
                f"engine {self.name} needs a quantized model folder (quantization_config in config.json) or "
                f"--set bits=N (2, 3, 4 or 8) to quantize the full-precision folder {src.path} at start"
            )
        group_size, self.group_note = fit_group_size(cfg.group_size, (src.config.hidden_size,
                                                                      src.config.moe_intermediate_size))
        options = QuantizeOptions(self.method, cfg.bits, group_size, cfg.sym, cfg.act_order, cfg.damp_percent)
        return options, self._cache_format(src, options)

    def _quantized_folder(self, src: Checkpoint) -> tuple[Path, bool]:
        """(folder to load, whether it was quantized by this start)."""
        cfg = self.config
        if src.config.quantization:
            self._given_scheme(src)
            return src.path, False
        options, fmt = self._quantize_options(src)
        folder = self._cache_root() / f"{self.method}-{self._cache_key(src, options, fmt)}"
        if (folder / "config.json").is_file():
            return folder, False
        mc = src.config
        length = min(cfg.calib_len, mc.max_position_embeddings)
        prompts = random_prompts(mc.vocab_size, cfg.calib_samples, length, cfg.calib_seed, mc.eos_token_ids)
        calibration = {"source": "random tokens", "samples": cfg.calib_samples, "length": length,
                       "seed": cfg.calib_seed}
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            quantize_folder(src.path, folder, options, prompts, fmt=fmt, device=str(self.device),
                            dtype=dtype_name(self.dtype), calibration=calibration)
        except OSError:
            if not (folder / "config.json").is_file():  # not a concurrent start that won the rename
                raise
        return folder, True

    def _cache_format(self, src: Checkpoint, options: QuantizeOptions) -> str:
        """The method's own format where it can hold these weights, else GPTQ's."""
        fmt = DEFAULT_FORMAT[self.method]
        mc = src.config
        if fmt == "awq" and (options.bits not in AWQ_BITS or mc.hidden_size % 8 or mc.moe_intermediate_size % 8
                             or options.group_size == PER_ROW):
            return "gptq"
        return fmt

    def _cache_root(self) -> Path:
        if self.config.cache_dir:
            return Path(self.config.cache_dir).expanduser()
        return folders.cache_dir("quantized")

    def _cache_key(self, src: Checkpoint, options: QuantizeOptions, fmt: str) -> str:
        """Hash of the source folder (config and weight files by name, size, mtime), the method and
        every option that changes the result, including the device type and dtype calibrated in."""
        cfg = self.config
        files = sorted({*src.key_files.values(), src.path / "config.json"})
        stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        payload = {
            "schema": REPORT_SCHEMA, "source": str(src.path.resolve()), "files": stamp,
            "options": dataclasses.asdict(options), "format": fmt, "device": self.device.type,
            "dtype": dtype_name(self.dtype), "calib": [cfg.calib_samples, cfg.calib_len, cfg.calib_seed],
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def _check_method(self, ckpt: Checkpoint) -> None:
        method = folders.folder_method(ckpt.path)
        if method is not None and method != self.method:
            raise EngineError(
                f"{ckpt.path} holds {method}-quantized weights; engine {self.name} serves {self.method} "
                f"weights: use --engine static-{method}"
            )


def fit_group_size(requested: int, widths: tuple[int, int]) -> tuple[int, str | None]:
    """The group size for experts whose input widths are `widths` (D, I) and a note when it is not
    `requested`: the largest supported size dividing both, else one group per row (PER_ROW)."""
    if requested not in SUPPORTED_GROUP_SIZES:
        raise EngineError(f"group_size must be one of {', '.join(map(str, SUPPORTED_GROUP_SIZES))}, got {requested}")
    if all(w % requested == 0 for w in widths):
        return requested, None
    what = f"group_size {requested} does not divide the expert widths {widths[0]}/{widths[1]}"
    fits = [g for g in sorted(SUPPORTED_GROUP_SIZES, reverse=True) if all(w % g == 0 for w in widths)]
    if fits:
        return fits[0], f"{what}: experts quantized with group_size {fits[0]}"
    return PER_ROW, f"{what}, nor does any supported size: experts quantized with one group per row (-1)"


def stored_scheme(scheme: FolderScheme, mc: ModelConfig) -> FolderScheme:
    """The scheme a folder written with `scheme` declares when read back: through the same
    quantization_config writer and reader as a real folder (AWQ reads back asymmetric, GPTQ's
    checkpoint_format follows sym)."""
    modules = [f"mlp.experts.{e}.{p}" for e in range(mc.num_experts) for p in PROJECTIONS]
    return read_scheme(quantization_config(scheme, modules, {}), "simulated quantization_config")


def meta_quantized_weight(scheme: FolderScheme, experts: int, out: int, inp: int) -> QuantizedWeight:
    """E stacked [out, inp] matrices as load_quantized_weights holds them for `scheme`, as meta
    tensors: int32 codes, scales at the stored SCALE_DTYPE, packed int32 zero codes unless
    symmetric, an int32 g_idx per input column with act-order (GPTQ drops a g_idx that is the
    plain k // group_size order, which one group per row always is)."""
    group = resolve_group(scheme.group_size, inp)
    groups, meta = inp // group, torch.device("meta")
    qdata = torch.empty(experts, out, inp * scheme.bits // 32, dtype=torch.int32, device=meta)
    scales = torch.empty(experts, out, groups, dtype=SCALE_DTYPE, device=meta)
    zeros = None if scheme.symmetric else torch.empty(experts, out, packed_words(groups, scheme.bits),
                                                      dtype=torch.int32, device=meta)
    g_idx = torch.empty(experts, inp, dtype=torch.int32, device=meta) if scheme.act_order and groups > 1 else None
    return QuantizedWeight(qdata, scales, zeros, scheme.bits, group, scheme.symmetric, (out, inp), g_idx)


def _meta_experts_loader(scheme: FolderScheme) -> ExpertLoader:
    """load_model's expert loader for a simulated run: each MoE layer's experts as a meta
    QuantizedExperts (gate and up fused row-wise; gpt-oss biases at the model dtype)."""

    def load(reader: TensorReader, cfg: ModelConfig, prefix: str) -> QuantizedExperts:
        E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        gate_up, down = meta_quantized_weight(scheme, E, 2 * I, D), meta_quantized_weight(scheme, E, D, I)
        if not cfg.expert_bias:
            return QuantizedExperts(gate_up, down)
        meta = torch.device("meta")
        return QuantizedExperts(gate_up, down, torch.empty(E, 2 * I, dtype=reader.dtype, device=meta),
                                torch.empty(E, D, dtype=reader.dtype, device=meta), cfg.swiglu_clamp)

    return load


class StaticGPTQEngine(StaticQuantEngine):
    name = "static-gptq"
    method = "gptq"


class StaticAWQEngine(StaticQuantEngine):
    name = "static-awq"
    method = "awq"


class StaticRTNEngine(StaticQuantEngine):
    name = "static-rtn"
    method = "rtn"

"""Hardware profiles for `--simulate`: datasheet peaks and efficiency curves, as data.

A profile is a TOML file (built-ins in engines/sim/profiles/, one per GPU; `pwbench hw list`
shows them). A user's file has the same schema, may start from a built-in with
`inherit = "h100-sxm"` and override any field; `overrides` (a flat mapping such as
{"memory_bytes_per_s": 3e12, "efficiency.gemm": [[1, 0.3], [512, 0.8]]}) applies last. Every
number names its source in `sources` (or in its curve's `source`); estimates say so.

What each efficiency curve is a fraction of (its `basis`), over the size named:

    gemm              rows (tokens) of a dense GEMM    achieved / roofline bound, where the bound is
    grouped_gemm      rows per expert                  min(FLOP peak, FLOPs per weight byte x HBM)
    attention_decode  context tokens per sequence      fraction of memory_bytes_per_s reading K and V
    attention_prefill chunk tokens                     fraction of the FLOP peak
    dequant_gemm_B    rows (B = 2, 3, 4, 8 bits)       fraction of memory_bytes_per_s reading packed weights
    copy              bytes per transfer               fraction of link_pinned_bytes_per_s
    copy_overlap      bytes per transfer               share of copy speed kept while compute runs beside it
    elementwise       tokens per step                  fraction of memory_bytes_per_s (optional: the cost
                                                       model takes 1.0 without it)
    sample            rows sampled                     fraction of memory_bytes_per_s (optional, as above)
    head              rows of the LM head's GEMM       as gemm (optional: the cost model reads gemm without it)
    attention_prefill_context  chunk tokens            as attention_prefill, for a chunk after context (the
                                                       masked rectangle; optional: attention_prefill without it)
    grouped_gemm_dequantized  rows per expert          fraction of the FLOP peak, for an RTN expert's GEMMs right
                                                       after the CPU reference dequantized it (its weights in the
                                                       caches: no memory term; optional: grouped_gemm without it)

`gemm@K`, `grouped_gemm@K`, `head@K`, `attention_decode@K`, `attention_prefill@K`, `attention_prefill_context@K`,
`dequant_cpu_packed@K`, `grouped_gemm_dequantized@K` (optional): the same curves measured
on one model's shapes (K: engines/sim/cost.py `shape_key`, e.g. "d512-h8-q512-kv128-i768-v32000-b4";
`pwbench hw calibrate --model DIR` fits them); the cost model reads them for a model of that shape
instead of the generic ones. A profile may carry them for several models.

`shared_processor` (optional, default: the profile is named "cpu") says host and device are one
processor: copies are memcpys on the compute cores and never overlap compute.

No torch here: `pwbench hw list` and the cost model read profiles without it.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engines.common.peaks import cached_peaks, cpu_model, names_device
from engines.sim.calibrate import best_flops, cpu_rates, fit_cpu_curves
from engines.sim.cost import SHAPED

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"

EFFICIENCY_KEYS: dict[str, tuple[str, str]] = {  # key -> (what the size is, what the efficiency is a fraction of)
    "gemm": ("rows", "roofline"),
    "grouped_gemm": ("rows per expert", "roofline"),
    "attention_decode": ("context tokens", "memory_bytes_per_s"),
    "attention_prefill": ("chunk tokens", "flops_per_s"),
    # a chunk after context (the runtime's masked SDPA over the whole rectangle; optional: the cost
    # model reads attention_prefill without it)
    "attention_prefill_context": ("chunk tokens", "flops_per_s"),
    "dequant_gemm_2": ("rows", "memory_bytes_per_s"),
    "dequant_gemm_3": ("rows", "memory_bytes_per_s"),
    "dequant_gemm_4": ("rows", "memory_bytes_per_s"),
    "dequant_gemm_8": ("rows", "memory_bytes_per_s"),
    "copy": ("bytes per transfer", "link_pinned_bytes_per_s"),
    "copy_overlap": ("bytes per transfer", "kept"),
    "elementwise": ("tokens per step", "memory_bytes_per_s"),
    "sample": ("rows", "memory_bytes_per_s"),
    "head": ("rows", "roofline"),  # the LM head's GEMM (optional: the cost model reads gemm without it)
    # an RTN expert's GEMMs right after the CPU reference dequantized it (optional: grouped_gemm without it):
    # its weights come from the caches, faster than memory_bytes_per_s, so a fraction of the FLOP peak
    "grouped_gemm_dequantized": ("rows per expert", "flops_per_s"),
    # the CPU reference's dequantization (shared processor): full-width weight bytes written per
    # second, as a fraction of memory_bytes_per_s, by bit width; per storage scheme
    "dequant_cpu_packed": ("bits", "memory_bytes_per_s"),
    "dequant_cpu_bitplanes": ("bits", "memory_bytes_per_s"),
    # pagedweight's planes dequantized for a layer's experts of one width (2, 3, 4, 8 bits) in one
    # stacked call, by the group's full-width bytes (harness/hw.py `measure_cpu_group_dequant`)
    **{f"dequant_group_bitplanes_{b}": ("full-width bytes in the group", "memory_bytes_per_s") for b in (2, 3, 4, 8)},
}
# The cost model states 1.0 where a profile has no elementwise or sample curve, and prices the
# CPU reference's dequantization by its older count where it has no dequant_cpu_* curve (by
# dequant_cpu_* where it has no dequant_group_* curve).
OPTIONAL_CURVES = frozenset({"elementwise", "sample", "dequant_cpu_packed", "dequant_cpu_bitplanes", "head",
                             "attention_prefill_context", "grouped_gemm_dequantized",
                             *(k for k in EFFICIENCY_KEYS if k.startswith("dequant_group_"))})
# A curve measured on one model's shapes is stored as `name@key` (engines/sim/cost.py `shape_key`);
# only the names the cost model reads that way (engines/sim/cost.py SHAPED) take one.
SHAPED_CURVES = SHAPED


def curve_base(key: str) -> str:
    """The curve name of an efficiency key: "gemm" for "gemm@d512-...", the key itself otherwise."""
    base, at, suffix = key.partition("@")
    return base if at and suffix and base in SHAPED_CURVES else key
REQUIRED_CURVES = tuple(k for k in EFFICIENCY_KEYS if k not in OPTIONAL_CURVES)
_FLOATS = ("memory_bytes_per_s", "link_bytes_per_s", "link_pinned_bytes_per_s", "host_memory_bytes_per_s",
           "host_flops_per_s", "step_overhead_s", "op_overhead_s", "decode_sequence_overhead_s",
           "prefill_element_overhead_s", "prefill_segment_overhead_s", "prefill_step_overhead_s")
_INTS = ("memory_bytes", "host_memory_bytes")
_STRS = ("name", "description", "default_dtype")
_BOOLS = ("shared_processor",)
# An engine's parts' host time beyond this runtime's priced path, per layer and per layer-token, by key
# (engines/sim/cost.py `executor_overhead_s`); and a model's own prefill rates, by its shape key
# (engines/sim/cost.py `prefill_overhead_rates`): the cpu profile's from `pwbench hw calibrate`.
MODEL_PREFILL_TABLES = ("model_prefill_element_overhead_s", "model_prefill_segment_overhead_s",
                        "model_prefill_step_overhead_s")
OVERHEAD_TABLES = ("executor_overhead_s", "executor_token_overhead_s", *MODEL_PREFILL_TABLES)
_TABLES = ("flops_per_s", "efficiency", "sources", *OVERHEAD_TABLES)
_FIELDS = (*_STRS, *_INTS, *_FLOATS, *_BOOLS, *_TABLES)
_OPTIONAL_FIELDS = ("op_overhead_s", "shared_processor", "decode_sequence_overhead_s", "prefill_element_overhead_s",
                    "prefill_segment_overhead_s", "prefill_step_overhead_s", *OVERHEAD_TABLES)
_ZERO_OK = ("op_overhead_s", "step_overhead_s", "decode_sequence_overhead_s", "prefill_element_overhead_s",
            "prefill_segment_overhead_s", "prefill_step_overhead_s")


@dataclass(frozen=True)
class Curve:
    """Efficiency (0..1] of a peak as a function of one size: linear in log(size) between
    points, flat beyond the first and the last."""

    points: tuple[tuple[float, float], ...]  # (size, efficiency), sizes increasing
    source: str  # where the numbers come from (paper/datasheet/measurement + command, or "estimate: why")
    basis: str = ""  # what the efficiency is a fraction of (EFFICIENCY_KEYS); added to the design's fields

    def at(self, size: float) -> float:
        pts = self.points
        if size <= pts[0][0]:
            return pts[0][1]
        if size >= pts[-1][0]:
            return pts[-1][1]
        for (s0, e0), (s1, e1) in zip(pts, pts[1:]):
            if size <= s1:
                t = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
                return e0 + t * (e1 - e0)
        return pts[-1][1]  # unreachable: size < pts[-1][0] here


@dataclass(frozen=True)
class HardwareProfile:
    name: str  # "h100-sxm"
    description: str  # "NVIDIA H100 SXM5 80 GB"
    memory_bytes: int  # device memory
    memory_bytes_per_s: float  # HBM (datasheet peak)
    flops_per_s: dict[str, float]  # dense tensor FLOP/s by dtype
    link_bytes_per_s: float  # host->device, datasheet (per direction)
    link_pinned_bytes_per_s: float  # measured pinned rate (published measurement, source named)
    host_memory_bytes: int
    host_memory_bytes_per_s: float
    host_flops_per_s: float
    step_overhead_s: float  # per-step launch/scheduling overhead
    efficiency: dict[str, Curve]
    sources: dict[str, str]  # field -> source
    default_dtype: str  # "bfloat16" on GPUs, "float32" for cpu
    op_overhead_s: float = 0.0  # per kernel/op dispatch (added to the design's fields)
    # The runtime's time per decode sequence and layer beyond its counted calls (the small kernels around
    # the priced modules grow with their rows), added: `pwbench hw calibrate` fits it with op_overhead_s.
    decode_sequence_overhead_s: float = 0.0
    # The model code's time per prefill activation element (token x hidden), per prefill segment (one
    # sequence's chunk) and per step that prefills, per layer, beyond the priced modules (added):
    # `pwbench hw calibrate` fits the three.
    prefill_element_overhead_s: float = 0.0
    prefill_segment_overhead_s: float = 0.0
    prefill_step_overhead_s: float = 0.0
    # An engine's parts' host time beyond the priced path (pagedweight's backend, offload's cache, moegen's
    # layer-major loop), per layer and per layer-token, by key (added): `pwbench hw calibrate` fits them.
    executor_overhead_s: dict[str, float] = field(default_factory=dict)
    executor_token_overhead_s: dict[str, float] = field(default_factory=dict)
    # The three prefill rates above fitted on one model's own checkpoint, by its shape key
    # (engines/sim/cost.py `shape_key`): a model of that shape takes these instead (added).
    model_prefill_element_overhead_s: dict[str, float] = field(default_factory=dict)
    model_prefill_segment_overhead_s: dict[str, float] = field(default_factory=dict)
    model_prefill_step_overhead_s: dict[str, float] = field(default_factory=dict)
    origin: str = ""  # the file (or "cpu: ...") it was read from (added)
    # host and device are one processor (copies are memcpys on the compute cores); None: the
    # profile is named "cpu" (`shared` below is the one rule). Added.
    shared_processor: bool | None = None

    @property
    def shared(self) -> bool:
        """Host and device are one processor (copies add, never overlap); unsaid: a profile named cpu."""
        return self.shared_processor if self.shared_processor is not None else self.name == "cpu"

    def flops(self, dtype: str | None = None) -> float:
        """Dense FLOP/s at `dtype` (default_dtype when None); ValueError naming the known ones."""
        dtype = dtype or self.default_dtype
        if dtype not in self.flops_per_s:
            raise ValueError(f"profile {self.name!r} has no flops_per_s for {dtype!r}; "
                             f"it has: {', '.join(sorted(self.flops_per_s))}")
        return self.flops_per_s[dtype]


# ---------------------------------------------------------------------------------------------
# reading


def _bad(where: str, field: str, problem: str, fix: str) -> ValueError:
    return ValueError(f"{where}: field {field!r} {problem}; {fix}")


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read hardware profile {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML ({exc}); fix the syntax") from None


def _builtin_path(name: str) -> Path | None:
    path = PROFILES_DIR / f"{name}.toml"
    return path if path.is_file() else None


def builtin_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


# The built-in profile of a GPU by the name CUDA reports ("NVIDIA H200", "NVIDIA H100 80GB HBM3",
# "NVIDIA A100-SXM4-80GB"): a key matches as a whole word, the first match wins (PCIe before SXM).
_GPU_PROFILES = (("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("A100", "a100-80gb"),
                 ("L40S", "l40s"), ("L4", "l4"), ("A10G", "a10g"), ("RTX 6000 Ada", "rtx-6000-ada"),
                 ("T4", "t4"), ("A5000", "a5000"))


def profile_for_device(device_name: str) -> str | None:
    """The built-in profile's name for a GPU named `device_name` (torch.cuda.get_device_name), or None."""
    return next((name for key, name in _GPU_PROFILES if names_device(key, device_name)), None)


def _locate(name_or_path: str, where: str = "") -> tuple[Path, str]:
    """(file, label) for a built-in name or a path; ValueError naming the built-ins."""
    builtin = _builtin_path(name_or_path)
    if builtin is not None and not Path(name_or_path).expanduser().is_file():
        return builtin, str(builtin)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path, str(path)
    prefix = f"{where}: " if where else ""
    raise ValueError(f"{prefix}unknown hardware profile {name_or_path!r}: not a file and not one of "
                     f"{', '.join(builtin_names())} (see `pwbench hw list`)")


def _merged(path: Path, label: str, seen: tuple[str, ...] = ()) -> tuple[dict[str, Any], str]:
    """The raw table of `path` with its `inherit` chain applied (tables merge key by key)."""
    raw = _read_toml(path)
    unknown = sorted(set(raw) - set(_FIELDS) - {"inherit"})
    if unknown:
        raise _bad(label, unknown[0], "is not a profile field",
                   f"use one of: inherit, {', '.join(_FIELDS)}")
    parent = raw.pop("inherit", None)
    if parent is None:
        return raw, label
    if not isinstance(parent, str):
        raise _bad(label, "inherit", f"must be a profile name or path, got {parent!r}",
                   'write e.g. inherit = "h100-sxm"')
    if parent == "cpu":  # this machine's profile, measured where `pwbench hw` has run
        base = _profile_table(cpu_profile())
    else:
        relative = path.parent / Path(parent).expanduser()  # a path is read beside the file naming it
        ppath, plabel = _locate(parent if _builtin_path(parent) or not relative.is_file() else str(relative),
                                f"{label}: field 'inherit'")
        if str(ppath.resolve()) in seen or ppath.resolve() == path.resolve():
            raise _bad(label, "inherit", f"forms a cycle through {ppath}",
                       "inherit from a profile that does not inherit back")
        base, _ = _merged(ppath, plabel, (*seen, str(path.resolve())))
    merged = dict(base)
    for key, value in raw.items():
        if key in _TABLES and isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = {**base[key], **value}
        else:
            merged[key] = value
    return merged, label


def _profile_table(p: HardwareProfile) -> dict[str, Any]:
    table: dict[str, Any] = {f: getattr(p, f) for f in (*_STRS, *_INTS, *_FLOATS)}
    if p.shared_processor is not None:
        table["shared_processor"] = p.shared_processor
    table["flops_per_s"] = dict(p.flops_per_s)
    for f in OVERHEAD_TABLES:
        if getattr(p, f):
            table[f] = dict(getattr(p, f))
    table["sources"] = dict(p.sources)
    table["efficiency"] = {k: {"points": [list(pt) for pt in c.points], "source": c.source}
                           for k, c in p.efficiency.items()}
    return table


def _number(where: str, field: str, value: Any, integer: bool = False, zero: bool = False) -> float:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > 0 or (zero and value == 0)))
    if not ok:
        kind = "a positive integer" if integer else ("a number >= 0" if zero else "a positive number")
        raise _bad(where, field, f"must be {kind}, got {value!r}", f"write e.g. {field} = 1.5e12")
    if integer:
        if isinstance(value, float) and value != int(value):
            raise _bad(where, field, f"must be a whole number of bytes, got {value!r}", f"write e.g. {field} = 80e9")
        return int(value)
    return float(value)


def _curve(where: str, key: str, value: Any) -> Curve:
    field = f"efficiency.{key}"
    key = curve_base(key)
    if key not in EFFICIENCY_KEYS:
        raise _bad(where, field, "is not an efficiency curve",
                   f"use one of: {', '.join(EFFICIENCY_KEYS)} (or {', '.join(SHAPED_CURVES)} with @SHAPE_KEY: one "
                   "model's shapes, as `pwbench hw calibrate --model` writes them)")
    if isinstance(value, Curve):
        return replace(value, basis=EFFICIENCY_KEYS[key][1])
    if isinstance(value, (list, tuple)):
        value = {"points": value}
    if not isinstance(value, dict):
        raise _bad(where, field, "must be a table with points and source",
                   f'write [{field}] points = [[1, 0.3], [512, 0.8]] source = "..."')
    extra = sorted(set(value) - {"points", "source", "basis"})
    if extra:
        raise _bad(where, f"{field}.{extra[0]}", "is not a curve field", "use points and source")
    points = value.get("points")
    fix = f"write {field}.points = [[size, efficiency], ...] with sizes increasing and efficiencies in (0, 1]"
    if not isinstance(points, (list, tuple)) or not points:
        raise _bad(where, f"{field}.points", f"must be a non-empty list of [size, efficiency], got {points!r}", fix)
    pts: list[tuple[float, float]] = []
    for pt in points:
        if (not isinstance(pt, (list, tuple)) or len(pt) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in pt)):
            raise _bad(where, f"{field}.points", f"has {pt!r}, not a [size, efficiency] pair of numbers", fix)
        size, eff = float(pt[0]), float(pt[1])
        if size <= 0 or not 0 < eff <= 1 or (pts and size <= pts[-1][0]):
            raise _bad(where, f"{field}.points", f"has {list(pt)!r}: sizes must be > 0 and increasing, "
                       "efficiencies in (0, 1]", fix)
        pts.append((size, eff))
    source = value.get("source")
    if not isinstance(source, str) or not source.strip():
        raise _bad(where, f"{field}.source", "is missing or empty",
                   f'name where the numbers come from: {field}.source = "..."')
    return Curve(tuple(pts), source, EFFICIENCY_KEYS[key][1])


def _build(table: Mapping[str, Any], where: str) -> HardwareProfile:
    missing = [f for f in _FIELDS if f not in table and f not in _OPTIONAL_FIELDS]
    if missing:
        raise _bad(where, missing[0], "is missing", "add it, or inherit from a built-in (inherit = \"h100-sxm\")")
    kw: dict[str, Any] = {}
    for f in _STRS:
        if not isinstance(table[f], str) or not table[f]:
            raise _bad(where, f, f"must be a non-empty string, got {table[f]!r}", f'write {f} = "..."')
        kw[f] = table[f]
    for f in _INTS:
        kw[f] = _number(where, f, table[f], integer=True)
    for f in _FLOATS:
        if f in table:
            kw[f] = _number(where, f, table[f], zero=f in _ZERO_OK)
    shared = table.get("shared_processor", kw["name"] == "cpu")  # unsaid: a profile named cpu is one processor
    if not isinstance(shared, bool):
        raise _bad(where, "shared_processor", f"must be true or false, got {shared!r}",
                   "write shared_processor = true (host and device are one processor) or false")
    kw["shared_processor"] = shared
    flops = table["flops_per_s"]
    if not isinstance(flops, dict) or not flops:
        raise _bad(where, "flops_per_s", "must be a table of dtype = FLOP/s", "write [flops_per_s] bfloat16 = 989e12")
    kw["flops_per_s"] = {str(k): _number(where, f"flops_per_s.{k}", v) for k, v in flops.items()}
    if kw["default_dtype"] not in kw["flops_per_s"]:
        raise _bad(where, "default_dtype", f"is {kw['default_dtype']!r}, which flops_per_s does not list",
                   f"use one of: {', '.join(kw['flops_per_s'])}")
    eff = table["efficiency"]
    if not isinstance(eff, dict):
        raise _bad(where, "efficiency", "must be a table of curves",
                   "write [efficiency.gemm] points = ... source = ...")
    kw["efficiency"] = {k: _curve(where, k, v) for k, v in eff.items()}
    absent = [k for k in REQUIRED_CURVES if k not in kw["efficiency"]]
    if absent:
        raise _bad(where, f"efficiency.{absent[0]}", "is missing", "add the curve, or inherit it from a built-in")
    for f in OVERHEAD_TABLES:
        given = table.get(f, {})
        if not isinstance(given, dict):
            raise _bad(where, f, "must be a table of key = seconds", f"write [{f}] pagedweight = 1e-4")
        kw[f] = {str(k): _number(where, f"{f}.{k}", v, zero=True) for k, v in given.items()}
    sources = table["sources"]
    if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
        raise _bad(where, "sources", "must be a table of field = \"source\"",
                   'write [sources] memory_bytes_per_s = "..."')
    kw["sources"] = dict(sources)
    return HardwareProfile(**kw, origin=where)


def _apply_overrides(table: dict[str, Any], overrides: Mapping[str, Any], where: str) -> dict[str, Any]:
    table = {k: (dict(v) if isinstance(v, dict) else v) for k, v in table.items()}
    table.setdefault("sources", {})
    for key, value in overrides.items():
        head, _, rest = str(key).partition(".")
        if head not in _FIELDS or (rest and head not in _TABLES) or (head in _TABLES and not rest):
            raise _bad(where, str(key), "is not an overridable field",
                       f"use one of {', '.join((*_STRS, *_INTS, *_FLOATS, *_BOOLS))}, or flops_per_s.DTYPE, "
                       "efficiency.KEY, sources.FIELD, " + ", ".join(f"{t}.KEY" for t in OVERHEAD_TABLES))
        if not rest:
            table[head] = value
            table["sources"][head] = "given (override)"
        elif head == "efficiency":
            if isinstance(value, (list, tuple)):
                value = {"points": value, "source": "given (override)"}
            table["efficiency"][rest] = value
        else:
            table.setdefault(head, {})[rest] = value
            if head == "flops_per_s":
                table["sources"][key] = "given (override)"
    return table


def load_profile(name_or_path: str, overrides: Mapping[str, Any] | None = None) -> HardwareProfile:
    """A built-in profile by name (`pwbench hw list`), "cpu" (this machine), or a user's TOML file;
    `overrides` apply last. Unknown name or bad field -> ValueError with one line naming the file,
    the field and the fix."""
    if name_or_path == "cpu" and not Path("cpu").is_file():
        base = cpu_profile()
        if not overrides:
            return base
        return _build(_apply_overrides(_profile_table(base), overrides, base.origin + " + overrides"),
                      base.origin + " + overrides")
    path, label = _locate(name_or_path)
    table, _ = _merged(path, label)
    where = label
    if overrides:
        where = f"{label} + overrides"
        table = _apply_overrides(table, overrides, where)
    return _build(table, where)


def list_profiles() -> list[HardwareProfile]:
    """Every built-in profile, this machine's (cpu) included, by name."""
    return [load_profile(name) for name in builtin_names()]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else "nan"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def profile_toml(p: HardwareProfile, name: str | None = None, header: str = "") -> str:
    """`p` as a profile TOML file that load_profile reads back to the same numbers, curves and
    sources (`name` renames it; `header` becomes leading comment lines)."""
    table = _profile_table(p)
    if name:
        table["name"] = name
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines.append("# schema: engines/sim/hardware.py; `pwbench run --simulate THIS_FILE` runs on it")
    for key in (*_STRS, *_INTS, *_FLOATS, *_BOOLS):
        if table.get(key) is not None:
            lines.append(f"{key} = {_toml_value(table[key])}")
    lines += ["", "[flops_per_s]"]
    lines += [f"{_toml_key(k)} = {_toml_value(float(v))}" for k, v in table["flops_per_s"].items()]
    for f in OVERHEAD_TABLES:
        if table.get(f):
            lines += ["", f"[{f}]"] + [f"{_toml_key(k)} = {_toml_value(float(v))}" for k, v in table[f].items()]
    lines += ["", "[sources]"] + [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table["sources"].items()]
    for key, curve in table["efficiency"].items():
        points = [[float(x), float(y)] for x, y in curve["points"]]
        lines += ["", f"[efficiency.{_toml_key(key)}]", f"points = {_toml_value(points)}",
                  f"source = {_toml_value(curve['source'])}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# this machine


def _cpu_measured_table(base: dict[str, Any], m: Mapping[str, Any], when: str) -> dict[str, Any]:
    """profiles/cpu.toml's assumptions with what `pwbench hw` measured here laid over them: the
    peaks (engines/sim/calibrate.py `cpu_rates`) and every efficiency curve the measurements
    fit (`fit_cpu_curves`); the rest (dequant_gemm_*, copy_overlap, step_overhead_s) stays the
    file's, with its source. ValueError (one line) when a measured rate is not a positive number."""
    src = f"measured by `pwbench hw --device cpu` at {when} (cache: engines.common.peaks.cache_path())"
    table = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    sources = table["sources"]
    rates = cpu_rates(m)
    bw, peak = rates["memory_bytes_per_s"], rates["flops_per_s"]["float32"]
    table["memory_bytes_per_s"] = bw
    sources["memory_bytes_per_s"] = f"{src}: memory_bandwidth_bytes_per_s (a large copy, read + write)"
    table["flops_per_s"] = {"float32": peak}
    sources["flops_per_s.float32"] = (f"{src}: the best float32 GEMM rate measured, {best_flops(m)[1]} "
                                      f"(matmul_flops_per_s, the 1024^3 matmul: {float(m['matmul_flops_per_s']):.4g})")
    if m.get("matmul_bfloat16_flops_per_s"):
        table["flops_per_s"]["bfloat16"] = float(m["matmul_bfloat16_flops_per_s"])
        sources["flops_per_s.bfloat16"] = f"{src}: matmul_bfloat16_flops_per_s"
    # On a CPU run host and device are one processor: the "link" is a memory copy (half the
    # read + write rate), host memory and FLOP/s are the device's.
    table["link_bytes_per_s"] = table["link_pinned_bytes_per_s"] = rates["link_pinned_bytes_per_s"]
    sources["link_bytes_per_s"] = sources["link_pinned_bytes_per_s"] = \
        f"{src}: memory_bandwidth_bytes_per_s / 2 (host and device share one memory; a copy reads and writes)"
    table["host_memory_bytes_per_s"], table["host_flops_per_s"] = bw, peak
    sources["host_memory_bytes_per_s"] = sources["memory_bytes_per_s"]
    sources["host_flops_per_s"] = sources["flops_per_s.float32"]
    if m.get("runtime_op_overhead_s") is not None:  # `pwbench hw calibrate`: the runtime's time per counted call
        table["op_overhead_s"] = float(m["runtime_op_overhead_s"])
        sources["op_overhead_s"] = f"{src}: {m.get('runtime_op_overhead_source', 'runtime_op_overhead_s')}"
    elif "op_overhead_s" in rates:
        table["op_overhead_s"] = rates["op_overhead_s"]
        sources["op_overhead_s"] = f"{src}: op_overhead_s (1000 tiny torch calls)"
    if m.get("decode_sequence_overhead_s") is not None:  # `pwbench hw calibrate`, fitted with the per-call time
        table["decode_sequence_overhead_s"] = float(m["decode_sequence_overhead_s"])
        sources["decode_sequence_overhead_s"] = f"{src}: {m.get('runtime_op_overhead_source', 'runtime_op_overhead_s')}"
    if m.get("step_overhead_s") is not None:  # `pwbench hw calibrate`: the runtime's per-step time outside the model
        table["step_overhead_s"] = float(m["step_overhead_s"])
        sources["step_overhead_s"] = f"{src}: {m.get('step_overhead_source', 'step_overhead_s')}"
    for f in ("prefill_element_overhead_s", "prefill_segment_overhead_s", "prefill_step_overhead_s"):
        if m.get(f) is not None:  # `pwbench hw calibrate`'s prefill probe
            table[f] = float(m[f])
            sources[f] = f"{src}: {m.get('prefill_overhead_source', f)}"
    for f in ("executor_overhead_s", "executor_token_overhead_s"):
        if isinstance(m.get(f), dict):  # `pwbench hw calibrate`'s engine probe
            table[f] = {str(k): float(v) for k, v in m[f].items()}
            sources[f] = f"{src}: {m.get('executor_overhead_source', f)}"
    for key, entry in sorted((m.get("model_gemm") or {}).items()):  # `pwbench hw calibrate --model`'s own probe
        fit = entry.get("prefill_overhead") if isinstance(entry, dict) else None
        if not isinstance(fit, dict):
            continue
        for f, part in zip(MODEL_PREFILL_TABLES, ("element_s", "segment_s", "step_s")):
            table.setdefault(f, {})[key] = float(fit.get(part) or 0.0)
        sources[f"model_prefill_overhead.{key}"] = f"{src}: {fit.get('source', 'the model prefill probe')}"
    table["shared_processor"] = True
    sources["shared_processor"] = "one CPU: host and device are the same cores and memory"
    table["efficiency"] = {**table["efficiency"], **fit_cpu_curves(m)}
    return table


def cpu_profile() -> HardwareProfile:
    """This machine as a profile: profiles/cpu.toml's stated assumptions, with what `pwbench hw`
    measured for this CPU (engines.common.peaks.cached_peaks()[cpu_model()]) laid over them."""
    path = PROFILES_DIR / "cpu.toml"
    base, _ = _merged(path, str(path))
    name = cpu_model()
    measured = cached_peaks().get(name)
    if not measured or not measured.get("memory_bandwidth_bytes_per_s") or not measured.get("matmul_flops_per_s"):
        table = dict(base)
        table["description"] = f"{name} (assumed peaks: run `pwbench hw --device cpu` to measure)"
        return _build(table, f"{path} (assumptions; `pwbench hw` has not measured {name!r})")
    table = _cpu_measured_table(base, measured, str(measured.get("measured_at")))
    table["description"] = f"{name} (measured by pwbench hw)"
    return _build(table, f"{path} + pwbench hw cache ({name})")

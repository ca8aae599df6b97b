"""Engine registry: names resolve lazily to "module:Attr" strings.

Listing engines imports nothing heavy (no torch, no triton); only `engine_class(name)`
imports the engine's module. `build_config` turns `--set key=value` strings into an engine's
config dataclass, with errors that name the valid keys.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from collections.abc import Mapping
from typing import Any

from engines.base import Engine, EngineError

# name -> (lazy target, one-line description)
_ENGINES: dict[str, tuple[str, str]] = {
    "moe": (
        "engines.moe:MoEEngine",
        "pwbench MoE runtime, full precision: paged KV, continuous batching, expert-grouped matmuls",
    ),
    "hf": (
        "engines.hf:HFEngine",
        "transformers' own model with generate(), static batches with left padding (reference)",
    ),
    "static-gptq": (
        "engines.static_quant:StaticGPTQEngine",
        "moe runtime, every routed expert GPTQ-quantized before serving (a GPTQ folder, or --set bits=N)",
    ),
    "static-awq": (
        "engines.static_quant:StaticAWQEngine",
        "moe runtime, every routed expert AWQ-quantized before serving (an AWQ folder, or --set bits=N)",
    ),
    "static-rtn": (
        "engines.static_quant:StaticRTNEngine",
        "moe runtime, every routed expert round-to-nearest quantized (a quantized folder, or --set bits=N)",
    ),
    "offload": (
        "engines.offload.engine:OffloadEngine",
        "moe runtime, experts in host memory and a per-layer device cache sized from --budget (lru/lfu, prefetch)",
    ),
    "pagedweight": (
        "engines.pagedweight.engine:PagedWeightEngine",
        "moe runtime, experts paged at bit widths (16/8/4/3/2) chosen per step against KV demand in --budget",
    ),
    "moegen": (
        "engines.moegen.engine:MoEGenEngine",
        "moe runtime, module-based batching (MoE-Gen): KV in host memory, experts streamed per layer, cost-model plan",
    ),
    "full": (
        "engines.full:FullEngine",
        "pagedweight's per-expert bit widths under moegen's module-based batching: one arbiter, one --budget",
    ),
    "openai": (
        "engines.remote:OpenAIEngine",
        "any OpenAI-compatible server (vLLM, SGLang, TGI, pwbench serve) over HTTP, streamed (--set base_url=...)",
    ),
    "dummy": (
        "engines.dummy:DummyEngine",
        "no model: deterministic tokens and a parametric latency model, for harness tests",
    ),
}


# The quality reference every engine is compared with (harness/quality.py): full precision,
# float32, on the CPU.
REFERENCE_ENGINE = "moe"
REFERENCE_OPTIONS = {"device": "cpu", "dtype": "float32"}
# The techniques under test; every other engine is a baseline they are judged against. A run
# records its engine's role (run.json config.role), so the reports never list engine names.
TECHNIQUES = frozenset({"pagedweight", "moegen", "full"})


def engine_role(name: str) -> str:
    return "technique" if name in TECHNIQUES else "baseline"


def register_engine(name: str, target: str, description: str) -> None:
    """Add an engine by lazy target "package.module:ClassName" (for plugins and tests)."""
    if ":" not in target:
        raise ValueError(f"engine target must look like 'module:Class', got {target!r}")
    if name in _ENGINES and _ENGINES[name][0] != target:
        raise ValueError(f"engine {name!r} is already registered as {_ENGINES[name][0]}")
    _ENGINES[name] = (target, description)


def list_engines() -> list[tuple[str, str]]:
    """(name, description) pairs, sorted by name; imports no engine module."""
    return sorted((name, desc) for name, (_, desc) in _ENGINES.items())


def engine_class(name: str) -> type[Engine]:
    if name not in _ENGINES:
        valid = ", ".join(sorted(_ENGINES))
        raise EngineError(f"unknown engine {name!r}; valid engines: {valid}")
    module_name, _, attr = _ENGINES[name][0].partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise TypeError(f"{_ENGINES[name][0]} is not an Engine subclass")
    return cls


def create_engine(name: str, options: Mapping[str, Any]) -> Engine:
    """Build (not start) engine `name` with options checked against its config dataclass."""
    cls = engine_class(name)
    if (options.get("budget_bytes") is not None
            and "budget_bytes" not in {f.name for f in dataclasses.fields(cls.config_cls)}):
        takes = [n for n in _ENGINES if n != name and _takes_budget(n)]
        raise EngineError(f"engine {name} does not manage device memory, so --budget does not apply to it; "
                          f"engines that take a budget: {', '.join(takes)}")
    return cls(build_config(cls.config_cls, options, owner=f"engine {name!r}"))


def _takes_budget(name: str) -> bool:
    try:
        return any(f.name == "budget_bytes" for f in dataclasses.fields(engine_class(name).config_cls))
    except ImportError:
        return False


def build_config(config_cls: type, options: Mapping[str, Any], owner: str = "config") -> Any:
    """Instantiate a config dataclass from values that may be strings (from `--set k=v`)."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    hints = typing.get_type_hints(config_cls)
    values: dict[str, Any] = {}
    for key, raw in options.items():
        if key not in fields:
            raise EngineError(f"{owner} has no option {key!r}; valid options: {', '.join(fields)}")
        values[key] = _coerce(raw, hints[key], f"{owner} option {key!r}")
    try:
        return config_cls(**values)
    except TypeError as exc:  # a required field is missing
        raise EngineError(f"{owner}: {exc}") from None


def parse_set_options(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """["a=1", "b=x"] -> {"a": "1", "b": "x"}; an item without "=" is an error."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise EngineError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _coerce(raw: Any, hint: Any, what: str) -> Any:
    if not isinstance(raw, str):
        return raw
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if raw.lower() in ("none", "null", ""):
            return None
        hint = args[0] if len(args) == 1 else str
    try:
        if hint is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if hint is int and what.endswith("_bytes'"):
            from engines.common.sizes import parse_size

            return parse_size(raw, what)
        if hint in (int, float, str):
            return hint(raw)
    except ValueError:
        raise EngineError(f"{what} expects {getattr(hint, '__name__', hint)}, got {raw!r}") from None
    return raw

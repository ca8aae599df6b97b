"""Named workloads: a lazy registry, the options (WorkloadSpec) and the model (ModelTarget).

`list_workloads()` imports no generator, numpy, pandas or torch; `build_workload` imports
the one workload module it needs. Options are checked when the spec is made, with errors
that name the field and the allowed values.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workloads.arrivals import ARRIVALS, TURNS
from workloads.base import WorkloadError

if TYPE_CHECKING:
    from workloads.assemble import Workload
    from workloads.synth import PromptSynthesizer

TRACE_PREFIX = "trace:"
SESSION_REUSE = ("infer", "none")

# name -> (lazy "module:function" returning the workload's Shape, one-line description)
_WORKLOADS: dict[str, tuple[str, str]] = {
    "rag_long": (
        "workloads.shapes:rag_long_shape",
        "RAG shaped like RAGPulse: system prompt + shared retrieved passages + history + question, "
        "2k-8k tokens (--context up to 32k), short answers",
    ),
    "long_chat": (
        "workloads.shapes:long_chat_shape",
        "multi-turn chats shaped like Mooncake's conversation trace: history grows in shared "
        "512-token blocks, think times, closed loop",
    ),
    "offline_batch": (
        "workloads.shapes:offline_batch_shape",
        "all requests at t=0 (MoE-Gen's offline setup): 512 in / 256 out, or an input length range",
    ),
    "agentic": (
        "workloads.agentic:agentic_shape",
        "coding-agent sessions shaped like TraceLab's Claude Code/Codex traces: a shared 19k-token system prompt, "
        "each call extends the previous one by its answer and a tool output, short answers, tool times, closed loop",
    ),
    "burst": (
        "workloads.shapes:burst_shape",
        "bursty gamma arrivals and lengths shaped like Azure 2023 code traffic: long prompts, tiny answers",
    ),
    "trace:PATH": (
        "workloads.shapes:trace_shape",
        "replay a trace file (mooncake, ragpulse, azure, burstgpt, lengths, pwbench JSONL)",
    ),
}


def list_workloads() -> list[tuple[str, str]]:
    """(name, one-line description), sorted by name; imports no workload module."""
    return sorted((name, desc) for name, (_, desc) in _WORKLOADS.items())


@dataclass(frozen=True)
class ModelTarget:
    """What the prompts must fit: token ids in [0, vocab_size) minus special_ids, length limits."""

    vocab_size: int
    max_model_len: int  # prompt + output tokens per request
    special_ids: tuple[int, ...] = ()  # BOS, EOS, pad, ...: never placed in a prompt

    def __post_init__(self) -> None:
        _check(_whole(self.vocab_size, 1), "vocab_size", self.vocab_size, "use an integer >= 1")
        _check(_whole(self.max_model_len, 2), "max_model_len", self.max_model_len, "use an integer >= 2")


@dataclass(frozen=True)
class WorkloadSpec:
    """Every workload option; None = the workload's default (see README "Workloads and traces")."""

    name: str  # rag_long | long_chat | agentic | offline_batch | burst | trace:PATH
    seed: int = 0
    requests: int | None = None  # at most this many requests (default 100; a trace: all)
    duration_s: float | None = None  # only requests arriving before this (open loop)
    scale: float = 1.0  # multiplies every token length (context included); < 1 for CPU models
    context: int | None = None  # rag_long: prompts of about this many tokens (0.85-1.0 x)
    # rag_long: this share of the requests are direct questions outside the RAG pipeline (no
    # system prompt, passages or history; RAGPulse's user-input lengths), one per session
    direct_share: float | None = None
    arrival: str | None = None  # trace | poisson | gamma | closed | offline
    rate: float | None = None  # poisson/gamma: mean requests per second
    burstiness: float | None = None  # gamma: squared CV of the gaps (1 = Poisson)
    concurrency: int | None = None  # closed loop: users at once (default 4)
    time_scale: float = 1.0  # multiplies trace times and think times (0.1 = ten times faster)
    input_tokens: int | None = None  # offline_batch: prompt tokens (default 512)
    output_tokens: int | None = None  # offline_batch: output tokens (default 256)
    input_range: tuple[int, int] | None = None  # offline_batch: prompt tokens uniform in [lo, hi]
    output_range: tuple[int, int] | None = None
    trace_format: str | None = None  # trace:PATH: the format, instead of detecting it (jsonl/csv with trace_map)
    # trace:PATH in the user's own JSONL/CSV layout: "arrival_s=COL,input_tokens=COL,output_tokens=COL[,...]"
    # (the --map text; workloads/traces/generic.py)
    trace_map: str | None = None
    skip_bad_lines: bool = False  # trace:PATH: skip malformed lines, reported in notes
    # trace:PATH with session ids and no block ids: "infer" (default) makes a turn whose input
    # holds the previous turn's input + output begin with that prompt and answer; "none" = fresh tokens
    session_reuse: str | None = None
    # open loop: "dependent" (default) sends a session's later turn only after the previous
    # answer (plus its think time); "independent" sends every turn at its own arrival time
    turns: str | None = None

    def __post_init__(self) -> None:
        is_trace = isinstance(self.name, str) and self.name.startswith(TRACE_PREFIX)
        known = is_trace and len(self.name) > len(TRACE_PREFIX) or self.name in _WORKLOADS and self.name != "trace:PATH"
        _check(known, "workload", self.name, "use one of " + ", ".join(name for name, _ in list_workloads()))
        _check(_whole(self.seed, 0), "seed", self.seed, "use an integer >= 0")
        for name in ("requests", "context", "concurrency", "input_tokens", "output_tokens"):
            value = getattr(self, name)
            _check(value is None or _whole(value, 1), name, value, "use an integer >= 1")
        for name in ("duration_s", "rate", "burstiness", "scale", "time_scale"):
            value = getattr(self, name)
            required = name in ("scale", "time_scale")
            _check((value is None and not required) or _positive(value), name, value, "use a number > 0")
        for name in ("input_range", "output_range"):
            span = getattr(self, name)
            ok = span is None or (isinstance(span, tuple) and len(span) == 2 and _whole(span[0], 1)
                                  and _whole(span[1], span[0]))
            _check(ok, name, span, "use two integers lo-hi with 1 <= lo <= hi, e.g. 128-1024")
        _check(self.arrival is None or self.arrival in ARRIVALS, "arrival", self.arrival,
               "use one of " + ", ".join(ARRIVALS))
        _check(self.direct_share is None or (_number(self.direct_share) and 0 <= self.direct_share < 1),
               "direct_share", self.direct_share, "use a share in [0, 1), e.g. 0.5")
        _check(self.session_reuse in (None, *SESSION_REUSE), "session_reuse", self.session_reuse,
               "use one of " + ", ".join(SESSION_REUSE))
        _check(self.turns in (None, *TURNS), "turns", self.turns, "use one of " + ", ".join(TURNS))
        _only(self, "rag_long", "context", "direct_share")
        _only(self, "offline_batch", "input_tokens", "output_tokens", "input_range", "output_range")
        if not is_trace:
            _check(self.arrival != "trace", "arrival", self.arrival,
                   "replaying trace times needs a trace:PATH workload; use poisson, gamma, closed or offline")
            _check(self.trace_format is None, "trace_format", self.trace_format, "it needs a trace:PATH workload")
            _check(not self.skip_bad_lines, "skip_bad_lines", self.skip_bad_lines, "it needs a trace:PATH workload")
            _check(self.trace_map is None, "trace_map", self.trace_map, "it needs a trace:PATH workload")
            _check(self.session_reuse is None, "session_reuse", self.session_reuse,
                   "it needs a trace:PATH workload (named workloads build their own prefix reuse)")
        if self.trace_map is not None:  # a bad map fails here, before an engine loads
            from workloads.traces.generic import parse_map

            parse_map(self.trace_map)
            _check(self.trace_format in (None, "jsonl", "csv"), "trace_format", self.trace_format,
                   "a trace_map (--map) names the columns of --format jsonl or csv; drop one of them")


def _whole(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: object) -> bool:
    return _number(value) and value > 0


def _check(ok: bool, field: str, value: object, fix: str) -> None:
    if not ok:
        raise WorkloadError(f"workload option {field}={value!r} is not valid; {fix}")


def _only(spec: WorkloadSpec, workload: str, *fields: str) -> None:
    for name in fields:
        value = getattr(spec, name)
        _check(value is None or spec.name == workload, name, value, f"it applies only to workload {workload}")


def parse_length_range(text: str) -> tuple[int, int]:
    """'128-1024' -> (128, 1024); '512' -> (512, 512)."""
    lo, sep, hi = text.strip().partition("-")
    try:
        span = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise WorkloadError(f"length range {text!r} is not valid; use lo-hi, e.g. 128-1024") from None
    if not 1 <= span[0] <= span[1]:
        raise WorkloadError(f"length range {text!r} is not valid; use lo-hi with 1 <= lo <= hi")
    return span


def build_workload(
    spec: WorkloadSpec, target: ModelTarget, synthesizer: PromptSynthesizer | None = None
) -> Workload:
    """The requests of `spec` for `target`; content from `synthesizer` (default: hash blocks)."""
    from workloads.assemble import assemble

    return assemble(spec, target, workload_shape(spec, target), synthesizer)


def workload_shape(spec: WorkloadSpec, target: ModelTarget | None = None):
    """The workload's shape step (workloads.assemble.Shape), its module imported on demand; a
    shape may size itself to `target` (agentic fits its context to max_model_len)."""
    key = "trace:PATH" if spec.name.startswith(TRACE_PREFIX) else spec.name
    module_name, _, attr = _WORKLOADS[key][0].partition(":")
    return getattr(importlib.import_module(module_name), attr)(spec, target)

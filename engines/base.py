"""The Engine protocol: the one interface between the harness and anything that generates tokens.

The harness owns the clock: it calls `step()` and timestamps what comes back, so an engine
never measures its own latency. Records here are plain frozen dataclasses with no torch
import, so the harness and the reports can use them on a machine without torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar


class EngineError(Exception):
    """A problem the user can fix (bad model folder, bad option, bad request); shown as one line."""


class ModelLoadError(EngineError):
    """The model folder cannot be loaded: missing files, unsupported architecture, bad tensors."""


class InvalidRequestError(EngineError):
    """A request the engine cannot serve (token ids outside the vocabulary, too long, ...)."""


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 means greedy; top_k 0 and top_p 1 disable them."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class EngineRequest:
    """One generation request. `ignore_eos` makes the output exactly `max_new_tokens` long.

    `prompt_ids` is an immutable sequence of ints: a tuple, or what the harness sends, a
    compact one that reads like the tuple (workloads/prompts.py: an int32 array, or tokens
    synthesized when read, so thousands of queued requests hold no tokens). Engines read it
    once when the request is added (`np.asarray(...)`, `list(...)`) and keep what they need."""

    request_id: str
    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    ignore_eos: bool = False
    # Return the float32 logits of every generated token (for agreement metrics and tests).
    return_logits: bool = False
    # Return the logits at every prompt position (teacher forcing: log-likelihoods, KL against
    # a reference engine). Row j is the distribution of token j+1; the last row is that of the
    # first generated token.
    return_prompt_logits: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise InvalidRequestError(f"request {self.request_id}: prompt is empty")
        if self.max_new_tokens < 1:
            raise InvalidRequestError(
                f"request {self.request_id}: max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request.

    finish_reason is "length" (max_new_tokens or model length reached), "stop" (EOS) or
    "abort"; None while the request is still running. `logits` holds one float32 row per new
    token when the request asked for them (a torch tensor [n, vocab]); `prompt_logits` comes
    with the request's first token ([prompt_len, vocab]) when asked for.

    `token_times` is for engines whose tokens arrive outside `step()` (a remote server's
    stream): one receive time per new token, on `time.perf_counter()`'s clock; the harness
    records these instead of the step's end, and such a request's finish time is its last
    token's. Empty (every in-process engine): the caller timestamps the tokens when `step()`
    returns. `error` says why a request failed after it was accepted (a remote server's HTTP
    error, a lost connection); finish_reason is then "error".
    """

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: str | None = None
    logits: Any = None
    prompt_logits: Any = None
    token_times: tuple[float, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class StepOutput:
    """Everything one `step()` did. Counters are for this step only; the harness sums them.

    experts_hit counts distinct (layer, expert) pairs that ran at least one token;
    weight_bytes_read is the weights the step's compute read at their stored size (dense
    weights plus the experts that ran; 0 when the engine cannot say). Transfer counters cover
    every byte that crossed host<->device during the step (0 on a CPU-only run).
    `extras` carries engine-specific per-step series (bit widths, cache hits, ...).
    """

    outputs: tuple[RequestOutput, ...] = ()
    started: tuple[str, ...] = ()  # requests whose first prompt token was computed in this step
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_preempted: int = 0
    experts_hit: int = 0
    context_tokens: int = 0  # K/V positions attended, summed over the step's sequences
    weight_bytes_read: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_transfers: int = 0
    d2h_transfers: int = 0
    # Prompt tokens of sequences admitted in this step whose K/V came from the prefix cache
    # (not computed, so not in num_prefill_tokens).
    cached_prompt_tokens: int = 0
    # Device memory in use after the step: dense + routed expert weights, and KV blocks held
    # (by sequences and by the prefix cache). 0 when the engine cannot say.
    device_weight_bytes: int = 0
    device_kv_bytes: int = 0
    # Engines with a host tier: seconds the host<->device link spent copying during the step,
    # and seconds compute waited for copies; the rest of the link time overlapped compute.
    copy_busy_s: float = 0.0
    copy_stall_s: float = 0.0
    extras: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineInfo:
    """Static facts about a started engine, written into every result file."""

    name: str
    model: str | None
    architecture: str | None
    device: str
    dtype: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    weight_bytes: int = 0
    kv_cache_bytes: int = 0
    kv_capacity_tokens: int = 0
    # The --budget the engine keeps dense weights + expert weights + KV blocks within; None
    # when it was given none (it then uses what it needs, as before budgets existed).
    device_budget_bytes: int | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    # For efficiency metrics: dense_weight_bytes, bytes_per_expert, active_params_per_token,
    # kv_bytes_per_token (engines that know their model fill it).
    model_stats: Mapping[str, float] = field(default_factory=dict)
    # Metrics this engine cannot measure -> why (a remote server: transfers, memory, experts);
    # written into run.json so a zero is never read as a measurement.
    unavailable: Mapping[str, str] = field(default_factory=dict)


def unseen_metrics(source: str) -> dict[str, str]:
    """EngineInfo.unavailable for tokens measured outside this process (a remote server, an
    imported result file): what such a source cannot show, with `source` as the reason."""
    return {
        "transfers": f"{source}: host<->device bytes are not visible",
        "memory": f"{source}: device memory and KV blocks are not visible",
        "experts": f"{source}: expert selection and bit widths are not visible",
        "efficiency": f"{source}: per-step FLOPs and bytes read are unknown",
        "prefill_decode_tokens_per_s": f"{source}: the server's steps are not visible; use output_tokens_per_s",
        "queue_ms": f"{source}: when a request started computing is not visible; TTFT includes it",
    }


class Engine(ABC):
    """Step-driven generation engine.

    Lifecycle: construct with a config dataclass (cheap), `start()` (load weights, allocate
    caches), then any interleaving of `add_request`, `step`, `abort`, and finally `stop()`.
    `step()` returns only after the device work it launched has finished, so the caller's
    timestamps are true completion times.
    """

    name: ClassVar[str]
    config_cls: ClassVar[type]
    # Capabilities: what the harness asks instead of comparing engine names.
    needs_model: ClassVar[bool] = True  # reads a model folder (--model; default: the bundled demo model)
    prompt_logits: ClassVar[bool] = False  # returns teacher-forced prompt logits (quality, lm-eval)
    # Run on the CPU in float32 with no other option, this engine *is* the quality reference.
    float32_reference: ClassVar[bool] = False
    # Calibrates at start on prompts of the tasks the model serves (its config's `calib_file`,
    # a JSON list of token-id lists). Engines do not read workloads, so the harness writes the
    # file (harness/calibration.py: create_calibrated) when the option is not given.
    needs_calibration: ClassVar[bool] = False
    # Has a cost-model plan `pwbench plan` prints: its config_cls extends engines/moegen/plan.py's
    # MoEGenConfig, and its start runs make_plan over it.
    plannable: ClassVar[bool] = False
    # Runs under --simulate: its control path (scheduler, KV, budget, expert residency) has a
    # simulated counterpart on the meta device (engines/sim).
    simulates: ClassVar[bool] = False
    # The keys of a hardware profile's executor_overhead tables its simulated steps pay: its parts'
    # host time beyond engine moe's path (engines/sim/cost.py `executor_overhead_s`): "pagedweight"
    # (its backend's bookkeeping), "offload" (its cache), "layer_major" (moegen's executor loop).
    # `pwbench hw calibrate` fits each key on an engine that pays it alone.
    sim_overhead_keys: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises InvalidRequestError for one the engine can never serve."""

    @abstractmethod
    def step(self) -> StepOutput: ...

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Drop a request; its final output (finish_reason "abort") comes with the next step."""

    @abstractmethod
    def info(self) -> EngineInfo: ...

    @abstractmethod
    def stop(self) -> None: ...

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix, so the next request computes its whole prompt (the
        harness calls it after warm-up and between capacity points, so measured hits are the
        measured traffic's own). Engines without a prefix cache have nothing to do."""
        return None

    def tables(self) -> Mapping[str, list[dict[str, Any]]]:
        """Engine-specific result tables, written as `<name>.parquet` beside steps.parquet
        (rows of plain values; e.g. a per-expert series at a lower rate than steps). Asked
        once, after the measured run; rows may carry an `engine_step` that steps' extras
        carry too (x_engine_step), so the two join. Default: none."""
        return {}

    def notes(self) -> list[str]:
        """What the user must know about the measured run (e.g. a server that ignored
        `ignore_eos`, the client's own overhead), one line each; asked once after the run,
        written into run.json (`engine_notes`) and shown with the summary. Default: none."""
        return []

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

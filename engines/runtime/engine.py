"""`RuntimeEngine`: the Engine protocol over pwbench's MoE runtime, assembled from parts.

An engine is a recipe of two hooks: `load(cfg) -> Loaded` (checkpoint, dense weights, experts)
and `build(cfg, loaded) -> EngineParts` (expert backend, budget claims, KV pool, copy path,
executor, per-step controllers, stats, notes). `start()` and `step()` below read as the flow;
no engine overrides them. Why the parts are these: docs/moe.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, NamedTuple

import torch

from engines.base import Engine, EngineError, EngineInfo, EngineRequest, InvalidRequestError, RequestOutput, StepOutput
from engines.common.device import dtype_name, resolve_device, resolve_dtype
from engines.runtime import cpu_attention
from engines.runtime.attention import no_per_shape_attention_plans
from engines.runtime.batch import SeqState, StepBatch, build_batch
from engines.runtime.budget import OFFLOAD_FIX, Claim, DeviceBudget
from engines.runtime.checkpoint import Checkpoint, load_weights, open_checkpoint
from engines.runtime.config import ModelConfig
from engines.runtime.copies import CopyEngine, CopyStats
from engines.runtime.executor import Executor, StepResult
from engines.runtime.experts import ExpertBackend
from engines.runtime.kv_cache import PagedKVCache
from engines.runtime.memory import KVSizing, keep_freed_host_memory, kv_cache_blocks
from engines.runtime.model import MoEModel
from engines.runtime.sampling import make_generator
from engines.runtime.scheduler import Schedule, Scheduler, Sequence
from engines.runtime.transfer import TransferLedger
from engines.runtime.weights import DenseExperts, ModelWeights


@dataclass(frozen=True)
class RuntimeConfig:
    """The runtime's options, which every recipe's config extends (so `--set` keys stay flat)."""

    model: str | None = None
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str | None = None  # None: float32 on cpu, bfloat16 on cuda
    block_size: int = 16  # tokens per KV block
    kv_cache_gb: float | None = None  # None: 1 GiB on cpu; on cuda what gpu_memory_utilization leaves
    kv_blocks: int | None = None  # exact number of KV blocks (overrides kv_cache_gb)
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256  # sequences in flight at once
    max_num_batched_tokens: int = 2048  # tokens per step (prefill chunks + decodes)
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped by the KV cache
    seed: int = 0  # seeds sampling for requests that give no seed
    # Device memory for dense + expert weights + KV blocks together (--budget); None: no bound
    # (the KV cache is sized by kv_cache_gb / kv_blocks / gpu_memory_utilization).
    budget_bytes: int | None = None
    # Automatic prefix caching: full KV blocks are shared between sequences with the same
    # leading tokens and kept after a request ends while memory allows (vLLM's APC).
    prefix_caching: bool = True
    # Fake quantization (what `pwbench demo eval --expert-bits` measures): routed experts
    # RTN-rounded to this many bits at start and computed at full precision; None: off.
    expert_bits: int | None = None
    expert_group: int = 32  # inputs per RTN group with expert_bits; 0: one group per output row
    # --simulate HARDWARE: a hardware profile name (`pwbench hw list`) or TOML file; the run's
    # weights are shapes on the meta device and each step's time comes from the cost model
    # (engines/sim). `routing`: where a simulated step's expert choices come from
    # (uniform | synthetic[:skew=..,locality=..] | replay:PATH).
    simulate: str | None = None
    routing: str = "synthetic"
    # On a simulated run, the CPU time of the engine's own control code between and around
    # its steps (scheduler, KV and prefix cache, the budget's arbiter, the expert cache's
    # decisions, the harness's bookkeeping): "measured" adds it to each step, as a measured
    # run on a host as fast as this one spends it; "off" prices compute only (deterministic).
    control_time: str = "measured"
    # A measured run writes every token's expert choices per MoE layer to this parquet file at
    # stop (request_id, position, layer, experts): what `routing=replay:PATH` replays.
    record_routing: str | None = None
    # CPU float32: the LM head and the experts that stay resident also held in MKL's packed
    # GEMM layout, so matmuls of 16+ rows skip MKL's per-call packing (same results; their
    # bytes again in host RAM, reported as prepacked_bytes, not charged to --budget).
    prepack: bool = True


@dataclass
class Loaded:
    """What `load` read: the checkpoint served, its dense weights on the device, and its routed
    experts, either full precision (MoE layer -> DenseExperts) or, for a quantized folder, as
    a ready backend. `source` is the folder the user named (a quantized copy may be served)."""

    checkpoint: Checkpoint
    weights: ModelWeights
    device: torch.device
    dtype: torch.dtype
    ledger: TransferLedger
    experts: dict[int, DenseExperts] = field(default_factory=dict)
    backend: ExpertBackend | None = None
    source: Checkpoint | None = None

    @cached_property
    def dense_bytes(self) -> int:
        """Device bytes of the dense weights (walked once: every part's claims use it)."""
        return self.weights.nbytes()

    @cached_property
    def bytes_per_expert(self) -> int:
        """Bytes of one full-precision routed expert (0 for a model without loaded experts)."""
        return next(iter(self.experts.values())).expert_nbytes(0) if self.experts else 0

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block of `block_size` tokens at the loaded dtype."""
        return PagedKVCache.model_block_bytes(self.checkpoint.config, block_size, self.dtype)


class Opened(NamedTuple):
    """A model folder opened and checked by an engine, and where its weights will live."""

    checkpoint: Checkpoint
    device: torch.device
    dtype: torch.dtype
    ledger: TransferLedger


def load_dense(opened: Opened) -> Loaded:
    """The opened folder's weights at full precision (the default `load`)."""
    weights, experts = load_weights(opened.checkpoint, opened.device, opened.dtype, opened.ledger)
    return Loaded(opened.checkpoint, weights, opened.device, opened.dtype, opened.ledger, experts)


@dataclass(frozen=True)
class KVPool:
    """Where the KV blocks live. On the device they share `--budget` and leave room for
    `weights_beside` device bytes of weights; in the host tier `host_gb` sizes the pool."""

    on_device: bool = True
    weights_beside: int = 0
    host_gb: float = 1.0


class Controller:
    """A part that acts around every step (PagedWeight's arbiter loop, a plan's predictions).
    `start` runs once the KV pool and scheduler exist; `before_step` may move weights and change
    the KV capacity; `after_step` returns the step's extras. Defaults do nothing."""

    def start(self, kv: PagedKVCache, scheduler: Scheduler) -> None:
        return None

    def before_step(self) -> None:
        return None

    def after_step(self, batch: StepBatch | None) -> Mapping[str, float]:
        return {}

    def max_request_tokens(self) -> int | None:
        """The most KV tokens one request can ever get now (None: no limit beyond the pool's):
        a request above it would wait forever, so it is refused at admission."""
        return None

    def tables(self) -> Mapping[str, list[dict[str, Any]]]:
        return {}


# The executor a recipe runs, built once the model and the KV pool exist.
ExecutorFactory = Callable[[MoEModel, PagedKVCache, TransferLedger], Executor]


def plain_executor(model: MoEModel, kv: PagedKVCache, ledger: TransferLedger) -> Executor:
    return Executor(model, ledger)


@dataclass
class EngineParts:
    """What an engine is made of (built by its recipe's `build`)."""

    experts: ExpertBackend
    claims: list[Claim]  # the least each part holds on the device: the budget minimum
    kv: KVPool = KVPool()
    copies: CopyEngine | None = None  # the host<->device copy path of engines with a host tier
    executor: ExecutorFactory = plain_executor
    controllers: list[Controller] = field(default_factory=list)
    stats: Callable[[], Mapping[str, float]] | None = None  # engine-specific model_stats
    notes: list[str] = field(default_factory=list)
    info_config: Mapping[str, Any] = field(default_factory=dict)  # added to info().config
    config: Any = None  # the options as the parts run them, when the recipe changed one
    # --simulate: the executor a simulated run uses instead of engines/sim's default
    # (SimExecutor: routing -> experts.simulate -> flat-step cost), for a technique whose step
    # is priced or moves weights differently (a layer-major plan). Called as
    # sim_executor(simulation, model, kv, ledger, experts, dense_bytes_read) -> Executor.
    sim_executor: Callable[..., Executor] | None = None


def resident_parts(cfg: RuntimeConfig, loaded: Loaded, experts: ExpertBackend) -> EngineParts:
    """Every expert resident beside the dense weights, the KV pool on the device in what they
    leave: the parts of engine moe and of the static-quantization engines."""
    block = loaded.kv_block_bytes(cfg.block_size)
    dense, held = loaded.dense_bytes, experts.device_bytes()
    claims = [Claim("dense weights", dense), Claim("every routed expert", held, fix=OFFLOAD_FIX),
              Claim("one KV block", block)]
    return EngineParts(experts, claims, KVPool(on_device=True, weights_beside=dense + held))


class RuntimeEngine(Engine):
    """Lifecycle and step shared by every engine on the runtime; recipes give `build` (and
    `load` when they read weights differently)."""

    config_cls: ClassVar[type] = RuntimeConfig
    prompt_logits = True
    def __init__(self, config: Any) -> None:
        self.config = config
        self.copies: CopyEngine | None = None
        self.parts: EngineParts | None = None
        self.simulation: Any = None  # engines.sim.session.Simulation on a simulated run
        self._started = False

    @property
    def virtual_clock(self) -> Any:
        """A simulated run's clock (the harness runs on it), else None."""
        return self.simulation.clock if self.simulation is not None else None

    # -- the recipe's hooks ----------------------------------------------------------------------
    def open(self, cfg: Any) -> Opened:
        """Open cfg.model, check it (`check_model`), and resolve the device, dtype and ledger:
        what every recipe's `load` starts from, whatever it then reads."""
        if self.simulation is not None:
            opened = Opened(*self.simulation.open(cfg))
            self.check_model(opened.checkpoint.config)
            return opened
        device = resolve_device(cfg.device)
        checkpoint = open_checkpoint(cfg.model)
        self.check_model(checkpoint.config)
        return Opened(checkpoint, device, resolve_dtype(cfg.dtype, device), TransferLedger(device))

    def load(self, cfg: Any) -> Loaded:
        """Open the folder and load its weights at full precision."""
        return load_dense(self.open(cfg))

    def build(self, cfg: Any, loaded: Loaded) -> EngineParts:
        raise NotImplementedError

    def check_model(self, mc: ModelConfig) -> None:
        """Refuse, in one line naming the engines that can, a model whose attention or expert kind
        this recipe's parts cannot compute. Every built-in engine composes with every kind the
        runtime loads (MLA, sinks, sliding windows; grouped sigmoid routing, shared experts,
        biased clamped SwiGLU, MXFP4), so none refuses; a plugin recipe may."""
        return None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.config
        if cfg.model is None:
            raise EngineError(f"engine {self.name} needs a model folder (--model DIR)")
        if cfg.block_size < 1 or cfg.max_num_seqs < 1 or cfg.max_num_batched_tokens < 1:
            raise EngineError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if cfg.budget_bytes is not None and (cfg.kv_cache_gb is not None or cfg.kv_blocks is not None):
            raise EngineError("--budget sizes the KV cache from what the weights leave; drop kv_cache_gb / kv_blocks")
        if cfg.simulate:
            if not self.simulates:
                raise EngineError(f"engine {self.name} cannot be simulated yet: its control path has no simulated "
                                  "counterpart (docs/simulation.md lists the engines that have one)")
            from engines.sim.session import Simulation  # noqa: PLC0415  (simulated runs only)

            self.simulation = Simulation(cfg)
            self.config = cfg = self.simulation.configure(cfg)
        loaded = self.load(cfg)
        self.loaded, self.checkpoint, self.weights = loaded, loaded.checkpoint, loaded.weights
        self.device, self.dtype, self.ledger = loaded.device, loaded.dtype, loaded.ledger
        if self.device.type == "cuda":
            no_per_shape_attention_plans()
        elif self.device.type == "cpu":
            keep_freed_host_memory()
        self._dense_bytes = loaded.dense_bytes
        self.parts = parts = self.build(cfg, loaded)
        self.config = cfg = parts.config or cfg
        self.experts, self.copies = parts.experts, parts.copies
        self.budget = DeviceBudget(self.name, cfg.budget_bytes, parts.claims)
        self.budget.check()
        self.kv = self._kv_cache(cfg, parts.kv)
        mc = self.checkpoint.config
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.kv_capacity_tokens = self.kv.allocator.num_blocks * cfg.block_size
        self.scheduler = Scheduler(self.kv.allocator, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        for controller in parts.controllers:
            controller.start(self.kv, self.scheduler)
        self.model = MoEModel(mc, self.weights, self.experts, self.kv, self.ledger)
        self.prepacked_bytes = self.model.prepack() if cfg.prepack else 0
        self._dense_bytes_read = self._dense_weight_bytes()
        self._recorder: Any = None
        if cfg.record_routing and self.simulation is None:
            if parts.executor is not plain_executor:
                raise EngineError(f"engine {self.name}: record_routing needs the flat executor (a layer-major one "
                                  "routes micro-batches); record with an engine that runs the whole batch per layer")
            self._record_routing()
        if self.simulation is None:
            self.executor = parts.executor(self.model, self.kv, self.ledger)
        elif parts.sim_executor is not None:
            self.executor = parts.sim_executor(self.simulation, self.model, self.kv, self.ledger, self.experts,
                                               self._dense_bytes_read)
        else:
            overlap = self.experts.copies_overlap and not self.simulation.shared_processor
            self.executor = self.simulation.make_executor(cfg, self.model, self.ledger, self.experts,
                                                          self._dense_bytes_read, overlap)
        if self.simulation is not None:  # the engine's parts' host time its simulated steps pay
            self.executor.overhead_keys = self.sim_overhead_keys
        self._aborted: list[str] = []
        self._num_requests = 0
        self.ledger.take_step()  # loading traffic is not part of any step
        if self.copies is not None:
            self.copies.take_step()
        self._started = True

    def _record_routing(self) -> None:
        """Every MoE layer's choices of every computed token, keyed (request id, position)."""
        from engines.sim.routing import RoutingRecorder  # noqa: PLC0415  (recording runs only)

        layers: list[tuple[int, torch.Tensor]] = []
        self._recorder, self._route_keys, self._routed = RoutingRecorder(), [], layers
        # Each layer's ids are kept as they are, stacked and copied to the host once per step
        # (`_flush_routing`), and the trace's columns built when it is written: the run is timed with
        # its recording, which no simulated twin pays (python -m harness.bench.recording).
        self.model.on_route = lambda layer, ids: layers.append((layer, ids))

    def _kv_cache(self, cfg: Any, pool: KVPool) -> PagedKVCache:
        """The pool on the device (in what the budget leaves beside the weights, else as sized by
        kv_cache_gb / kv_blocks / gpu_memory_utilization) or in the host tier (host_gb)."""
        mc, block_bytes = self.checkpoint.config, self.loaded.kv_block_bytes(cfg.block_size)
        longest = cfg.max_model_len or mc.max_position_embeddings
        if pool.on_device:
            device = self.device
            sizing = KVSizing(cfg.block_size, cfg.kv_cache_gb, cfg.kv_blocks, cfg.gpu_memory_utilization,
                              cfg.max_num_seqs, longest)
            blocks = (kv_cache_blocks(sizing, block_bytes, device) if cfg.budget_bytes is None
                      else self.budget.kv_blocks(sizing, block_bytes, pool.weights_beside))
        else:
            # The host tier; on a simulated run shapes only, like the device (meta).
            device = torch.device("cpu") if self.simulation is None else self.device
            sizing = KVSizing(cfg.block_size, pool.host_gb, None, cfg.gpu_memory_utilization, cfg.max_num_seqs, longest)
            blocks = kv_cache_blocks(sizing, block_bytes, device)
        return PagedKVCache.for_model(mc, blocks, cfg.block_size, self.dtype, device)

    def _flush_routing(self) -> None:
        """The step's recorded choices to the recorder: one host copy of all its MoE layers' ids
        (instrumentation, not the engine's traffic: not counted as bytes moved)."""
        layers, ids = zip(*self._routed)
        self._routed.clear()
        self._recorder.add_step(layers, self._route_keys, torch.stack(ids).cpu())

    def stop(self) -> None:
        if self.copies is not None:
            self.copies.close()
        if self._started and self._recorder is not None:
            self._recorder.write(self.config.record_routing)
            self._recorder = None
        if self._started:
            self.scheduler.waiting.clear()
            self.scheduler.running.clear()
            del self.model, self.weights, self.experts, self.kv, self.loaded
            self._started = False

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        self._check_started()
        # A simulated run's control time counts from a request's admission on an idle engine, as a
        # measured run's first token waits for it (the bundled model's offline TTFT ran ~0.6 ms past
        # its prefill step measured, 0 simulated: `python -m harness.bench.simulate --models demo`).
        sim = self._sim_executor()
        idle = sim.step_begin() if sim is not None else False
        try:
            self._admit(request)
        except Exception:
            if idle:  # nothing admitted: the engine is idle again
                sim.step_end(False)
            raise

    def _sim_executor(self) -> Any:
        """A simulated run's executor, which keeps its control time (engines/sim/executor.py); None measured."""
        return self.simulation.executor if self.simulation is not None else None

    def _admit(self, request: EngineRequest) -> None:
        vocab = self.checkpoint.config.vocab_size
        bad = next((t for t in request.prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"request {request.request_id}: token id {bad} is outside the vocabulary [0, {vocab})"
            )
        total = len(request.prompt_ids) + request.max_new_tokens
        limits = [c.max_request_tokens() for c in self.parts.controllers]  # a controller's own (floors' room)
        kv_tokens = min([self.kv_capacity_tokens] + [t for t in limits if t is not None])
        limit = min(self.max_model_len, kv_tokens)
        if total > limit:
            raise InvalidRequestError(
                f"request {request.request_id}: prompt ({len(request.prompt_ids)}) + max_new_tokens "
                f"({request.max_new_tokens}) = {total} tokens exceeds the limit of {limit} "
                f"(max_model_len {self.max_model_len}, KV cache {self.kv_capacity_tokens} tokens"
                + (f", {kv_tokens} beside the weights' floors" if kv_tokens < self.kv_capacity_tokens else "") + ")"
                + ("; a larger --budget leaves more for the KV cache" if self.config.budget_bytes is not None else "")
            )
        if any(s.id == request.request_id for s in self.scheduler.running + list(self.scheduler.waiting)):
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        state = SeqState()
        if not request.sampling.greedy:
            seed = request.sampling.seed
            if seed is None:
                seed = self.config.seed * 1_000_003 + self._num_requests
            state.generator = make_generator(seed, self.device)
        self._num_requests += 1
        prompt = list(request.prompt_ids)
        self.scheduler.add(Sequence(request, prompt, len(prompt), state=state,
                                    prefix_caching=self.config.prefix_caching))

    def abort(self, request_id: str) -> None:
        self._check_started()
        if self.scheduler.remove(request_id) is not None:
            self._aborted.append(request_id)

    def reset_prefix_cache(self) -> None:
        self._check_started()
        self.kv.allocator.drop_cached()

    def has_unfinished(self) -> bool:
        return self._started and (self.scheduler.has_work() or bool(self._aborted))

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> StepOutput:
        self._check_started()
        sim = self._sim_executor()
        if sim is not None:  # its control time (engines/sim/executor.py)
            sim.step_begin()
        for controller in self.parts.controllers:
            controller.before_step()
        outputs = [RequestOutput(rid, finished=True, finish_reason="abort") for rid in self._aborted]
        self._aborted = []
        schedule = self.scheduler.schedule()
        batch = build_batch(schedule, self.kv.allocator, self.ledger)
        if self._recorder is not None and batch is not None:
            self._route_keys = batch.row_keys()  # a new list each step: the recorder keeps it
        result = self.executor.execute(batch) if batch is not None else None
        if self._recorder is not None and self._routed:
            self._flush_routing()
        started = self._update(schedule, batch, result, outputs)
        out = self._step_output(schedule, batch, result, outputs, started)
        for controller in self.parts.controllers:  # out.extras is this step's own dict
            out.extras.update(controller.after_step(batch))
        if sim is not None:
            sim.step_end(self.has_unfinished())
        return out

    def _update(self, schedule: Schedule, batch: StepBatch | None, result: StepResult | None,
                outputs: list[RequestOutput]) -> tuple[str, ...]:
        """Apply an executed batch: collected prompt logits, computed positions (full blocks
        registered in the prefix cache), new tokens. Returns the requests whose prompt this
        step began to compute (their first chunk; after a cached prefix it starts later)."""
        started = tuple(c.seq.id for c in schedule.prefills if not c.seq.prompt_started)
        for c in schedule.prefills:
            c.seq.prompt_started = True
        if batch is None or result is None:
            return started
        for c, lo, hi in batch.prompt_rows:
            c.seq.state.prompt_logits.append(self.ledger.to_host(result.logits[lo:hi], "logits"))
        for c in batch.chunks:
            c.seq.num_computed += c.length
            self.scheduler.register_computed(c.seq)
        for (c, row), token in zip(batch.sampled, result.tokens):
            outputs.append(self._append_token(c.seq, token, result.logits[row]))
        return started

    def _step_output(self, schedule: Schedule, batch: StepBatch | None, result: StepResult | None,
                     outputs: list[RequestOutput], started: tuple[str, ...]) -> StepOutput:
        counts = result.expert_counts if result is not None else {}
        chunks = batch.chunks if batch is not None else []
        copied = self.copies.take_step() if self.copies is not None else CopyStats()
        moved = self.ledger.take_step()
        expert_stats = self.experts.step_stats()
        bytes_read = expert_stats.pop("expert_bytes_read")
        # KV blocks on the device are the device's KV bytes; a pool in the host tier leaves only
        # what the executor stages on the device (moegen's stream and split placements).
        kv_bytes = (self.kv.allocator.num_held * self.kv.block_bytes if self.parts.kv.on_device
                    else self.executor.device_kv_bytes())
        return StepOutput(
            outputs=tuple(outputs),
            started=started,
            cached_prompt_tokens=schedule.cached_tokens,
            num_prefill_tokens=sum(c.length for c in schedule.prefills),
            num_decode_tokens=len(schedule.decodes),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preempted=len(schedule.preempted),
            experts_hit=result.experts_hit if result is not None and result.experts_hit is not None
            else sum(n > 0 for layer_counts in counts.values() for n in layer_counts),
            context_tokens=sum(c.start + c.length for c in chunks),
            weight_bytes_read=(self._dense_bytes_read + bytes_read) if batch is not None else 0,
            h2d_bytes=moved.h2d_bytes,
            d2h_bytes=moved.d2h_bytes,
            h2d_transfers=moved.h2d_transfers,
            d2h_transfers=moved.d2h_transfers,
            device_weight_bytes=self._dense_bytes + self.experts.device_bytes(),
            device_kv_bytes=kv_bytes,
            copy_busy_s=copied.busy_s,
            copy_stall_s=copied.stall_s,
            extras=expert_stats,
        )

    def _append_token(self, seq: Sequence, token: int, logits_row: torch.Tensor) -> RequestOutput:
        req = seq.request
        seq.token_ids.append(token)
        logits = None
        if req.return_logits:
            seq.state.logits.append(self.ledger.to_host(logits_row, "logits"))
            logits = seq.state.logits[-1][None]
        prompt_logits = None
        if req.return_prompt_logits and seq.num_generated == 1:
            prompt_logits = torch.cat(seq.state.prompt_logits)
            seq.state.prompt_logits = []
        reason = None
        if not req.ignore_eos and token in self.checkpoint.config.eos_token_ids:
            reason = "stop"
        elif seq.num_generated >= req.max_new_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.remove(seq.id)
        return RequestOutput(req.request_id, (token,), reason is not None, reason, logits, prompt_logits)

    # -- results ---------------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        self._check_started()
        mc = self.checkpoint.config
        source = self.loaded.source or self.checkpoint
        return EngineInfo(
            name=self.name,
            model=str(source.path),
            architecture=mc.architecture,
            device=f"simulated {self.simulation.profile.name}" if self.simulation is not None else str(self.device),
            dtype=dtype_name(self.dtype),
            vocab_size=mc.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=mc.eos_token_ids,
            weight_bytes=self._dense_bytes + self.experts.device_bytes(),
            kv_cache_bytes=self.kv.nbytes(),
            kv_capacity_tokens=self.kv_capacity_tokens,
            device_budget_bytes=self.config.budget_bytes,
            config={**dataclasses.asdict(self.config), **self.parts.info_config},
            model_stats=self._model_stats(),
        )

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        return {name: rows for c in self.parts.controllers for name, rows in c.tables().items()}

    def notes(self) -> list[str]:
        sim = self.simulation.notes if self.simulation is not None else []
        return (list(self.parts.notes) if self.parts is not None else []) + sim

    def _dense_weight_bytes(self) -> int:
        """Dense bytes a step reads: every dense tensor except the embedding table (a step
        reads only its rows), plus the LM head when it is the tied embedding."""
        w = self.weights
        dense = w.nbytes() - w.embed.numel() * w.embed.element_size()
        if self.checkpoint.config.tie_word_embeddings:
            dense += w.lm_head.numel() * w.lm_head.element_size()
        return dense

    def _model_stats(self) -> dict[str, float]:
        mc = self.checkpoint.config
        per_expert = 3 * mc.hidden_size * mc.moe_intermediate_size
        if mc.expert_bias:
            per_expert += 2 * mc.moe_intermediate_size + mc.hidden_size
        dense_bytes = self._dense_bytes_read
        dense_params = dense_bytes // self.weights.embed.element_size()
        stats: dict[str, float] = {
            "dense_weight_bytes": dense_bytes,
            "bytes_per_expert": self.experts.device_bytes() / max(1, sum(mc.moe_layers) * mc.num_experts),
            "active_params_per_token": dense_params + sum(mc.moe_layers) * mc.top_k * per_expert,
            "kv_bytes_per_token": self.loaded.kv_block_bytes(1),
            **({"device_budget_bytes": self.config.budget_bytes} if self.config.budget_bytes is not None else {}),
            **({"prepacked_bytes": self.prepacked_bytes} if self.prepacked_bytes else {}),
            # CPU float32: 1 when decode attention runs the in-place C kernel, 0 when it could not
            # be built here (gather + SDPA then; engines/runtime/cpu_attention.py)
            **({"cpu_attention_kernel": float(cpu_attention.available())}
               if self.device.type == "cpu" and self.dtype == torch.float32 else {}),
        }
        if self.parts.stats is not None:
            stats.update(self.parts.stats())
        if self.simulation is not None:
            stats.update(self.simulation.stats())
        return stats

    def _check_started(self) -> None:
        if not self._started:
            raise EngineError(f"engine {self.name} is not started; call start() first")

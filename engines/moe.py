"""Engine `moe`: pwbench's own MoE runtime at full precision, behind the Engine protocol.

Glue only: it loads the checkpoint, sizes the paged KV cache (runtime/memory.py), and each
step is schedule -> build the batch -> execute -> update. The parts live in engines/runtime/.
Engines that change where or how routed experts live subclass this and override
`build_experts` (the public hook: it returns the ExpertBackend the model runs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engines.base import (
    Engine,
    EngineError,
    EngineInfo,
    EngineRequest,
    InvalidRequestError,
    RequestOutput,
    StepOutput,
)
from engines.device import dtype_name, resolve_device, resolve_dtype
from engines.runtime import cpu_attention
from engines.runtime.batch import SeqState, StepBatch, build_batch
from engines.runtime.copies import CopyEngine, CopyStats
from engines.runtime.checkpoint import Checkpoint, load_weights, open_checkpoint
from engines.runtime.config import ModelConfig
from engines.runtime.executor import Executor, StepResult
from engines.runtime.experts import ExpertBackend, ResidentBackend
from engines.runtime.kv_cache import PagedKVCache
from engines.runtime.memory import KVSizing, kv_blocks_in_budget, kv_cache_blocks
from engines.sizes import format_size
from engines.runtime.model import MoEModel
from engines.runtime.sampling import make_generator
from engines.runtime.scheduler import Plan, Scheduler, Sequence
from engines.runtime.transfer import TransferLedger
from engines.runtime.weights import DenseExperts, ModelWeights


@dataclass(frozen=True)
class MoEEngineConfig:
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
    # (the KV cache is sized by kv_cache_gb / kv_blocks / gpu_memory_utilization as before).
    budget_bytes: int | None = None
    # Automatic prefix caching: full KV blocks are shared between sequences with the same
    # leading tokens and kept after a request ends while memory allows (vLLM's APC).
    prefix_caching: bool = True
    # Fake quantization (what `pwbench demo eval --expert-bits` measures): routed experts
    # RTN-rounded to this many bits at start and computed at full precision; None: off.
    expert_bits: int | None = None
    expert_group: int = 32  # inputs per RTN group with expert_bits; 0: one group per output row
    # CPU float32: the LM head and the experts that stay resident also held in MKL's packed
    # GEMM layout, so matmuls of 16+ rows skip MKL's per-call packing (same results; their
    # bytes again in host RAM, reported as prepacked_bytes, not charged to --budget).
    prepack: bool = True


def budget_error(engine: str, budget: int, parts: list[tuple[str, int]]) -> EngineError:
    """`--budget` below an engine's minimum, stated part by part."""
    minimum = sum(n for _, n in parts)
    return EngineError(
        f"--budget {format_size(budget)} is too small for engine {engine} on this model: it needs at "
        f"least {format_size(minimum)} ({minimum} bytes) = "
        + " + ".join(f"{what} {format_size(n)}" for what, n in parts)
        + (" (engine offload keeps experts on the host and needs less)" if engine not in ("offload", "moegen", "full") else "")
    )


class MoEEngine(Engine):
    name = "moe"
    config_cls = MoEEngineConfig
    prompt_logits = True
    float32_reference = True
    # Engines whose expert storage or kernels know only bias-free SwiGLU experts set this, so a
    # model with other experts (gpt-oss) is refused at start instead of computed wrongly.
    plain_experts_only = False

    def __init__(self, config: MoEEngineConfig) -> None:
        self.config = config
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.config
        if cfg.model is None:
            raise EngineError(f"engine {self.name} needs a model folder (--model DIR)")
        if cfg.block_size < 1 or cfg.max_num_seqs < 1 or cfg.max_num_batched_tokens < 1:
            raise EngineError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.ledger = TransferLedger(self.device)
        self.copies: CopyEngine | None = None  # engines with a host tier set it in build_experts
        self._dense_bytes: int | None = None
        if cfg.budget_bytes is not None and (cfg.kv_cache_gb is not None or cfg.kv_blocks is not None):
            raise EngineError("--budget sizes the KV cache from what the weights leave; drop kv_cache_gb / kv_blocks")
        self.checkpoint, self.weights, self.experts = self._load()
        mc = self.checkpoint.config
        self.kv = self._build_kv_cache()
        capacity = self.kv.allocator.num_blocks * cfg.block_size
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.model = MoEModel(mc, self.weights, self.experts, self.kv, self.ledger)
        self.prepacked_bytes = self.model.prepack() if cfg.prepack else 0
        self.executor = Executor(self.model, self.ledger)
        self._dense_bytes_read = self._dense_weight_bytes()
        self.scheduler = Scheduler(self.kv.allocator, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.kv_capacity_tokens = capacity
        self._aborted: list[str] = []
        self._num_requests = 0
        self.ledger.take_step()  # loading traffic is not part of any step
        self._started = True

    def stop(self) -> None:
        if getattr(self, "copies", None) is not None:
            self.copies.close()
        if self._started:
            self.scheduler.waiting.clear()
            self.scheduler.running.clear()
            del self.model, self.weights, self.experts, self.kv
            self._started = False

    # -- hooks for engines that store or compute experts differently --------------------------
    def _load(self) -> tuple[Checkpoint, ModelWeights, ExpertBackend]:
        """Open the folder and load its weights (the device, dtype and ledger are set)."""
        self.checkpoint = open_checkpoint(self.config.model)
        self.check_experts(self.checkpoint.config)
        self.weights, dense_experts = load_weights(self.checkpoint, self.device, self.dtype, self.ledger)
        return self.checkpoint, self.weights, self.build_experts(dense_experts)

    def check_experts(self, mc: ModelConfig) -> None:
        """Refuse, in one line, a model whose routed experts this engine cannot compute."""
        if not mc.plain_experts and (self.plain_experts_only or self.config.expert_bits is not None):
            what = f"engine {self.name}" if self.plain_experts_only else "expert_bits (fake quantization)"
            raise EngineError(
                f"{what} runs bias-free SwiGLU experts only; {mc.architecture}'s experts have biases and a "
                "clamped SwiGLU: use engine moe (without expert_bits) for this model"
            )

    def build_experts(self, dense: dict[int, DenseExperts]) -> ExpertBackend:
        """The ExpertBackend over the loaded full-precision experts (MoE layer -> DenseExperts).
        self.checkpoint and self.weights (the dense weights) are set when it is called."""
        cfg = self.config
        if cfg.expert_bits is not None and cfg.expert_bits < 16:
            from engines.quant.rtn import fake_quantized  # noqa: PLC0415  (quantization only when asked)

            return ResidentBackend(fake_quantized(dense, cfg.expert_bits, cfg.expert_group))
        return ResidentBackend(dense)

    def _kv_block_bytes(self) -> int:
        cfg, mc = self.config, self.checkpoint.config
        return PagedKVCache.model_block_bytes(mc, cfg.block_size, self.dtype)

    def _build_kv_cache(self) -> PagedKVCache:
        cfg, mc = self.config, self.checkpoint.config
        block_bytes = self._kv_block_bytes()
        sizing = KVSizing(cfg.block_size, cfg.kv_cache_gb, cfg.kv_blocks, cfg.gpu_memory_utilization,
                          cfg.max_num_seqs, cfg.max_model_len or mc.max_position_embeddings)
        if cfg.budget_bytes is None:
            num_blocks = kv_cache_blocks(sizing, block_bytes, self.device)
        else:
            used = self._weights_beside_kv()
            self._check_budget(used + block_bytes)
            num_blocks = kv_blocks_in_budget(sizing, block_bytes, cfg.budget_bytes - used)
        return PagedKVCache.for_model(mc, num_blocks, cfg.block_size, self.dtype, self.device)

    def _dense_device_bytes(self) -> int:
        """Device bytes of the dense weights (fixed once loaded; walked once, not every step)."""
        if self._dense_bytes is None:
            self._dense_bytes = self.weights.nbytes()
        return self._dense_bytes

    def _weights_beside_kv(self) -> int:
        """Device bytes of weights the KV pool must leave room for under a budget: all of them
        here; an engine whose weights shrink under KV pressure says its least."""
        return self._dense_device_bytes() + self.experts.device_bytes()

    def budget_minimum(self) -> list[tuple[str, int]]:
        """What the smallest --budget must hold for this engine and model, part by part."""
        return [("dense weights", self._dense_device_bytes()), ("every routed expert", self.experts.device_bytes()),
                ("one KV block", self._kv_block_bytes())]

    def _check_budget(self, needed: int) -> None:
        budget = self.config.budget_bytes
        if budget is not None and budget < needed:
            raise budget_error(self.name, budget, self.budget_minimum())

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        self._check_started()
        vocab = self.checkpoint.config.vocab_size
        bad = next((t for t in request.prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"request {request.request_id}: token id {bad} is outside the vocabulary [0, {vocab})"
            )
        total = len(request.prompt_ids) + request.max_new_tokens
        limit = min(self.max_model_len, self.kv_capacity_tokens)
        if total > limit:
            raise InvalidRequestError(
                f"request {request.request_id}: prompt ({len(request.prompt_ids)}) + max_new_tokens "
                f"({request.max_new_tokens}) = {total} tokens exceeds the limit of {limit} "
                f"(max_model_len {self.max_model_len}, KV cache {self.kv_capacity_tokens} tokens)"
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

    def has_unfinished(self) -> bool:
        return self._started and (self.scheduler.has_work() or bool(self._aborted))

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> StepOutput:
        self._check_started()
        outputs = [RequestOutput(rid, finished=True, finish_reason="abort") for rid in self._aborted]
        self._aborted = []
        plan = self.scheduler.schedule()
        batch = build_batch(plan, self.kv.allocator, self.ledger)
        result = self.executor.execute(batch) if batch is not None else None
        started = self._update(plan, batch, result, outputs)
        return self._step_output(plan, batch, result, outputs, started)

    def _update(self, plan: Plan, batch: StepBatch | None, result: StepResult | None,
                outputs: list[RequestOutput]) -> tuple[str, ...]:
        """Apply an executed batch: collected prompt logits, computed positions (full blocks
        registered in the prefix cache), new tokens. Returns the requests whose prompt this
        step began to compute (their first chunk; after a cached prefix it starts later)."""
        started = tuple(c.seq.id for c in plan.prefills if not c.seq.prompt_started)
        for c in plan.prefills:
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

    def _step_output(self, plan: Plan, batch: StepBatch | None, result: StepResult | None,
                     outputs: list[RequestOutput], started: tuple[str, ...]) -> StepOutput:
        counts = result.expert_counts if result is not None else {}
        chunks = batch.chunks if batch is not None else []
        copied = self.copies.take_step() if self.copies is not None else CopyStats()
        moved = self.ledger.take_step()
        expert_stats = self.experts.step_stats()
        bytes_read = expert_stats.pop("expert_bytes_read")
        return StepOutput(
            outputs=tuple(outputs),
            started=started,
            cached_prompt_tokens=plan.cached_tokens,
            num_prefill_tokens=sum(c.length for c in plan.prefills),
            num_decode_tokens=len(plan.decodes),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preempted=len(plan.preempted),
            experts_hit=sum(n > 0 for layer_counts in counts.values() for n in layer_counts),
            context_tokens=sum(c.start + c.length for c in chunks),
            weight_bytes_read=(self._dense_bytes_read + bytes_read) if batch is not None else 0,
            h2d_bytes=moved.h2d_bytes,
            d2h_bytes=moved.d2h_bytes,
            h2d_transfers=moved.h2d_transfers,
            d2h_transfers=moved.d2h_transfers,
            device_weight_bytes=self._dense_device_bytes() + self.experts.device_bytes(),
            device_kv_bytes=self.kv.allocator.num_held * self.kv.block_bytes,
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

    # -- info ----------------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        self._check_started()
        mc = self.checkpoint.config
        return EngineInfo(
            name=self.name,
            model=str(self.checkpoint.path),
            architecture=mc.architecture,
            device=str(self.device),
            dtype=dtype_name(self.dtype),
            vocab_size=mc.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=mc.eos_token_ids,
            weight_bytes=self._dense_device_bytes() + self.experts.device_bytes(),
            kv_cache_bytes=self.kv.nbytes(),
            kv_capacity_tokens=self.kv_capacity_tokens,
            device_budget_bytes=self.config.budget_bytes,
            config=dataclasses.asdict(self.config),
            model_stats=self._model_stats(),
        )

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
        return {
            "dense_weight_bytes": dense_bytes,
            "bytes_per_expert": self.experts.device_bytes() / max(1, sum(mc.moe_layers) * mc.num_experts),
            "active_params_per_token": dense_params + sum(mc.moe_layers) * mc.top_k * per_expert,
            "kv_bytes_per_token": PagedKVCache.model_block_bytes(mc, 1, self.dtype),
            **({"device_budget_bytes": self.config.budget_bytes} if self.config.budget_bytes is not None else {}),
            **({"prepacked_bytes": self.prepacked_bytes} if self.prepacked_bytes else {}),
            # CPU float32: 1 when decode attention runs the in-place C kernel, 0 when it could not
            # be built here (gather + SDPA then; engines/runtime/cpu_attention.py)
            **({"cpu_attention_kernel": float(cpu_attention.available())}
               if self.device.type == "cpu" and self.dtype == torch.float32 else {}),
        }

    def _check_started(self) -> None:
        if not self._started:
            raise EngineError(f"engine {self.name} is not started; call start() first")

"""Engine `moe`: pwbench's own MoE runtime at full precision, behind the Engine protocol.

Glue only: it loads the checkpoint, sizes the paged KV cache, and each step turns the
scheduler's plan into one flat batch, runs the model, samples and updates sequences. The
parts live in engines/runtime/ (config, checkpoint, weights, experts, kv_cache, attention,
scheduler, sampling, transfer). Engines that change where or how experts are stored
subclass this and override `_build_experts`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

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
from engines.runtime.attention import AttentionBatch, DecodeGroup, PrefillSegment, group_by_length
from engines.runtime.checkpoint import Checkpoint, load_weights, open_checkpoint
from engines.runtime.kv_cache import PagedKVCache
from engines.runtime.model import ExpertFn, MoEModel
from engines.runtime.sampling import make_generator, sample
from engines.runtime.scheduler import Chunk, Scheduler, Sequence
from engines.runtime.transfer import TransferLedger
from engines.runtime.experts import grouped_swiglu
from engines.runtime.weights import DenseExperts, ExpertStore, ModelWeights, ResidentExpertStore

_CPU_KV_BYTES = 1 << 30


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


@dataclass
class _SeqState:
    generator: torch.Generator | None = None
    logits: list[torch.Tensor] = field(default_factory=list)
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # chunks, until the first token
    prompt_rows_done: int = 0  # prompt positions whose logits are collected (survives preemption)


class MoEEngine(Engine):
    name = "moe"
    config_cls = MoEEngineConfig

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
        self.checkpoint, self.weights, self.experts = self._load()
        mc = self.checkpoint.config
        self.kv = self._build_kv_cache()
        capacity = self.kv.allocator.num_blocks * cfg.block_size
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.model = MoEModel(mc, self.weights, self.experts, self.kv, self.ledger, self._expert_fn())
        self.scheduler = Scheduler(self.kv.allocator, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.kv_capacity_tokens = capacity
        self._aborted: list[str] = []
        self._num_requests = 0
        self.ledger.take_step()  # loading traffic is not part of any step
        self._started = True

    def stop(self) -> None:
        if self._started:
            self.scheduler.waiting.clear()
            self.scheduler.running.clear()
            del self.model, self.weights, self.experts, self.kv
            self._started = False

    # -- hooks for engines that store or compute experts differently --------------------------
    def _load(self) -> tuple[Checkpoint, ModelWeights, ExpertStore]:
        """Open the folder and load its weights (the device, dtype and ledger are set)."""
        checkpoint = open_checkpoint(self.config.model)
        weights, dense_experts = load_weights(checkpoint, self.device, self.dtype, self.ledger)
        return checkpoint, weights, self._build_experts(dense_experts)

    def _build_experts(self, dense: dict[int, DenseExperts]) -> ExpertStore:
        return ResidentExpertStore(dense)

    def _expert_fn(self) -> ExpertFn:
        return grouped_swiglu  # type: ignore[return-value]

    def _build_kv_cache(self) -> PagedKVCache:
        cfg, mc = self.config, self.checkpoint.config
        block_bytes = PagedKVCache.bytes_per_block(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim, self.dtype)
        if cfg.kv_cache_gb is not None:
            budget = int(cfg.kv_cache_gb * (1 << 30))
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - (1 - cfg.gpu_memory_utilization) * total)
        else:
            budget = _CPU_KV_BYTES
        # No point holding more blocks than max_num_seqs full-length sequences can use.
        most = cfg.max_num_seqs * -(-(cfg.max_model_len or mc.max_position_embeddings) // cfg.block_size)
        num_blocks = cfg.kv_blocks if cfg.kv_blocks is not None else min(budget // block_bytes, most)
        if num_blocks < 1:
            raise EngineError(
                f"KV cache budget of {budget / 2**20:.1f} MiB cannot hold one block of {block_bytes} bytes; "
                "raise kv_cache_gb or gpu_memory_utilization"
            )
        return PagedKVCache(
            mc.num_layers, num_blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim, self.dtype, self.device
        )

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
            )
        if any(s.id == request.request_id for s in self.scheduler.running + list(self.scheduler.waiting)):
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        state = _SeqState()
        if not request.sampling.greedy:
            seed = request.sampling.seed
            if seed is None:
                seed = self.config.seed * 1_000_003 + self._num_requests
            state.generator = make_generator(seed, self.device)
        self._num_requests += 1
        prompt = list(request.prompt_ids)
        self.scheduler.add(Sequence(request, prompt, len(prompt), state=state))

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
        chunks = plan.decodes + plan.prefills
        started = tuple(c.seq.id for c in plan.prefills if c.start == 0 and c.seq.num_generated == 0)
        expert_counts = self._run(chunks, len(plan.decodes), outputs) if chunks else {}
        moved = self.ledger.take_step()
        return StepOutput(
            outputs=tuple(outputs),
            started=started,
            num_prefill_tokens=sum(c.length for c in plan.prefills),
            num_decode_tokens=len(plan.decodes),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preempted=len(plan.preempted),
            experts_hit=sum(n > 0 for counts in expert_counts.values() for n in counts),
            context_tokens=sum(c.start + c.length for c in chunks),
            h2d_bytes=moved.h2d_bytes,
            d2h_bytes=moved.d2h_bytes,
            h2d_transfers=moved.h2d_transfers,
            d2h_transfers=moved.d2h_transfers,
        )

    def _run(self, chunks: list[Chunk], num_decode: int, outputs: list[RequestOutput]) -> dict[int, list[int]]:
        alloc, long = self.kv.allocator, torch.long
        # Decodes shortest context first, so attention can batch them in groups of similar length.
        chunks = sorted(chunks[:num_decode], key=lambda c: c.start) + chunks[num_decode:]
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []  # rows of the flat batch whose logits are computed
        sampled: list[tuple[Chunk, int]] = []  # chunk, index of its row in logit_rows
        prompt_rows: list[tuple[Chunk, int, int]] = []  # chunk, first and end index in logit_rows
        for c in chunks:
            row0 = len(token_ids)
            state = c.seq.state
            if c.seq.request.return_prompt_logits and state.prompt_rows_done < c.seq.num_prompt:
                lo = max(c.start, state.prompt_rows_done)
                hi = min(c.start + c.length, c.seq.num_prompt)
                if hi > lo:
                    prompt_rows.append((c, len(logit_rows), len(logit_rows) + hi - lo))
                    logit_rows += range(row0 + lo - c.start, row0 + hi - c.start)
                    state.prompt_rows_done = hi
            if c.samples:
                last = row0 + c.length - 1
                if not logit_rows or logit_rows[-1] != last:
                    logit_rows.append(last)
                sampled.append((c, len(logit_rows) - 1))
            token_ids += c.seq.token_ids[c.start : c.start + c.length]
            positions += range(c.start, c.start + c.length)
            slots += alloc.slots(c.seq.id, c.start, c.length)
        attn = self._attention_batch(chunks, num_decode, slots)
        result = self.model.forward(
            self.ledger.tensor(token_ids, long), self.ledger.tensor(positions, long), attn,
            self.ledger.tensor(logit_rows, long),
        )
        for c, lo, hi in prompt_rows:
            c.seq.state.prompt_logits.append(self.ledger.to_host(result.logits[lo:hi], "logits"))
        sample_logits = result.logits[[i for _, i in sampled]]
        params = [c.seq.request.sampling for c, _ in sampled]
        generators = [c.seq.state.generator for c, _ in sampled]
        # Copying the chosen ids back is the step's device sync: the work is done when it returns.
        new_tokens = self.ledger.to_host(sample(sample_logits, params, generators), "tokens").tolist()
        for c in chunks:
            c.seq.num_computed += c.length
        for (c, _), token, row in zip(sampled, new_tokens, sample_logits):
            outputs.append(self._append_token(c.seq, token, row))
        return result.expert_counts

    def _attention_batch(self, chunks: list[Chunk], num_decode: int, slots: list[int]) -> AttentionBatch:
        """Decode chunks come first in `chunks`; each later chunk is a prefill segment."""
        tables, tensor = self.kv.allocator.tables, self.ledger.tensor
        batch = AttentionBatch(slots=tensor(slots, torch.long), num_decode=num_decode)
        dec = [tables[c.seq.id] for c in chunks[:num_decode]]  # shortest first (see _run)
        for lo, hi in group_by_length([len(t) for t in dec]):
            width = max(len(t) for t in dec[lo:hi])
            batch.decodes.append(DecodeGroup(
                lo, tensor([t + [0] * (width - len(t)) for t in dec[lo:hi]], torch.long),
                tensor([c.start + 1 for c in chunks[lo:hi]], torch.long), self.kv.block_size,
            ))
        row = num_decode
        for c in chunks[num_decode:]:
            nb = self.kv.allocator.blocks_for(c.start + c.length)
            batch.prefills.append(PrefillSegment(row, c.length, c.start, tensor(tables[c.seq.id][:nb], torch.long)))
            row += c.length
        return batch

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
            weight_bytes=self.weights.nbytes() + self.experts.nbytes(),
            kv_cache_bytes=self.kv.nbytes(),
            kv_capacity_tokens=self.kv_capacity_tokens,
            config=dataclasses.asdict(self.config),
            model_stats=self._model_stats(),
        )

    def _model_stats(self) -> dict[str, float]:
        mc = self.checkpoint.config
        per_expert = 3 * mc.hidden_size * mc.moe_intermediate_size
        dense_bytes = self.weights.nbytes() - self.weights.embed.numel() * self.weights.embed.element_size()
        if mc.tie_word_embeddings:  # the LM head is read every step; the embedding rows barely
            dense_bytes += self.weights.lm_head.numel() * self.weights.lm_head.element_size()
        dense_params = dense_bytes // self.weights.embed.element_size()
        return {
            "dense_weight_bytes": dense_bytes,
            "bytes_per_expert": self.experts.nbytes() / max(1, sum(mc.moe_layers) * mc.num_experts),
            "active_params_per_token": dense_params + sum(mc.moe_layers) * mc.top_k * per_expert,
            "kv_bytes_per_token": PagedKVCache.bytes_per_block(mc.num_layers, 1, mc.num_kv_heads, mc.head_dim, self.dtype),
        }

    def _check_started(self) -> None:
        if not self._started:
            raise EngineError(f"engine {self.name} is not started; call start() first")

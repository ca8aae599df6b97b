"""Engine `hf`: transformers' own model class and generate(), static batches with left padding.

The reference users know. A batch of up to `max_batch_size` waiting requests is padded on
the left and handed to generate() in a worker thread; each step() returns the tokens of one
generate() iteration (received through a streamer), so the harness timestamps tokens as
they come, as it does for every engine. Requests join only when the whole batch is done —
that is what static batching costs. Per-request EOS and length limits are applied by a
stopping criterion, so generate() stops as soon as every row is finished.
Sampling uses one seed per batch (transformers draws from torch's global generator).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engines.base import (
    Engine,
    EngineError,
    EngineInfo,
    EngineRequest,
    InvalidRequestError,
    ModelLoadError,
    RequestOutput,
    StepOutput,
)
from engines.common.device import dtype_name, resolve_device, resolve_dtype
from engines.runtime.checkpoint import read_json


@dataclass(frozen=True)
class HFEngineConfig:
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    max_batch_size: int = 16
    attn_implementation: str = "sdpa"


@dataclass
class _Row:
    request: EngineRequest
    generated: int = 0
    done: bool = False


class HFEngine(Engine):
    name = "hf"
    config_cls = HFEngineConfig
    prompt_logits = True

    def __init__(self, config: HFEngineConfig) -> None:
        self.config = config
        self._started = False

    def start(self) -> None:
        cfg = self.config
        if cfg.model is None:
            raise EngineError("engine hf needs a model folder (--model DIR)")
        if cfg.max_batch_size < 1:
            raise EngineError(f"max_batch_size must be >= 1, got {cfg.max_batch_size}")
        root = Path(cfg.model).expanduser()
        if not root.is_dir():
            raise ModelLoadError(f"model folder {root} does not exist")
        if not (root / "config.json").is_file():
            raise ModelLoadError(f"{root} has no config.json; expected a Hugging Face model folder")
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        from transformers import AutoModelForCausalLM  # noqa: PLC0415  (heavy; only on this path)
        from transformers.utils import logging as hf_logging  # noqa: PLC0415

        hf_logging.disable_progress_bar()  # our CLI prints its own progress; keep stderr clean

        try:
            model, loading = AutoModelForCausalLM.from_pretrained(
                root, dtype=self.dtype, local_files_only=True, output_loading_info=True,
                attn_implementation=cfg.attn_implementation,
            )
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelLoadError(f"transformers cannot load {root}: {first}") from None
        # A checkpoint transformers only half understands (e.g. quantized experts) loads with
        # random weights and a warning; refuse it instead.
        bad = [k for key in ("missing_keys", "unexpected_keys", "mismatched_keys") for k in loading.get(key, [])]
        if bad:
            raise ModelLoadError(f"transformers loaded {root} with {len(bad)} missing or unexpected tensors "
                                 f"(first: {bad[0]})")
        self.model = model.to(self.device).eval()
        mc = self.model.config
        self.vocab_size = mc.vocab_size
        self.max_model_len = getattr(mc, "max_position_embeddings", 1 << 20)
        gen = read_json(root / "generation_config.json") if (root / "generation_config.json").is_file() else {}
        eos = gen.get("eos_token_id", mc.eos_token_id)
        self.eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        pad = gen.get("pad_token_id", mc.pad_token_id)
        self.pad_id = int(pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0))
        self._waiting: deque[EngineRequest] = deque()
        self._rows: list[_Row] = []
        self._events: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._prompt_tokens = 0
        self._aborted: set[str] = set()
        self._abort_outputs: list[RequestOutput] = []
        self._started = True

    def stop(self) -> None:
        if self._started:
            self._aborted.update(r.request.request_id for r in self._rows)
            if self._worker is not None:
                self._worker.join()
            self._started = False

    def add_request(self, request: EngineRequest) -> None:
        bad = next((t for t in request.prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"request {request.request_id}: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(request.prompt_ids) + request.max_new_tokens > self.max_model_len:
            raise InvalidRequestError(f"request {request.request_id}: longer than max_model_len {self.max_model_len}")
        self._waiting.append(request)

    def abort(self, request_id: str) -> None:
        before = len(self._waiting)
        self._waiting = deque(r for r in self._waiting if r.request_id != request_id)
        active = [r for r in self._rows if r.request.request_id == request_id and not r.done]
        for row in active:
            row.done = True  # emit nothing more for it
            self._aborted.add(request_id)  # and let the stopping criterion end the row
        if active or len(self._waiting) < before:
            self._abort_outputs.append(RequestOutput(request_id, finished=True, finish_reason="abort"))

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._worker is not None or self._abort_outputs)

    def step(self) -> StepOutput:
        outputs, self._abort_outputs = self._abort_outputs, []
        started: tuple[str, ...] = ()
        if self._worker is None and self._waiting:
            self._prompt_tokens = self._launch()
            started = tuple(r.request.request_id for r in self._rows)
        if self._worker is None:
            return StepOutput(outputs=tuple(outputs), num_waiting=len(self._waiting))
        kind, payload, extra = self._events.get()
        if kind == "error":
            self._worker.join()
            self._worker = None
            raise payload
        prefill, decode = 0, 0
        if kind == "tokens":
            # The first iteration of a batch is its prefill; later ones decode every live row.
            prefill, self._prompt_tokens = self._prompt_tokens, 0
            scores, prompt_logits = extra
            for i, (row, token) in enumerate(zip(self._rows, payload)):
                if row.done:
                    continue
                decode += 0 if prefill else 1
                logits = scores[i : i + 1] if scores is not None else None
                outputs.append(self._emit(row, token, logits, prompt_logits.get(i) if prefill else None))
        else:  # "done": generate() returned
            self._worker.join()
            self._worker = None
            self._rows = []
        running = sum(not r.done for r in self._rows)
        return StepOutput(
            outputs=tuple(outputs),
            started=started,
            num_prefill_tokens=prefill,
            num_decode_tokens=decode,
            num_running=running,
            num_waiting=len(self._waiting),
        )

    def _emit(self, row: _Row, token: int, logits: torch.Tensor | None,
              prompt_logits: torch.Tensor | None) -> RequestOutput:
        req = row.request
        row.generated += 1
        reason = None
        if not req.ignore_eos and token in self.eos_ids:
            reason = "stop"
        elif row.generated >= req.max_new_tokens:
            reason = "length"
        row.done = reason is not None
        return RequestOutput(
            req.request_id, (token,), row.done, reason, logits if req.return_logits else None, prompt_logits
        )

    def _launch(self) -> int:
        """Start generate() on the next batch of compatible waiting requests; returns prompt tokens."""
        first = self._waiting[0].sampling
        key = (first.temperature, first.top_p, first.top_k)
        batch: list[EngineRequest] = []
        while self._waiting and len(batch) < self.config.max_batch_size:
            s = self._waiting[0].sampling
            if (s.temperature, s.top_p, s.top_k) != key:
                break
            batch.append(self._waiting.popleft())
        self._rows = [_Row(r) for r in batch]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        self._events = queue.Queue()
        self._worker = threading.Thread(target=self._generate, args=(batch, ids, mask), daemon=True)
        self._worker.start()
        return int(mask.sum())

    def _generate(self, batch: list[EngineRequest], ids: torch.Tensor, mask: torch.Tensor) -> None:
        from transformers import (  # noqa: PLC0415
            GenerationConfig,
            LogitsProcessor,
            LogitsProcessorList,
            StoppingCriteria,
            StoppingCriteriaList,
        )

        events, want_logits = self._events, any(r.return_logits for r in batch)
        captured: list[torch.Tensor | None] = [None]
        width = ids.shape[1]
        eos = torch.tensor(self.eos_ids or (-1,))
        limits = torch.tensor([r.max_new_tokens for r in batch])
        stop_on_eos = torch.tensor([not r.ignore_eos for r in batch])
        ids_of = [r.request_id for r in batch]

        class Streamer:
            first = True

            def put(self, value: torch.Tensor) -> None:
                if self.first:  # generate() first puts the prompt
                    self.first = False
                    return
                events.put(("tokens", value.view(-1).tolist(), (captured[0], prompt_logits)))

            def end(self) -> None:
                pass

        class Capture(LogitsProcessor):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                captured[0] = scores.detach().float().cpu()
                return scores

        aborted = self._aborted

        class Finished(StoppingCriteria):
            """Per-row stop: EOS (unless ignore_eos), own max_new_tokens, or aborted.
            generate() keeps a row finished once it has been reported finished."""

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
                n = input_ids.shape[1] - width
                hit_eos = stop_on_eos & torch.isin(input_ids[:, -1].cpu(), eos)
                gone = torch.tensor([rid in aborted for rid in ids_of])
                return (hit_eos | (limits <= n) | gone).to(input_ids.device)

        s = batch[0].sampling
        gen_cfg = GenerationConfig(
            max_new_tokens=max(r.max_new_tokens for r in batch),
            do_sample=not s.greedy,
            temperature=s.temperature if not s.greedy else None,
            top_k=s.top_k if not s.greedy else None,
            top_p=s.top_p if not s.greedy else None,
            eos_token_id=None,
            pad_token_id=self.pad_id,
        )
        try:
            # Teacher-forced prompt logits come from a plain forward over each unpadded prompt.
            prompt_logits: dict[int, torch.Tensor] = {}
            with torch.inference_mode():
                for i, r in enumerate(batch):
                    if r.return_prompt_logits:
                        x = torch.tensor([r.prompt_ids], device=self.device)
                        prompt_logits[i] = self.model(input_ids=x).logits[0].float().cpu()
            if not s.greedy:
                torch.manual_seed(s.seed if s.seed is not None else 0)
            with torch.inference_mode():
                self.model.generate(
                    input_ids=ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    generation_config=gen_cfg,
                    streamer=Streamer(),
                    logits_processor=LogitsProcessorList([Capture()] if want_logits else []),
                    stopping_criteria=StoppingCriteriaList([Finished()]),
                )
            events.put(("done", None, None))
        except Exception as exc:  # noqa: BLE001  (surfaced by step() in the caller's thread)
            events.put(("error", exc, None))

    def info(self) -> EngineInfo:
        n_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return EngineInfo(
            name=self.name,
            model=str(self.config.model),
            architecture=getattr(self.model.config, "model_type", None),
            device=str(self.device),
            dtype=dtype_name(self.dtype),
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_ids,
            weight_bytes=n_bytes,
            config=dataclasses.asdict(self.config),
        )

"""A model-free engine with a parametric latency model, for fast and exact harness tests.

Each step admits waiting requests (up to `max_num_seqs`), prefills every new prompt whole
(emitting its first token) and decodes one token for every running request. It sleeps
    base_ms + prefill_ms_per_token * prefill_tokens + decode_ms_per_token * decode_tokens
so the harness measures known latencies. Tokens are a deterministic function of the prompt.
Tests may pass their own `sleep` (a simulated clock) to get exact timings. `fail_after_steps=N`
makes every step after the first N since start() (warm-up included) raise RuntimeError, to
test what a run does when its engine crashes mid-way.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from engines.base import (
    Engine,
    EngineInfo,
    EngineRequest,
    InvalidRequestError,
    RequestOutput,
    StepOutput,
)


@dataclass(frozen=True)
class DummyConfig:
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    base_ms: float = 0.0
    prefill_ms_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    max_num_seqs: int = 256
    vocab_size: int = 32000
    eos_token_id: int = 2
    max_model_len: int = 1 << 20
    fail_after_steps: int | None = None  # None: never; N: steps after the first N raise RuntimeError


@dataclass
class _Running:
    request: EngineRequest
    prompt_sum: int  # the only thing the tokens need from the prompt: read once, at add_request
    generated: int = 0


class DummyEngine(Engine):
    name = "dummy"
    config_cls = DummyConfig
    needs_model = False

    def __init__(self, config: DummyConfig, sleep: Callable[[float], None] = time.sleep) -> None:
        self.config, self._sleep = config, sleep
        self._waiting: deque[tuple[EngineRequest, int]] = deque()  # (request, its prompt's sum)
        self._running: dict[str, _Running] = {}
        self._aborted: list[str] = []
        self._steps = 0

    def start(self) -> None:
        self._steps = 0

    def stop(self) -> None:
        self._waiting.clear()
        self._running.clear()

    def add_request(self, request: EngineRequest) -> None:
        if request.return_logits or request.return_prompt_logits:
            raise InvalidRequestError(f"request {request.request_id}: engine dummy has no model and returns no logits")
        # The prompt is read once, here: queued requests keep only its sum (a harness prompt may
        # be synthesized on each read, and thousands of rag_long prompts are ~100 MB as ints).
        ids = list(request.prompt_ids)  # a temporary list; no numpy, so the dummy stays light
        if ids and (min(ids) < 0 or max(ids) >= self.config.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.config.vocab_size)
            raise InvalidRequestError(
                f"request {request.request_id}: token id {bad} is outside the vocabulary [0, {self.config.vocab_size})"
            )
        self._waiting.append((request, sum(ids)))

    def abort(self, request_id: str) -> None:
        waiting = deque(w for w in self._waiting if w[0].request_id != request_id)
        known = len(waiting) < len(self._waiting) or request_id in self._running
        self._waiting = waiting
        self._running.pop(request_id, None)
        if known:
            self._aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._aborted)

    def _token(self, run: _Running) -> int:
        # Never EOS, so outputs have exactly max_new_tokens tokens unless a test asks otherwise.
        token = (run.prompt_sum * 31 + run.generated * 7 + 3) % self.config.vocab_size
        return token + 1 if token == self.config.eos_token_id else token

    def step(self) -> StepOutput:
        cfg = self.config
        self._steps += 1
        if cfg.fail_after_steps is not None and self._steps > cfg.fail_after_steps:
            raise RuntimeError(f"dummy engine: injected failure in step {self._steps} "
                               f"(fail_after_steps={cfg.fail_after_steps})")
        outputs = [RequestOutput(rid, finished=True, finish_reason="abort") for rid in self._aborted]
        self._aborted = []
        decode_ids = list(self._running)
        prefill_tokens = 0
        started = []
        while self._waiting and len(self._running) < cfg.max_num_seqs:
            request, prompt_sum = self._waiting.popleft()
            self._running[request.request_id] = _Running(request, prompt_sum)
            prefill_tokens += len(request.prompt_ids)
            started.append(request.request_id)
        delay_ms = cfg.base_ms + cfg.prefill_ms_per_token * prefill_tokens
        delay_ms += cfg.decode_ms_per_token * len(decode_ids)
        if delay_ms > 0:
            self._sleep(delay_ms / 1e3)
        for rid in list(self._running):
            run = self._running[rid]
            token = self._token(run)
            run.generated += 1
            done = run.generated >= run.request.max_new_tokens
            if done:
                del self._running[rid]
            outputs.append(RequestOutput(rid, (token,), done, "length" if done else None))
        return StepOutput(
            outputs=tuple(outputs),
            started=tuple(started),
            num_prefill_tokens=prefill_tokens,
            num_decode_tokens=len(decode_ids),
            num_running=len(self._running),
            num_waiting=len(self._waiting),
        )

    def info(self) -> EngineInfo:
        return EngineInfo(
            name=self.name,
            model=None,
            architecture=None,
            device="none",
            dtype="none",
            vocab_size=self.config.vocab_size,
            max_model_len=self.config.max_model_len,
            eos_token_ids=(self.config.eos_token_id,),
            config=asdict(self.config),
        )

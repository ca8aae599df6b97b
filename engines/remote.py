"""Engine `openai`: any OpenAI-compatible server (vLLM, SGLang, TGI, `pwbench serve`) behind
the step protocol.

Every request is one streamed POST to /v1/completions (token-id prompts by default, or
decoded text) or /v1/chat/completions, made from one asyncio loop in a background thread
with a pooled aiohttp session, so hundreds can be in flight. Each token is timed when its
chunk arrives (`RequestOutput.token_times`, perf_counter's clock); `step()` only waits a
few milliseconds for chunks and hands over what came. Token ids come from the server's
`token_ids` (vLLM's `return_token_ids`), else from the local tokenizer over the chunk's
text; the server's usage counts are checked against them. Transfers, memory and expert
metrics are unavailable from a client and say so in EngineInfo.unavailable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.base import (
    Engine,
    EngineError,
    EngineInfo,
    EngineRequest,
    InvalidRequestError,
    RequestOutput,
    StepOutput,
    unseen_metrics,
)

FIXED_LENGTH = ("ignore_eos", "min_tokens", "both", "none")


@dataclass(frozen=True)
class OpenAIEngineConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    served_model: str | None = None  # the name the server knows; None: the first of /v1/models
    model: str | None = None  # local folder (tokenizer, vocabulary, context, EOS); optional
    api_key_env: str | None = None  # name of the environment variable that holds the API key
    endpoint: str = "completions"  # completions | chat
    token_ids: bool = True  # completions: send prompts as token ids (false: as decoded text)
    fixed_length: str = "ignore_eos"  # how fixed output lengths are asked for: ignore_eos | min_tokens | both | none
    max_connections: int = 2048
    timeout_s: float = 600.0
    vocab_size: int | None = None  # None: the folder's, else the server's (pwbench serve), else 32000
    max_model_len: int | None = None  # None: the folder's, else the server's max_model_len, else 4096
    poll_ms: float = 2.0  # longest a step waits for chunks


@dataclass
class _Live:
    request: EngineRequest
    count: int = 0
    usage: int | None = None


class OpenAIEngine(Engine):
    name = "openai"
    config_cls = OpenAIEngineConfig
    needs_model = False

    def __init__(self, config: OpenAIEngineConfig) -> None:
        if config.endpoint not in ("completions", "chat"):
            raise EngineError(f"engine openai option 'endpoint' must be completions or chat, got {config.endpoint!r}")
        if config.fixed_length not in FIXED_LENGTH:
            raise EngineError(f"engine openai option 'fixed_length' must be one of {', '.join(FIXED_LENGTH)}, "
                              f"got {config.fixed_length!r}")
        self.config = config
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._events: list[tuple[str, str, Any]] = []
        self._live: dict[str, _Live] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats = {"requests": 0, "fixed": 0, "fixed_off": 0, "usage_off": 0, "ids_from_text": 0, "tokens": 0}

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.config
        self._tokenizer, folder = None, {}
        if cfg.model is not None:
            from engines.common.tokenizer import load_tokenizer  # noqa: PLC0415

            path = Path(cfg.model).expanduser()
            if not path.is_dir():
                raise EngineError("engine openai option 'model' is a local folder for the tokenizer; "
                                  f"{path} is not one")
            self._tokenizer = load_tokenizer(path)
            if (path / "config.json").is_file():
                folder = json.loads((path / "config.json").read_text())
        needs_text = cfg.endpoint == "chat" or not cfg.token_ids
        if needs_text and self._tokenizer is None:
            raise EngineError("engine openai sends text prompts here (endpoint=chat or token_ids=false): give a model "
                              "folder with tokenizer.json (--model DIR)")
        self._headers = {"Content-Type": "application/json"}
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise EngineError(f"engine openai: environment variable {cfg.api_key_env} (api_key_env) is not set")
            self._headers["Authorization"] = f"Bearer {key}"
        self._thread = threading.Thread(target=self._run_loop, name="pwbench-openai", daemon=True)
        ready = threading.Event()
        self._thread_ready = ready
        self._thread.start()
        ready.wait()
        self._call(self._open())
        try:
            served = self._call(self._get_models())
        except BaseException:
            self.stop()
            raise
        names = [m.get("id") for m in served]
        model_name = cfg.served_model or (names[0] if names else None)
        if model_name is None:
            raise EngineError(f"{cfg.base_url}/models lists no model; set --set served_model=NAME")
        self._served = model_name
        entry = next((m for m in served if m.get("id") == model_name), {})
        eos = folder.get("eos_token_id")
        self._eos = tuple(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
        # pwbench serve lists its vocabulary beside max_model_len (vLLM lists max_model_len only).
        self._vocab = (cfg.vocab_size or folder.get("vocab_size") or entry.get("vocab_size")
                       or (self._tokenizer.get_vocab_size() if self._tokenizer else 32000))
        self._max_len = (cfg.max_model_len or folder.get("max_position_embeddings") or entry.get("max_model_len")
                         or 4096)
        if entry.get("max_model_len"):
            self._max_len = min(self._max_len, int(entry["max_model_len"]))
        self._cpu0 = self._cpu_prev = self._client_cpu_s()

    def stop(self) -> None:
        if self._loop is None:
            return
        for rid in list(self._tasks):
            self.abort(rid)
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop = None

    def _run_loop(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._thread_ready.set()
        loop.run_forever()
        loop.close()

    async def _open(self) -> None:
        import aiohttp  # noqa: PLC0415

        limit = self.config.max_connections
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, limit_per_host=limit),
                                              timeout=aiohttp.ClientTimeout(total=self.config.timeout_s),
                                              headers=self._headers)
        self._client_errors = (aiohttp.ClientError, asyncio.TimeoutError)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self.config.timeout_s)

    async def _close(self) -> None:
        await self._session.close()

    async def _get_models(self) -> list[dict[str, Any]]:
        url = f"{self.config.base_url.rstrip('/')}/models"
        try:
            async with self._session.get(url) as resp:
                if resp.status != 200:
                    raise EngineError(f"{url} answered HTTP {resp.status}: {_message(await resp.text())}")
                return list((await resp.json()).get("data") or [])
        except self._client_errors as exc:
            raise EngineError(f"cannot reach {url}: {exc or type(exc).__name__}; is the server running "
                              "(--set base_url=http://HOST:PORT/v1)?") from None

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        if self._loop is None:
            raise EngineError("engine openai is not started; call start() first")
        if request.return_logits or request.return_prompt_logits:
            raise InvalidRequestError(f"request {request.request_id}: engine openai returns no logits")
        bad = next((t for t in request.prompt_ids if not 0 <= t < self._vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"request {request.request_id}: token id {bad} is outside the vocabulary "
                                      f"[0, {self._vocab})")
        total = len(request.prompt_ids) + request.max_new_tokens
        if total > self._max_len:
            raise InvalidRequestError(f"request {request.request_id}: prompt ({len(request.prompt_ids)}) + "
                                      f"max_new_tokens ({request.max_new_tokens}) = {total} tokens exceeds the "
                                      f"server's context of {self._max_len}")
        if request.request_id in self._live:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        self._live[request.request_id] = _Live(request)
        self._stats["requests"] += 1
        self._stats["fixed"] += request.ignore_eos
        body = self._body(request)
        self._loop.call_soon_threadsafe(self._spawn, request.request_id, body)

    def _body(self, request: EngineRequest) -> dict[str, Any]:
        cfg, s = self.config, request.sampling
        body: dict[str, Any] = {"model": self._served, "max_tokens": request.max_new_tokens, "stream": True,
                                "stream_options": {"include_usage": True}, "temperature": s.temperature,
                                "top_p": s.top_p, "return_token_ids": True}
        if s.top_k:
            body["top_k"] = s.top_k
        if s.seed is not None:
            body["seed"] = s.seed
        if request.ignore_eos and cfg.fixed_length in ("ignore_eos", "both"):
            body["ignore_eos"] = True
        if request.ignore_eos and cfg.fixed_length in ("min_tokens", "both"):
            body["min_tokens"] = request.max_new_tokens
        if cfg.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": self._tokenizer.decode(list(request.prompt_ids))}]
        else:
            body["prompt"] = (list(request.prompt_ids) if cfg.token_ids
                              else self._tokenizer.decode(list(request.prompt_ids)))
        return body

    def _spawn(self, rid: str, body: dict[str, Any]) -> None:
        self._tasks[rid] = asyncio.ensure_future(self._stream(rid, body))

    def _push(self, rid: str, kind: str, value: Any) -> None:
        with self._lock:
            self._events.append((rid, kind, value))
        self._wake.set()

    async def _stream(self, rid: str, body: dict[str, Any]) -> None:
        url = (f"{self.config.base_url.rstrip('/')}/"
               f"{'chat/completions' if self.config.endpoint == 'chat' else 'completions'}")
        chat = self.config.endpoint == "chat"
        try:
            async with self._session.post(url, data=json.dumps(body)) as resp:
                if resp.status != 200:
                    self._push(rid, "error", f"HTTP {resp.status}: {_message(await resp.text())}")
                    return
                finish = None
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if "error" in obj:
                        self._push(rid, "error", _message(json.dumps(obj)))
                        return
                    if obj.get("usage"):
                        self._push(rid, "usage", obj["usage"].get("completion_tokens"))
                    for choice in obj.get("choices") or ():
                        ids = choice.get("token_ids")
                        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                        if ids is None and text:
                            ids = self._ids_from_text(text)
                        if ids:
                            self._push(rid, "tokens", (tuple(ids), now))
                        finish = choice.get("finish_reason") or finish
                self._push(rid, "finish", finish or "length")
        except asyncio.CancelledError:
            self._push(rid, "finish", "abort")
        except self._client_errors as exc:
            self._push(rid, "error", f"{type(exc).__name__}: {exc}")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a malformed stream
            self._push(rid, "error", f"malformed response from {url}: {type(exc).__name__}: {exc}")
        finally:
            self._tasks.pop(rid, None)

    def _ids_from_text(self, text: str) -> list[int]:
        self._stats["ids_from_text"] += 1
        if self._tokenizer is None:
            return [-1]  # one token per chunk, id unknown (no local tokenizer)
        return self._tokenizer.encode(text, add_special_tokens=False).ids or [-1]

    def abort(self, request_id: str) -> None:
        if self._loop is not None and request_id in self._live:
            self._loop.call_soon_threadsafe(self._cancel, request_id)

    def _cancel(self, rid: str) -> None:
        task = self._tasks.get(rid)
        if task is not None:
            task.cancel()

    def has_unfinished(self) -> bool:
        return bool(self._live)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> StepOutput:
        if not self._events:
            self._wake.wait(self.config.poll_ms / 1e3)
        with self._lock:
            events, self._events = self._events, []
            self._wake.clear()
        cpu = self._client_cpu_s()
        tokens: dict[str, tuple[list[int], list[float]]] = {}
        finished: dict[str, tuple[str, str | None]] = {}
        for rid, kind, value in events:
            live = self._live.get(rid)
            if live is None:
                continue
            if kind == "tokens":
                ids, t = value
                got = tokens.setdefault(rid, ([], []))
                got[0].extend(ids)
                got[1].extend(t for _ in ids)
                live.count += len(ids)
            elif kind == "usage":
                live.usage = value
            elif kind == "finish":
                finished[rid] = (value, None)
            else:
                finished[rid] = ("error", value)
        outputs = []
        for rid in dict.fromkeys([*tokens, *finished]):
            ids, times = tokens.get(rid, ([], []))
            reason, error = finished.get(rid, (None, None))
            if reason is not None:
                self._check_lengths(self._live.pop(rid), reason)
            outputs.append(RequestOutput(rid, tuple(ids), reason is not None, reason, token_times=tuple(times),
                                         error=error))
        self._stats["tokens"] += sum(len(ids) for ids, _ in tokens.values())
        running = len(self._live)
        self._cpu_prev, spent = cpu, cpu - self._cpu_prev
        return StepOutput(outputs=tuple(outputs), num_running=running, extras={"client_cpu_s": spent})

    def _check_lengths(self, live: _Live, reason: str) -> None:
        if reason in ("abort", "error"):
            return
        if live.request.ignore_eos and live.count != live.request.max_new_tokens:
            self._stats["fixed_off"] += 1
        if live.usage is not None and live.usage != live.count:
            self._stats["usage_off"] += 1

    def _client_cpu_s(self) -> float:
        """CPU seconds the network thread has used (it parses every chunk)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))
        except (AttributeError, OSError, TypeError):
            return 0.0

    # -- what the run is told -------------------------------------------------------------------
    def notes(self) -> list[str]:
        s, out = self._stats, []
        if s["fixed_off"]:
            out.append(f"{s['fixed_off']} of {s['fixed']} fixed-length requests came back with another length: the "
                       f"server ignored fixed_length={self.config.fixed_length} (try --set fixed_length=min_tokens or "
                       "both); requests.parquet has the actual lengths")
        if s["usage_off"]:
            out.append(f"{s['usage_off']} requests: the server's usage.completion_tokens differs from the tokens "
                       "counted in its stream" + (" (ids re-tokenized from text)" if s["ids_from_text"] else ""))
        if s["ids_from_text"]:
            out.append("the server sent no token ids (return_token_ids): ids were re-tokenized from the streamed text"
                       + ("" if self._tokenizer is not None else " and, with no local tokenizer, are unknown (-1)"))
        cpu = self._client_cpu_s() - self._cpu0
        if s["tokens"]:
            out.append(f"client overhead: its network thread used {cpu:.2f} s of CPU for {s['tokens']} streamed "
                       f"tokens ({cpu / s['tokens'] * 1e6:.0f} us per token)")
        return out

    def info(self) -> EngineInfo:
        return EngineInfo(
            name=self.name, model=self.config.model or self._served, architecture=None, device="remote",
            dtype="unknown", vocab_size=self._vocab, max_model_len=self._max_len, eos_token_ids=self._eos,
            config={**dataclasses.asdict(self.config), "served_model": self._served},
            unavailable=unseen_metrics("remote server (see its own /metrics)"),
        )


def _message(text: str) -> str:
    """The message of an OpenAI-style error body, else the text itself (one line, shortened)."""
    try:
        err = json.loads(text).get("error")
        text = err.get("message", text) if isinstance(err, dict) else str(err or text)
    except (ValueError, AttributeError):
        pass
    return " ".join(text.split())[:300]

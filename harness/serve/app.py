"""The ASGI app: OpenAI completions and chat completions (SSE streaming or not), /v1/models,
/health and /metrics, around one started engine.

Each request is read up to `max_body_bytes` (413 beyond, from Content-Length or while
reading), checked (protocol.py; large bodies off the loop), given to the engine thread
(worker.py) and answered from its queue. A client that goes away mid-request has its request
aborted at once. With an API key every route but /health needs `Authorization: Bearer KEY`
(401 otherwise, nothing runs). `drain()` (on SIGTERM) refuses new requests and lets those in
flight finish, or ends them with `[DONE]`. Limits, states and metrics: docs/serving.md.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engines.base import Engine, EngineRequest, RequestOutput, SamplingParams
from harness.serve.prom import ServerMetrics
from harness.serve.protocol import (
    SSE_DONE,
    ApiError,
    GenParams,
    Limits,
    chunk,
    parse_body,
    parse_request,
    response,
    usage_chunk,
)
from harness.serve.worker import OK, Admitted, EngineWorker, Failed, QueueFull, Unavailable

# Bodies above this are parsed and tokenized on a thread, so one large prompt does not stall
# every other client's stream on the event loop.
PARSE_INLINE_BYTES = 64 * 1024


@dataclass(frozen=True)
class ServeOptions:
    model_name: str = ""
    api_key: str | None = None
    max_queue: int = 256
    retry_after_s: int = 1
    max_body_bytes: int = 2 * 2**20
    max_restarts: int = 3
    restart_backoff_s: float = 1.0


class _Disconnected(Exception):
    pass


class _Server:
    def __init__(self, engine: Engine, tokenizer: Any, options: ServeOptions) -> None:
        info = engine.info()
        limit = min(info.max_model_len, info.kv_capacity_tokens) if info.kv_capacity_tokens else info.max_model_len
        self.engine, self.tokenizer, self.options = engine, tokenizer, options
        self.limits = Limits(options.model_name, info.vocab_size, limit)
        self.metrics = ServerMetrics(info)
        self.worker: EngineWorker | None = None
        self._ids = itertools.count()
        self.inflight: set[str] = set()  # submitted, response not yet over
        self.ending: set[str] = set()  # aborted by the drain: their answers end with finish_reason "abort"
        self.draining = False
        self.fatal = False  # the engine failed past --max-restarts: the process exits non-zero

    # -- lifecycle ------------------------------------------------------------------------------
    async def startup(self) -> None:
        o = self.options
        self.worker = EngineWorker(self.engine, asyncio.get_running_loop(), o.max_queue,
                                   on_step=self.metrics.observe_step, max_restarts=o.max_restarts,
                                   restart_backoff_s=o.restart_backoff_s, on_failure=self._on_failure,
                                   on_fatal=self._on_fatal)
        self.worker.start()

    async def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def _on_failure(self, restarting: bool) -> None:
        if restarting:
            self.metrics.restarts.inc()

    def _on_fatal(self) -> None:
        self.fatal = True

    async def drain(self, timeout_s: float, forced: Callable[[], bool] = lambda: False) -> None:
        """Refuse new requests (503), wait up to `timeout_s` for those in flight, then abort
        the rest so each answer ends (finish_reason "abort", `[DONE]` for streams)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        for limit_s, abort in ((timeout_s, False), (5.0, True)):
            if abort and self.worker is not None:
                for rid in list(self.inflight):
                    self.ending.add(rid)
                    self.worker.abort(rid)
            deadline = loop.time() + limit_s
            while self.inflight and loop.time() < deadline and not forced():
                await asyncio.sleep(0.05)

    # -- routes ---------------------------------------------------------------------------------
    def key_ok(self, scope: Any) -> bool:
        key = self.options.api_key
        if key is None or scope.get("path") == "/health":
            return True
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        token = given[7:] if given[:7].lower() == b"bearer " else b""
        return hmac.compare_digest(token, key.encode())

    def _admitting(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down; send the request to another replica",
                           kind="server_error", headers={"Connection": "close"})
        assert self.worker is not None
        if self.worker.status != OK:
            raise ApiError(503, self.worker.unavailable_reason(), kind="server_error")

    async def health(self, request: Request) -> Response:
        worker = self.worker
        status = "draining" if self.draining and worker is not None and worker.status == OK else (
            worker.status if worker is not None else "starting")
        body: dict[str, Any] = {"status": status, "restarts": worker.restarts if worker else 0,
                                "max_restarts": self.options.max_restarts}
        if worker is not None and worker.last_error:
            body["last_error"] = worker.last_error
        return JSONResponse(body, status_code=200 if status == OK else 503)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.options.model_name, "object": "model", "created": 0, "owned_by": "pwbench",
            "max_model_len": self.limits.max_model_len, "vocab_size": self.limits.vocab_size}]})

    async def prometheus(self, request: Request) -> Response:
        up = self.worker is not None and self.worker.status == OK and not self.draining
        self.metrics.engine_up.set(1 if up else 0)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed the limit: from
        Content-Length before a byte is read, else while reading (chunked). The unread rest is
        discarded by the server as it arrives, so the client still gets this answer."""
        limit = self.options.max_body_bytes
        over = ApiError(413, f"request body exceeds {limit} bytes (--max-body-bytes)", code="body_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise over
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise over
            parts.append(part)
        return b"".join(parts)

    def _parse(self, raw: bytes, chat: bool) -> GenParams:
        return parse_request(parse_body(raw), chat, self.tokenizer, self.limits)

    async def _generate(self, request: Request, chat: bool) -> Response:
        self._admitting()
        raw = await self._read_body(request)
        if len(raw) > PARSE_INLINE_BYTES:
            params = await asyncio.to_thread(self._parse, raw, chat)
        else:
            params = self._parse(raw, chat)
        self._admitting()
        worker = self.worker
        assert worker is not None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
        engine_request = EngineRequest(rid, params.prompt_ids, params.max_tokens,
                                       SamplingParams(params.temperature, params.top_p, params.top_k, params.seed),
                                       ignore_eos=params.ignore_eos)
        try:
            queue = worker.submit(engine_request)
        except QueueFull as exc:
            raise ApiError(429, f"{exc}; retry later", kind="rate_limit_error") from None
        except Unavailable as exc:
            raise ApiError(503, str(exc), kind="server_error") from None
        self.inflight.add(rid)
        try:
            first = await queue.get()
        except BaseException:
            worker.abort(rid)
            self._done(rid)
            raise
        if isinstance(first, Failed):
            self._done(rid)
            raise ApiError(first.status, first.message, kind="server_error" if first.status >= 500 else
                           "invalid_request_error")
        assert isinstance(first, Admitted)
        self.metrics.prompt_tokens.inc(len(params.prompt_ids))
        exchange = _Exchange(self, rid, params, queue)
        if params.stream:
            return _SSEResponse(exchange)
        return _WholeResponse(exchange)

    def _done(self, rid: str) -> None:
        assert self.worker is not None
        self.worker.forget(rid)
        self.inflight.discard(rid)
        self.ending.discard(rid)


class _Exchange:
    """One admitted request: its outputs, decoded to text as they come."""

    def __init__(self, server: _Server, rid: str, params: GenParams, queue: asyncio.Queue) -> None:
        self.server, self.rid, self.params, self.queue = server, rid, params, queue
        self.ids: list[int] = []
        self.text = ""
        self.finish: str | None = None

    def _delta(self, new: tuple[int, ...]) -> str:
        self.ids.extend(new)
        tok = self.server.tokenizer
        if tok is None:
            return ""
        text = tok.decode(self.ids)
        # Word-level and BPE decoders may rewrite earlier characters (spacing); send what is new.
        delta = text[len(self.text):] if text.startswith(self.text) else text
        self.text = text
        return delta

    async def outputs(self) -> AsyncIterator[tuple[str, tuple[int, ...], str | None]]:
        """(text delta, new ids, finish reason) per engine output until the request ends."""
        while True:
            event = await self.queue.get()
            if isinstance(event, Failed):
                raise ApiError(event.status, event.message, kind="server_error")
            assert isinstance(event, RequestOutput)
            if event.finished and event.finish_reason == "abort":
                if self.rid not in self.server.ending:
                    raise _Disconnected
                self.finish = "abort"  # ended by the drain: the client gets a whole, final answer
                yield "", (), self.finish
                return
            delta = self._delta(event.new_token_ids)
            if event.finished:
                self.finish = event.finish_reason
            yield delta, event.new_token_ids, self.finish
            if event.finished:
                return

    def abort(self) -> None:
        self.server.worker.abort(self.rid)

    def close(self) -> None:
        self.server._done(self.rid)


async def _watch_disconnect(receive: Any, exchange: _Exchange) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            exchange.abort()
            return


class _SSEResponse:
    """Server-sent events: one chunk per engine output, then usage (if asked) and [DONE]."""

    def __init__(self, exchange: _Exchange) -> None:
        self.exchange = exchange

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        ex, model = self.exchange, self.exchange.server.options.model_name
        watcher = asyncio.create_task(_watch_disconnect(receive, ex))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]})
            first = True
            try:
                async for delta, ids, finish in ex.outputs():
                    await send({"type": "http.response.body", "more_body": True,
                                "body": chunk(ex.rid, ex.params, model, delta, list(ids), finish, first)})
                    first = False
            except ApiError as exc:  # the engine failed mid-stream: say so in the stream
                ex.server.metrics.count_error(exc.status)
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"data: " + exc.render() + b"\n\n"})
            if ex.params.include_usage:
                await send({"type": "http.response.body", "more_body": True,
                            "body": usage_chunk(ex.rid, ex.params, model, len(ex.ids))})
            await send({"type": "http.response.body", "body": SSE_DONE, "more_body": False})
        except (_Disconnected, OSError):
            ex.abort()
        finally:
            watcher.cancel()
            if ex.finish is None:
                ex.abort()
            ex.close()


class _WholeResponse:
    """The whole answer as one JSON object, once the request has finished."""

    def __init__(self, exchange: _Exchange) -> None:
        self.exchange = exchange

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        ex = self.exchange
        watcher = asyncio.create_task(_watch_disconnect(receive, ex))
        try:
            async for _ in ex.outputs():
                pass
            body = response(ex.rid, ex.params, ex.server.options.model_name, ex.text, ex.ids, ex.finish or "length")
            await JSONResponse(body)(scope, receive, send)
        except ApiError as exc:
            ex.server.metrics.count_error(exc.status)
            await _error_response(exc)(scope, receive, send)
        except (_Disconnected, OSError):
            pass
        finally:
            watcher.cancel()
            if ex.finish is None:
                ex.abort()
            ex.close()


def _error_response(exc: ApiError) -> Response:
    headers = dict(exc.headers)
    if exc.status in (429, 503):
        headers.setdefault("Retry-After", "1")
    return Response(exc.render(), status_code=exc.status, headers=headers, media_type="application/json")


class _Auth:
    """With an API key, every route but /health answers 401 without it, before routing (so
    unknown paths and wrong methods do not tell a stranger which routes exist)."""

    def __init__(self, app: Any, server: _Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not self.server.key_ok(scope):
            self.server.metrics.count_error(401)
            error = ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>", code="invalid_api_key")
            await _error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(engine: Engine, tokenizer: Any, options: ServeOptions) -> Any:
    """The ASGI app around a started engine; the engine thread starts with the app (lifespan).
    `app.server` is the _Server (drain, fatal, metrics)."""
    server = _Server(engine, tokenizer, options)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        server.metrics.count_error(exc.status)
        return _error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = (f"no route {request.url.path}; see /v1/completions, /v1/chat/completions, /v1/models, /health, "
                   "/metrics") if exc.status_code == 404 else f"{exc.detail} for {request.method} {request.url.path}"
        return await api_error(request, ApiError(exc.status_code, message))

    async def server_error(request: Request, exc: Exception) -> Response:
        server.metrics.count_error(500)
        return _error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error"))

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await server.startup()
        try:
            yield
        finally:
            await server.shutdown()

    inner = Starlette(routes=[
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
    ], exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error},
        lifespan=lifespan)
    app = _Auth(inner, server)
    app.server = server  # type: ignore[attr-defined]
    return app

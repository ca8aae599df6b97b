"""The ASGI app: OpenAI completions and chat completions (SSE streaming or not), /v1/models,
/health and /metrics, around one started engine.

Each request is checked (protocol.py), given to the engine thread (worker.py) and answered
from its queue. A client that goes away mid-request has its request aborted at once: a
watcher reads the ASGI channel for `http.disconnect` while the answer is produced. With an
API key every route but /health needs `Authorization: Bearer KEY` (401 otherwise, nothing
runs); the key is compared in constant time and never printed.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
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
from harness.serve.worker import Admitted, EngineWorker, Failed, QueueFull


@dataclass(frozen=True)
class ServeOptions:
    model_name: str
    api_key: str | None = None
    max_queue: int = 256
    retry_after_s: int = 1


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

    # -- lifecycle ------------------------------------------------------------------------------
    async def startup(self) -> None:
        self.worker = EngineWorker(self.engine, asyncio.get_running_loop(), self.options.max_queue,
                                   on_step=self.metrics.observe_step)
        self.worker.start()

    async def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    # -- routes ---------------------------------------------------------------------------------
    def _check_key(self, request: Request) -> None:
        key = self.options.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>", code="invalid_api_key")

    async def health(self, request: Request) -> Response:
        if self.worker is not None and self.worker.failed:
            return JSONResponse({"status": "failed", "error": self.worker.failed}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        self._check_key(request)
        return JSONResponse({"object": "list", "data": [{
            "id": self.options.model_name, "object": "model", "created": 0, "owned_by": "pwbench",
            "max_model_len": self.limits.max_model_len, "vocab_size": self.limits.vocab_size}]})

    async def prometheus(self, request: Request) -> Response:
        self._check_key(request)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        self._check_key(request)
        params = parse_request(parse_body(await request.body()), chat, self.tokenizer, self.limits)
        worker = self.worker
        assert worker is not None
        if worker.failed:
            raise ApiError(503, worker.failed, kind="server_error")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}"
        engine_request = EngineRequest(rid, params.prompt_ids, params.max_tokens,
                                       SamplingParams(params.temperature, params.top_p, params.top_k, params.seed),
                                       ignore_eos=params.ignore_eos)
        try:
            queue = worker.submit(engine_request)
        except QueueFull as exc:
            raise ApiError(429, f"{exc}; retry later", kind="rate_limit_error") from None
        try:
            first = await queue.get()
        except BaseException:
            worker.abort(rid)
            worker.forget(rid)
            raise
        if isinstance(first, Failed):
            worker.forget(rid)
            raise ApiError(first.status, first.message, kind="server_error" if first.status >= 500 else
                           "invalid_request_error")
        assert isinstance(first, Admitted)
        self.metrics.prompt_tokens.inc(len(params.prompt_ids))
        exchange = _Exchange(self, rid, params, queue)
        if params.stream:
            return _SSEResponse(exchange)
        return _WholeResponse(exchange)


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
                raise _Disconnected
            delta = self._delta(event.new_token_ids)
            if event.finished:
                self.finish = event.finish_reason
            yield delta, event.new_token_ids, self.finish
            if event.finished:
                return

    def abort(self) -> None:
        self.server.worker.abort(self.rid)

    def close(self) -> None:
        self.server.worker.forget(self.rid)


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
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"data: " + json.dumps(exc.body()).encode() + b"\n\n"})
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
            await _error_response(exc)(scope, receive, send)
        except (_Disconnected, OSError):
            pass
        finally:
            watcher.cancel()
            if ex.finish is None:
                ex.abort()
            ex.close()


def _error_response(exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error_response(exc)


async def _server_error(request: Request, exc: Exception) -> Response:
    return _error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error"))


def create_app(engine: Engine, tokenizer: Any, options: ServeOptions) -> Starlette:
    """The app around a started engine; the engine thread starts with the app (lifespan)."""
    server = _Server(engine, tokenizer, options)

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error_response(ApiError(404, f"no route {request.url.path}; see /v1/completions, "
                                        "/v1/chat/completions, /v1/models, /health, /metrics"))

    from contextlib import asynccontextmanager  # noqa: PLC0415

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await server.startup()
        try:
            yield
        finally:
            await server.shutdown()

    app = Starlette(routes=[
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
    ], exception_handlers={ApiError: _api_error, 404: not_found, Exception: _server_error}, lifespan=lifespan)
    app.state.server = server
    return app

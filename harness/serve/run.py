"""Start an engine, bind the socket, and run the app under uvicorn until SIGTERM or Ctrl-C.

On either signal the server drains (app.py's `drain`) and exits 0; when the engine fails past
--max-restarts it exits with EXIT_ENGINE_FAILED so an orchestrator restarts the process.
"""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path
from typing import Any

from engines.registry import engine_class, parse_set_options
from harness.calibration import create_calibrated
from harness.errors import HarnessError

EXIT_ENGINE_FAILED = 3


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise HarnessError(f"cannot listen on {host}:{port}: {exc.strerror}; choose another --port or --host") from None
    sock.listen(2048)
    return sock


def _uvicorn_server(config: Any, server: Any, drain_timeout_s: float) -> Any:
    """uvicorn's Server, draining our requests before its own shutdown closes connections."""
    import uvicorn  # noqa: PLC0415

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Not recorded as uvicorn does: it re-raises recorded signals after shutdown, which
            # would end a cleanly drained server by SIGTERM instead of exit code 0.
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

        async def on_tick(self, counter: int) -> bool:
            return await super().on_tick(counter) or server.fatal

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            if not server.fatal:
                print(f"pwbench serve: draining {len(server.inflight)} request(s) (up to {drain_timeout_s:g} s)",
                      file=sys.stderr, flush=True)
            await server.drain(drain_timeout_s, lambda: self.force_exit)
            await super().shutdown(sockets)

    return DrainingServer(config)


def serve_engine(name: str, model: str | None, host: str, port: int, served: Any, options: dict[str, Any],
                 set_items: list[str], drain_timeout_s: float = 30.0, keep_alive_s: float = 75.0) -> None:
    """Serve until a signal; `served` is a ServeOptions whose model_name may be None (the folder's name)."""
    import dataclasses  # noqa: PLC0415

    import uvicorn  # noqa: PLC0415

    from engines.common.tokenizer import load_tokenizer  # noqa: PLC0415
    from harness.serve.app import create_app  # noqa: PLC0415

    if not 0 <= port < 65536:
        raise HarnessError(f"--port must be in [0, 65535], got {port}")
    cls = engine_class(name)
    if model is None and cls.needs_model:
        from engines.common.demo import demo_model_path  # noqa: PLC0415

        model = str(demo_model_path())
    engine_options = {k: v for k, v in {**options, **parse_set_options(set_items)}.items() if v is not None}
    engine = create_calibrated(name, {"model": model, **engine_options})
    sock = bind(host, port)  # before loading: a port in use fails fast
    engine.start()
    try:
        tokenizer = load_tokenizer(model) if model else None
        model_name = served.model_name or (Path(model).name if model else name)
        served = dataclasses.replace(served, model_name=model_name)
        app = create_app(engine, tokenizer, served)
        bound = sock.getsockname()[1]
        print(f"pwbench serve: engine {name}, model {model_name!r} on http://{host}:{bound}/v1 "
              f"(max queue {served.max_queue}{', API key required' if served.api_key else ''}; Ctrl-C stops)",
              flush=True)
        # A keep-alive longer than clients' pool idle times (httpx 5 s, aiohttp 15 s, load balancers
        # 60 s): with uvicorn's 5 s, a client reusing a connection as the server closes it got a reset.
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_keep_alive=keep_alive_s, timeout_graceful_shutdown=5)
        _uvicorn_server(config, app.server, drain_timeout_s).run(sockets=[sock])
    finally:
        sock.close()
        try:
            engine.stop()
        except Exception as exc:  # noqa: BLE001  (an engine that failed may not stop cleanly; we exit anyway)
            print(f"pwbench serve: stopping the engine failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    if app.server.fatal:
        print(f"pwbench serve: exiting with {EXIT_ENGINE_FAILED}: {app.server.worker.last_error}", file=sys.stderr,
              flush=True)
        raise SystemExit(EXIT_ENGINE_FAILED)
    print("pwbench serve: stopped", file=sys.stderr)

"""Start an engine, bind the socket, and run the app under uvicorn until Ctrl-C."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

from engines.registry import engine_class, parse_set_options
from harness.calibration import create_calibrated
from harness.errors import HarnessError


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


def serve_engine(name: str, model: str | None, host: str, port: int, api_key: str | None, max_queue: int,
                 served_name: str | None, options: dict[str, Any], set_items: list[str]) -> None:
    import uvicorn  # noqa: PLC0415

    from engines.common.tokenizer import load_tokenizer  # noqa: PLC0415
    from harness.serve.app import ServeOptions, create_app  # noqa: PLC0415

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
        model_name = served_name or (Path(model).name if model else name)
        app = create_app(engine, tokenizer, ServeOptions(model_name, api_key, max_queue))
        bound = sock.getsockname()[1]
        print(f"pwbench serve: engine {name}, model {model_name!r} on http://{host}:{bound}/v1 "
              f"(max queue {max_queue}{', API key required' if api_key else ''}; Ctrl-C stops)", flush=True)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        engine.stop()
    print("pwbench serve: stopped", file=sys.stderr)

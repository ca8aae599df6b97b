"""`pwbench serve`: any pwbench engine behind an OpenAI-compatible HTTP server (uvicorn).

The engine starts before the port is bound, so a bad model or option is one `error:` line
and nothing listens. The socket is bound here (a port in use is a one-line error too) and
handed to uvicorn; one line on stdout says where the server listens once it does. Limits,
restarts, health states and shutdown: docs/serving.md.
"""

from __future__ import annotations

from typing import Annotated

import typer

from engines.common.demo import resolve_model
from harness.cli.apps import app
from harness.cli.common import BUDGET_HELP, engine_for, user_errors


@app.command("serve")
@user_errors
def serve(
    engine: Annotated[str | None,
                      typer.Option(help="Engine name (see `pwbench ls engines`; default: full, or static-<method> "
                                        "for a quantized folder).")] = None,
    model: Annotated[str | None, typer.Option(help="Model folder, or bundled: demo (default), demo-fine.")] = None,
    host: Annotated[str,
                    typer.Option(help="Address to listen on (loopback by default; 0.0.0.0 exposes it).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free port, printed).")] = 8000,
    api_key: Annotated[str | None,
                       typer.Option(help="Require `Authorization: Bearer KEY` on every route but /health.",
                                    envvar="PWBENCH_API_KEY")] = None,
    max_queue: Annotated[int,
                         typer.Option(help="Requests held at once (waiting + running); more "
                                           "get 429 with Retry-After.")] = 256,
    served_model_name: Annotated[str | None,
                                 typer.Option(help="Model name in the API (default: the folder's name).")] = None,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body; larger ones get 413.")] = 2 * 2**20,
    max_restarts: Annotated[int,
                            typer.Option(help="Engine restarts after failures; one more failure exits with "
                                              "code 3 (for an orchestrator to restart the process).")] = 3,
    drain_timeout_s: Annotated[float,
                               typer.Option(help="On SIGTERM/Ctrl-C: seconds requests in flight may take to "
                                                 "finish before they are ended (finish_reason abort).")] = 30.0,
    keep_alive_s: Annotated[float, typer.Option(help="Idle keep-alive connections are closed after this.")] = 75.0,
    dtype: Annotated[str | None, typer.Option(help="float32 | bfloat16 | float16.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N.")] = None,
    budget: Annotated[str | None, typer.Option(help=BUDGET_HELP)] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Engine option key=value; repeatable.")] = None,
) -> None:
    """Serve an engine over the OpenAI API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    model = resolve_model(model)  # a bundled model's name (demo, demo-fine) -> its folder
    from harness.errors import HarnessError
    from harness.serve.app import ServeOptions
    from harness.serve.run import serve_engine

    for flag, value, low in (("--max-queue", max_queue, 1), ("--max-body-bytes", max_body_bytes, 1024),
                             ("--max-restarts", max_restarts, 0), ("--drain-timeout-s", drain_timeout_s, 0),
                             ("--keep-alive-s", keep_alive_s, 1)):
        if not value >= low:  # also refuses nan
            raise HarnessError(f"{flag} must be >= {low}, got {value}")
    options = {"device": device, "dtype": dtype, "budget_bytes": budget}
    served = ServeOptions(served_model_name or "", api_key, max_queue, max_body_bytes=max_body_bytes,
                          max_restarts=max_restarts)
    serve_engine(engine_for(engine, model), model, host, port, served, options, set_ or [],
                 drain_timeout_s=drain_timeout_s, keep_alive_s=keep_alive_s)

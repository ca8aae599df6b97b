"""`pwbench serve`: any pwbench engine behind an OpenAI-compatible HTTP server (uvicorn).

The engine starts before the port is bound, so a bad model or option is one `error:` line
and nothing listens. The socket is bound here (a port in use is a one-line error too) and
handed to uvicorn; one line on stdout says where the server listens once it does.
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
    dtype: Annotated[str | None, typer.Option(help="float32 | bfloat16 | float16.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N.")] = None,
    budget: Annotated[str | None, typer.Option(help=BUDGET_HELP)] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Engine option key=value; repeatable.")] = None,
) -> None:
    """Serve an engine over the OpenAI API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    model = resolve_model(model)  # a bundled model's name (demo, demo-fine) -> its folder
    from harness.serve.run import serve_engine

    if max_queue < 1:
        from harness.errors import HarnessError

        raise HarnessError(f"--max-queue must be >= 1, got {max_queue}")
    options = {"device": device, "dtype": dtype, "budget_bytes": budget}
    serve_engine(engine_for(engine, model), model, host, port, api_key, max_queue, served_model_name,
                 options, set_ or [])

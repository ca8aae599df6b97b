"""`pwbench serve`: an OpenAI-compatible HTTP server around any pwbench engine.

protocol.py checks request bodies and builds OpenAI-shaped responses; worker.py is the one
thread that steps the engine; app.py is the ASGI app (starlette) with SSE streaming, auth and
Prometheus metrics (prom.py).
"""

"""Engine `openai`'s own cost: a fake server in another process answers every request at once
(its whole SSE stream in one write), so what is measured is the client.

    python -m harness.bench.openai_client [--requests 2000] [--tokens 64] [--rates 100,200,400,800]
Prints (1) streamed tokens handled per second of the client process's CPU time (all its
threads: the network loop that parses chunks and the run loop that collects them), with
every request sent at t=0; (2) for each open-loop rate, the achieved request rate and the
p99 lateness of sends: the largest rate with >= 95% achieved and p99 lateness < 50 ms is
what one client process sustains. The fake server shares the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time

from engines.remote import OpenAIEngine, OpenAIEngineConfig
from harness.metrics import percentile
from harness.runner import Runner
from workloads.base import Request


def _stream(tokens: int) -> bytes:
    chunk = lambda i, fin: ("data: " + json.dumps({  # noqa: E731
        "id": "x", "object": "text_completion", "created": 0, "model": "fake",
        "choices": [{"index": 0, "text": " w", "logprobs": None, "finish_reason": fin, "token_ids": [5 + i % 90]}],
    }) + "\n\n").encode()
    usage = {"id": "x", "object": "text_completion", "created": 0, "model": "fake", "choices": [],
             "usage": {"prompt_tokens": 4, "completion_tokens": tokens, "total_tokens": tokens + 4}}
    body = b"".join(chunk(i, "length" if i == tokens - 1 else None) for i in range(tokens))
    return body + b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"


def _fake_server(port_out: multiprocessing.Queue, tokens: int) -> None:
    stream = _stream(tokens)
    models = json.dumps({"object": "list", "data": [{"id": "fake", "max_model_len": 1 << 20}]}).encode()

    def reply(body: bytes, kind: bytes) -> bytes:
        return (b"HTTP/1.1 200 OK\r\nContent-Type: " + kind + b"\r\nContent-Length: " + str(len(body)).encode()
                + b"\r\n\r\n" + body)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if length:
                    await reader.readexactly(length)
                writer.write(reply(models, b"application/json") if head.startswith(b"GET")
                             else reply(stream, b"text/event-stream"))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
        port_out.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


def _engine(port: int) -> OpenAIEngine:
    engine = OpenAIEngine(OpenAIEngineConfig(base_url=f"http://127.0.0.1:{port}/v1", vocab_size=100))
    engine.start()
    return engine


def throughput(port: int, requests: int, tokens: int) -> tuple[float, float, int]:
    """(tokens per CPU second of this process, tokens per wall second, tokens) at t=0."""
    engine = _engine(port)
    try:
        reqs = [Request(f"r{i}", (1, 2, 3, 4), tokens, arrival_s=0.0) for i in range(requests)]
        cpu, wall = time.process_time(), time.perf_counter()
        records = Runner(engine, reqs).run()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        engine.stop()
    got = sum(r.output_tokens for r in records.requests)
    assert got == requests * tokens, f"{got} tokens of {requests * tokens}"
    return got / cpu, got / wall, got


def at_rate(port: int, rate: float, seconds: float, tokens: int) -> tuple[float, float]:
    """(achieved requests/s, p99 send lateness s) for an open loop at `rate`."""
    engine = _engine(port)
    try:
        n = int(rate * seconds)
        reqs = [Request(f"r{i}", (1, 2, 3, 4), tokens, arrival_s=i / rate) for i in range(n)]
        records = Runner(engine, reqs).run()
    finally:
        engine.stop()
    done = [r for r in records.requests if r.finish_s is not None]
    span = max(r.finish_s for r in done) - min(r.arrival_s for r in records.requests)
    late = [r.sent_s - r.arrival_s for r in records.requests]
    return len(done) / span, percentile(late, 99) or 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rates", default="100,200,400,800")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    ports: multiprocessing.Queue = multiprocessing.Queue()
    server = multiprocessing.Process(target=_fake_server, args=(ports, args.tokens), daemon=True)
    server.start()
    port = ports.get(timeout=30)
    try:
        per_cpu, per_wall, got = throughput(port, args.requests, args.tokens)
        print(f"{args.requests} streamed requests x {args.tokens} tokens at t=0: {per_cpu:,.0f} tokens/s per core "
              f"of client CPU time, {per_wall:,.0f} tokens/s wall ({got:,} tokens)")
        sustained = None
        for rate in (float(r) for r in args.rates.split(",")):
            achieved, late = at_rate(port, rate, args.seconds, args.tokens)
            ok = achieved >= 0.95 * rate and late < 0.05
            sustained = rate if ok else sustained
            print(f"  open loop {rate:>7,.0f} req/s for {args.seconds:g} s: achieved {achieved:,.0f} req/s, "
                  f"p99 send lateness {late * 1e3:.1f} ms{'' if ok else '  (not sustained)'}")
        print(f"largest rate one client process sustains here: {sustained:,.0f} req/s" if sustained else
              "no tested rate was sustained")
    finally:
        server.terminate()


if __name__ == "__main__":
    main()

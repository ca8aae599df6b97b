"""The engine thread: the only code that touches the engine once the server is up.

HTTP handlers run on the asyncio loop and talk to the thread through an inbox (add, abort);
the thread admits what came in, runs one `step()`, and hands that step's outputs back to the
loop in one `call_soon_threadsafe` call, where each request's asyncio queue gets its own.
An abort is taken before the next step, so a disconnected client's KV blocks are freed by
the step that follows, not when its output would have ended. `max_queue` bounds the
requests held (waiting + running); beyond it `submit` raises QueueFull (HTTP 429).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from engines.base import Engine, EngineError, EngineRequest, RequestOutput, StepOutput


class QueueFull(Exception):
    pass


@dataclass(frozen=True)
class Admitted:
    """The engine took the request."""


@dataclass(frozen=True)
class Failed:
    """The engine refused the request (status 400) or crashed (status 500)."""

    message: str
    status: int


class EngineWorker:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, max_queue: int,
                 on_step: Any = None) -> None:
        self.engine, self.loop, self.max_queue, self.on_step = engine, loop, max_queue, on_step
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []
        self._queues: dict[str, asyncio.Queue] = {}  # only touched on the loop
        self._live: set[str] = set()  # held by the engine or in the inbox (under _cv)
        self._stopping = False
        self.failed: str | None = None  # set when the engine crashed; the server then answers 503
        self._thread = threading.Thread(target=self._run, name="pwbench-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=30)

    @property
    def held(self) -> int:
        return len(self._live)

    # -- the loop's side ---------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> asyncio.Queue:
        """Queue a request (call on the loop); its queue yields Admitted or Failed, then
        RequestOutputs up to the finished one."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._cv:
            if len(self._live) >= self.max_queue:
                raise QueueFull(f"the server holds {len(self._live)} requests (--max-queue {self.max_queue})")
            self._live.add(request.request_id)
            self._queues[request.request_id] = queue
            self._inbox.append(("add", request))
            self._cv.notify()
        return queue

    def abort(self, request_id: str) -> None:
        with self._cv:
            if request_id in self._live:
                self._inbox.append(("abort", request_id))
                self._cv.notify()

    def forget(self, request_id: str) -> None:
        """The handler is done with this request's queue (call on the loop)."""
        self._queues.pop(request_id, None)

    def _deliver(self, events: list[tuple[str, Any]]) -> None:
        for rid, event in events:
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(event)

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._inbox or self._stopping or self.engine.has_unfinished()):
                    self._cv.wait()
                if self._stopping:
                    return
                inbox, self._inbox = self._inbox, []
            events: list[tuple[str, Any]] = []
            for kind, item in inbox:
                if kind == "add":
                    events.append((item.request_id, self._add(item)))
                else:
                    self.engine.abort(item)
            if self.engine.has_unfinished() and self.failed is None:
                try:
                    out = self.engine.step()
                except Exception as exc:  # noqa: BLE001  (an engine bug: fail what is in flight, keep answering)
                    traceback.print_exc(file=sys.stderr)
                    self.failed = f"the engine failed: {type(exc).__name__}: {exc}"
                    with self._cv:
                        events += [(rid, Failed(self.failed, 500)) for rid in self._live]
                        self._live.clear()
                    self.loop.call_soon_threadsafe(self._deliver, events)
                    return
                events += self._outputs(out)
            if events:
                self.loop.call_soon_threadsafe(self._deliver, events)

    def _add(self, request: EngineRequest) -> Admitted | Failed:
        try:
            self.engine.add_request(request)
        except EngineError as exc:
            self._release(request.request_id)
            return Failed(str(exc), 400)
        return Admitted()

    def _outputs(self, out: StepOutput) -> list[tuple[str, RequestOutput]]:
        for o in out.outputs:
            if o.finished:
                self._release(o.request_id)
        if self.on_step is not None:
            self.on_step(out, len(self._live))
        return [(o.request_id, o) for o in out.outputs]

    def _release(self, request_id: str) -> None:
        with self._cv:
            self._live.discard(request_id)

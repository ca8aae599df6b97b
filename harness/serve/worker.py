"""The engine thread: the only code that touches the engine once the server is up.

HTTP handlers run on the asyncio loop and talk to the thread through an inbox (add, abort);
the thread admits what came in, runs one `step()`, and hands that step's outputs back to the
loop in one `call_soon_threadsafe` call, where each request's asyncio queue gets its own.
`max_queue` bounds the requests held (waiting + running); beyond it `submit` raises QueueFull
(429). Any exception from the engine but a refused request fails every request it holds (500),
then the engine is stopped and started again, at most `max_restarts` times; past that the
worker is `failed` and `on_fatal` runs on the loop (the server exits non-zero). States and
why: docs/serving.md#restarts-and-health.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines.base import Engine, EngineError, EngineRequest, RequestOutput, StepOutput

OK, RESTARTING, FAILED, STOPPED = "ok", "restarting", "failed", "stopped"


class QueueFull(Exception):
    pass


class Unavailable(Exception):
    """The engine is restarting, failed or stopped: nothing is admitted (503)."""


@dataclass(frozen=True)
class Admitted:
    """The engine took the request."""


@dataclass(frozen=True)
class Failed:
    """The engine refused the request (status 400) or crashed (status 500)."""

    message: str
    status: int


class EngineWorker:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, max_queue: int, on_step: Any = None,
                 max_restarts: int = 3, restart_backoff_s: float = 1.0,
                 on_failure: Callable[[bool], None] | None = None, on_fatal: Callable[[], None] | None = None) -> None:
        self.engine, self.loop, self.max_queue, self.on_step = engine, loop, max_queue, on_step
        self.max_restarts, self.restart_backoff_s = max_restarts, restart_backoff_s
        self.on_failure, self.on_fatal = on_failure, on_fatal  # called on the loop
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []
        self._queues: dict[str, asyncio.Queue] = {}  # only touched on the loop
        self._live: set[str] = set()  # held by the engine or in the inbox (under _cv)
        self._stopping = False
        self.state = OK
        self.restarts = 0
        self.last_error: str | None = None
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

    @property
    def status(self) -> str:
        """ok / restarting / failed / stopped; a thread that died is never ok."""
        if self.state == OK and not self._thread.is_alive():
            return STOPPED if self._stopping else FAILED
        return self.state

    # -- the loop's side ---------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> asyncio.Queue:
        """Queue a request (call on the loop); its queue yields Admitted or Failed, then
        RequestOutputs up to the finished one."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._cv:
            if self.status != OK:
                raise Unavailable(self.unavailable_reason())
            if len(self._live) >= self.max_queue:
                raise QueueFull(f"the server holds {len(self._live)} requests (--max-queue {self.max_queue})")
            self._live.add(request.request_id)
            self._queues[request.request_id] = queue
            self._inbox.append(("add", request))
            self._cv.notify()
        return queue

    def unavailable_reason(self) -> str:
        status = self.status
        if status == RESTARTING:
            return f"the engine is restarting after a failure ({self.last_error}); retry shortly"
        if status == FAILED:
            return f"the engine failed and is not restarted ({self.last_error})"
        return "the engine is stopped"

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

    def _call_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is gone already
            pass

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._cycle():
                pass
        except BaseException as exc:  # noqa: BLE001  (a bug in the worker itself: health must not say ok)
            traceback.print_exc(file=sys.stderr)
            self.last_error = f"the engine thread died: {type(exc).__name__}: {exc}"
            self._call_loop(self._deliver, self._fail_live(FAILED))
            if self.on_fatal is not None:
                self._call_loop(self.on_fatal)

    def _cycle(self) -> bool:
        """Take the inbox, run one step; False once the thread should end."""
        with self._cv:
            while not (self._inbox or self._stopping or self.engine.has_unfinished()):
                self._cv.wait()
            if self._stopping:
                self.state = STOPPED
                return False
            inbox, self._inbox = self._inbox, []
        events: list[tuple[str, Any]] = []
        try:
            for kind, item in inbox:
                if kind == "add":
                    events.append((item.request_id, self._add(item)))
                else:
                    self.engine.abort(item)
            if self.engine.has_unfinished():
                events += self._outputs(self.engine.step())
        except Exception as exc:  # noqa: BLE001  (an engine bug: fail what it holds, then restart it)
            traceback.print_exc(file=sys.stderr)
            return self._fail_and_restart(exc, events)
        if events:
            self._call_loop(self._deliver, events)
        return True

    def _fail_and_restart(self, exc: Exception, events: list[tuple[str, Any]]) -> bool:
        self.last_error = f"the engine failed: {type(exc).__name__}: {exc}"
        fatal = self.restarts >= self.max_restarts
        self._call_loop(self._deliver, events + self._fail_live(FAILED if fatal else RESTARTING))
        if self.on_failure is not None:
            self._call_loop(self.on_failure, not fatal)  # True: a restart follows
        if fatal:
            print(f"pwbench serve: {self.last_error}; restart limit reached (--max-restarts {self.max_restarts})",
                  file=sys.stderr, flush=True)
            if self.on_fatal is not None:
                self._call_loop(self.on_fatal)
            return False
        self.restarts += 1
        print(f"pwbench serve: {self.last_error}; restarting it ({self.restarts} of --max-restarts "
              f"{self.max_restarts})", file=sys.stderr, flush=True)
        try:
            self.engine.stop()
        except Exception:  # noqa: BLE001  (a half-dead engine may fail to stop; start() rebuilds it)
            traceback.print_exc(file=sys.stderr)
        with self._cv:  # a backoff, so a crash loop does not spin; stop() cuts it short
            self._cv.wait_for(lambda: self._stopping, timeout=self.restart_backoff_s)
            if self._stopping:
                self.state = STOPPED
                return False
        try:
            self.engine.start()
        except Exception as start_exc:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            self.last_error = f"the engine failed to restart: {type(start_exc).__name__}: {start_exc}"
            self.state = FAILED
            if self.on_fatal is not None:
                self._call_loop(self.on_fatal)
            return False
        self.state = OK
        return True

    def _fail_live(self, state: str) -> list[tuple[str, Failed]]:
        """Enter `state` and fail every request held (500), those still in the inbox too."""
        with self._cv:
            self.state = state
            failed = [(rid, Failed(self.last_error or "the engine failed", 500)) for rid in sorted(self._live)]
            self._live.clear()
            self._inbox.clear()  # their requests are failed here; aborts have nothing left to abort
        return failed

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

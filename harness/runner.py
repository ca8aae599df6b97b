"""The run loop: one loop drives any engine through the Engine protocol and records raw
observations (timestamps and counts), nothing derived.

Open loop: a request is sent when its arrival time has come (a dependent later turn also waits
for its session's previous answer). Closed loop: N users each take
a session and send its next turn `think_time_s` after the previous answer. Offline batches,
rate runs and trace replays are the same loop. Every timestamp is seconds since the run's
start on one monotonic clock (the telemetry sampler uses the same one). `stop()` (the CLI
calls it on Ctrl-C) stops admitting and stepping; what finished is kept.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engines.base import Engine, EngineError, EngineRequest, StepOutput
from harness.metrics import step_row
from harness.offline import run_offline
from workloads.base import Request


@dataclass
class RequestRecord:
    request_id: str
    session_id: str | None
    turn: int
    arrival_s: float  # when it was due (closed loop: previous answer + think time)
    prompt_tokens: int
    max_new_tokens: int
    sent_s: float | None = None
    started_s: float | None = None  # its first prompt token was computed in a step ending here
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    rejected: bool = False  # the engine refused it at admission (it can never serve it, e.g. too long)
    token_times_s: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    task: str | None = None
    answer: str | None = None

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)


@dataclass(frozen=True)
class RunLimits:
    requests: int | None = None
    duration_s: float | None = None  # stop admitting after this many seconds


@dataclass
class RunRecords:
    status: str  # complete | interrupted | failed
    requests: list[RequestRecord]
    steps: list[dict[str, Any]]
    wall_start: float  # time.time() at t = 0, to join with outside data
    error: str | None = None


class ThreadCpuClock:
    """A measured run's clock on a shared CPU (`clock=c.now, sleep=c.sleep`): this thread's CPU
    time, so the time a neighbour holds the core does not count, plus every wait for an
    arrival, skipped (added, not slept). It times an engine that computes on this thread alone
    (torch with one intra-op thread, copies done at issue); work on other threads (a link
    model's copies, telemetry) and the time blocked on them do not count. The validation
    benchmark's measured runs use it (harness/bench/simulate.py)."""

    def __init__(self) -> None:
        self.waited = 0.0

    def now(self) -> float:
        return time.thread_time() + self.waited

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.waited += seconds


class Runner:
    def __init__(
        self,
        engine: Engine,
        requests: Sequence[Request],
        closed_loop: bool = False,
        concurrency: int | None = None,
        limits: RunLimits = RunLimits(),
        clock: Callable[[], float] = time.perf_counter,
        on_step: Callable[[RunRecords], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        on_record: Callable[[RequestRecord], None] | None = None,
        keep_records: bool = True,
    ) -> None:
        """`on_record` sees each request's record once, when it is final (finished, failed,
        rejected, or cut by the run's end), e.g. to append it to disk as the run goes; with
        `keep_records=False` final records are then dropped, so `run()` returns only the
        unfinished ones and memory stays bounded however many requests the run sends."""
        if closed_loop and not concurrency:
            raise ValueError("a closed-loop run needs concurrency >= 1")
        virtual = getattr(engine, "virtual_clock", None)
        if virtual is not None:  # a simulated engine: its steps move this clock, and so do waits
            clock, sleep = virtual.now, virtual.advance
        self.engine, self.clock, self.on_step, self.sleep = engine, clock, on_step, sleep
        self.on_record, self.keep_records = on_record, keep_records
        self._finished_count = 0
        self.limits, self.closed_loop, self.concurrency = limits, closed_loop, concurrency
        self.requests = list(requests)[: limits.requests] if limits.requests else list(requests)
        self._stop = False
        self._warmup_error: str | None = None
        self.t0 = 0.0

    def stop(self) -> None:
        self._stop = True

    def now(self) -> float:
        return self.clock() - self.t0

    def warmup(self, requests: Sequence[Request]) -> None:
        """Run requests to completion before the clock starts; nothing of them is recorded.
        Give it requests of its own, not the measured ones: the engine's prefix cache is emptied
        afterwards (Engine.reset_prefix_cache), so the measured requests' hits are their own.

        An EngineError (e.g. a request the KV cache cannot hold) propagates: the CLI shows it
        as a one-line user error. Any other exception is an engine crash and fails the run as
        it would mid-way: `run()` then returns status `failed` with the error at once."""
        try:
            run_offline(self.engine,
                        [EngineRequest(f"warmup-{i}", tuple(r.prompt_ids), r.max_new_tokens, ignore_eos=True)
                         for i, r in enumerate(requests)], should_stop=lambda: self._stop)
            self.engine.reset_prefix_cache()
        except EngineError:
            raise
        except Exception as exc:  # noqa: BLE001  (an engine bug: say what broke, as run() does)
            self._warmup_error = f"warm-up: {type(exc).__name__}: {exc}"

    def run(self, on_start: Callable[[], None] | None = None) -> RunRecords:
        """The measured run; `on_start` is called just before the run's clock reads 0 (the
        telemetry sampler starts there, so its samples share the requests' time axis; its first
        sample comes a period later)."""
        self.t0 = self.clock()
        if on_start is not None:
            on_start()
            # The run's clock reads 0 once on_start has returned (starting the sampler takes
            # milliseconds): no request waits for it, so measured sends are not late by it.
            self.t0 = self.clock()
        # Engines that time their own tokens (RequestOutput.token_times) use perf_counter's
        # clock; this maps those times onto the run's clock, read at the same instant as t0:
        # a token must never precede its send.
        self._perf_t0 = self.t0 if self.clock is time.perf_counter else time.perf_counter()
        self._self_timed: set[str] = set()
        result = RunRecords("complete", [], [], time.time())
        self._records: dict[str, RequestRecord] = {}
        if self._warmup_error is not None:
            result.status, result.error = "failed", self._warmup_error
            return result
        self._by_id = {r.request_id: r for r in self.requests}
        self._in_flight: set[str] = set()
        self._setup_arrivals()
        try:
            self._loop(result)
        except EngineError as exc:
            result.status, result.error = "failed", str(exc)
        except Exception as exc:  # noqa: BLE001  (an engine bug: keep what was measured, say what broke)
            result.status, result.error = "failed", f"{type(exc).__name__}: {exc}"
        if self._stop and result.status == "complete":
            result.status = "interrupted"
        for rid in list(self._in_flight):
            self._records[rid].error = "interrupted" if result.status == "interrupted" else "not finished"
            self._final(rid)
        result.requests += list(self._records.values())
        return result

    def _final(self, rid: str) -> None:
        """The record of `rid` will not change again."""
        rec = self._records[rid]
        if rec.finish_s is not None:
            self._finished_count += 1
        if self.on_record is not None:
            self.on_record(rec)
        if not self.keep_records:
            del self._records[rid]

    # -- arrivals ----------------------------------------------------------------------------
    def _setup_arrivals(self) -> None:
        self._ready: list[tuple[float, int, str]] = []  # (due time, order, request id) heap
        self._order = itertools.count()
        self._turns: dict[str, deque[Request]] = {}  # closed loop: sent turn -> its session's rest
        self._after: dict[str, Request] = {}  # open loop: request id -> its session's next, dependent turn
        if not self.closed_loop:
            self._setup_open_loop()
            return
        sessions: dict[str, deque[Request]] = {}
        for r in self.requests:
            sessions.setdefault(r.session_id or r.request_id, deque()).append(r)
        self._sessions = deque(sessions.values())
        for _ in range(min(self.concurrency or 1, len(self._sessions))):
            self._next_session(0.0)

    def _setup_open_loop(self) -> None:
        """Each request is due at its arrival time, except a dependent later turn (after_previous_s
        set): it waits for the same session's previous turn in the run to finish (_on_finish)."""
        previous: dict[str, str] = {}  # session id -> its latest turn so far, in send order
        for r in self.requests:
            prev = previous.get(r.session_id) if r.session_id is not None else None
            if prev is not None and r.after_previous_s is not None:
                self._after[prev] = r
            else:
                heapq.heappush(self._ready, (r.arrival_s or 0.0, next(self._order), r.request_id))
            if r.session_id is not None:
                previous[r.session_id] = r.request_id

    def _next_session(self, now: float) -> None:
        if self._sessions:
            turns = self._sessions.popleft()
            first = turns.popleft()
            self._turns[first.request_id] = turns
            heapq.heappush(self._ready, (now, next(self._order), first.request_id))

    def _on_finish(self, rid: str, now: float) -> None:
        if not self.closed_loop:
            nxt = self._after.pop(rid, None)
            if nxt is not None:  # the later of its trace time and the answer plus the think time
                due = max(nxt.arrival_s or 0.0, now + (nxt.after_previous_s or 0.0))
                heapq.heappush(self._ready, (due, next(self._order), nxt.request_id))
            return
        turns = self._turns.pop(rid, deque())
        if turns:
            nxt = turns.popleft()
            self._turns[nxt.request_id] = turns
            heapq.heappush(self._ready, (now + nxt.think_time_s, next(self._order), nxt.request_id))
        else:
            self._next_session(now)

    # -- the loop ----------------------------------------------------------------------------
    def _admitting(self, now: float) -> bool:
        return not self._stop and (self.limits.duration_s is None or now < self.limits.duration_s)

    def _loop(self, result: RunRecords) -> None:
        while not self._stop:
            now = self.now()
            while self._ready and self._ready[0][0] <= now and self._admitting(now):
                due, _, rid = heapq.heappop(self._ready)
                req = self._by_id[rid]
                rec = self._record(req, due)
                self._records[rid] = rec
                self._send(rec, req, now)
            if self.engine.has_unfinished():
                self._step(result)
            elif self._ready and self._admitting(now):
                # at least 1 us: a simulated clock whose sleep cannot move it below its float
                # resolution would otherwise spin here forever
                self.sleep(min(max(self._ready[0][0] - self.now(), 1e-6), 0.05))
            else:
                break

    def _record(self, req: Request, due: float) -> RequestRecord:
        return RequestRecord(
            req.request_id, req.session_id, req.turn, due, len(req.prompt_ids), req.max_new_tokens,
            task=req.task.task if req.task else None, answer=req.task.answer if req.task else None,
        )

    def _send(self, rec: RequestRecord, req: Request, now: float) -> None:
        rec.sent_s = now
        try:
            # The compact prompt as it is (workloads.prompts: int32, or synthesized when the engine
            # reads it): a queue of thousands of requests holds no tuples of ints.
            self.engine.add_request(EngineRequest(rec.request_id, req.prompt_ids, req.max_new_tokens,
                                                  ignore_eos=req.ignore_eos))
        except EngineError as exc:  # this request cannot be served; the run goes on
            rec.error, rec.finish_s, rec.rejected = str(exc), None, True
            self._on_finish(rec.request_id, now)
            self._final(rec.request_id)
            return
        self._in_flight.add(rec.request_id)

    def _step(self, result: RunRecords) -> None:
        start = self.now()
        out: StepOutput = self.engine.step()
        end = self.now()
        for rid in out.started:
            rec = self._records.get(rid)
            if rec is not None and rec.started_s is None:
                rec.started_s = end
        for o in out.outputs:
            rec = self._records.get(o.request_id)
            if rec is None:
                continue
            rec.output_ids.extend(o.new_token_ids)
            if o.token_times:
                rec.token_times_s.extend(t - self._perf_t0 for t in o.token_times)
                self._self_timed.add(o.request_id)
            else:
                rec.token_times_s.extend(end for _ in o.new_token_ids)
            if rec.first_token_s is None and rec.token_times_s:
                rec.first_token_s = rec.token_times_s[0]
            if o.error is not None:  # failed after it was accepted (a remote server's error)
                rec.error = o.error
                self._in_flight.discard(o.request_id)
                self._on_finish(o.request_id, end)
                self._final(o.request_id)
            elif o.finished:
                # A request whose engine timed its tokens (remote) ends when its last token
                # arrived, not when the step that reported the end returned.
                timed = o.request_id in self._self_timed and rec.token_times_s
                rec.finish_s = rec.token_times_s[-1] if timed else end
                rec.finish_reason = o.finish_reason
                self._in_flight.discard(o.request_id)
                self._on_finish(o.request_id, end)
                self._final(o.request_id)
        result.steps.append({"t_s": start, "duration_s": end - start, **step_row(out)})
        if self.on_step:
            self.on_step(result)

    def completed(self) -> int:
        return self._finished_count

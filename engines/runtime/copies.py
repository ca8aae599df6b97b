"""The copy path between the host tier and the device tier: issue a copy, get a handle, wait.

One `CopyEngine` per engine moves tensors from host-tier storage into preallocated device
buffers (and back). Every crossing is counted in the TransferLedger at issue time, so bytes
and transfers are exact and do not depend on timing. The same API runs two ways:

- **CUDA**: the host tier is pinned memory; copies are `non_blocking` on a separate copy
  stream that first waits for the compute stream (so a buffer is never overwritten while a
  kernel still reads it); a handle is a CUDA event, `wait()` blocks the host until it fires.
  Link time is the events' elapsed time.
- **CPU** (tests, the demo): the "device" is a separately accounted pool in host memory.
  Without a link model a copy is a memcpy done at issue. With `link_gbps` one background
  thread plays the link: copies run one at a time in issue order, each taking
  `bytes / bandwidth` of wall time, so moving weights costs time and overlapping it with
  compute (which continues on the calling thread) saves it, visibly and testably. The
  link's busy time is the model's (bytes / bandwidth per copy), what the copies would take
  on that link; the thread's wake-up lateness shows in the stall time instead.

Per step (`take_step`): `busy_s`, the time the link spent copying; `stall_s`, the time compute
waited in `wait()`/`sync()`. What overlapped compute is busy minus stall.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.runtime.transfer import TransferLedger


@dataclass(frozen=True)
class CopyStats:
    busy_s: float = 0.0  # the link copying (bytes / bandwidth with the link model)
    stall_s: float = 0.0  # compute waiting for copies

    @property
    def overlap_s(self) -> float:
        return max(0.0, self.busy_s - self.stall_s)


class CopyHandle:
    """A copy in flight. `wait()` returns once the destination holds the data."""

    def __init__(self, engine: CopyEngine, nbytes: int) -> None:
        self._engine = engine
        self.nbytes = nbytes
        self._done = threading.Event()
        self._event: torch.cuda.Event | None = None
        self.error: Exception | None = None  # a failed copy on the CPU link thread

    @property
    def done(self) -> bool:
        if self._event is not None:
            return self._event.query()
        return self._done.is_set()

    def wait(self) -> None:
        if self.done:
            if self.error is not None:
                raise self.error
            return
        t0 = time.perf_counter()
        if self._event is not None:
            self._event.synchronize()
        else:
            self._done.wait()
        self._engine._add_stall(time.perf_counter() - t0)
        if self.error is not None:
            raise self.error


class CopyEngine:
    def __init__(self, ledger: TransferLedger, device: torch.device, link_gbps: float | None = None) -> None:
        if link_gbps is not None and link_gbps <= 0:
            raise ValueError(f"link_gbps must be > 0, got {link_gbps}")
        if link_gbps is not None and device.type == "cuda":
            raise ValueError("link_gbps models a link on the CPU; on CUDA copies take the real link's time")
        self.ledger, self.device = ledger, device
        # A simulated run (meta device): copies are counted, done at issue, and timed by the
        # simulator's cost model, not by a link model.
        self.bytes_per_s = link_gbps * 1e9 if link_gbps is not None and device.type != "meta" else None
        self._lock = threading.Lock()
        self._busy = 0.0
        self._stall = 0.0
        self._inflight: list[CopyHandle] = []
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._jobs: queue.Queue | None = None
        self._link_free_at = 0.0
        self._done_handle: CopyHandle | None = None  # every simulated copy's (meta device)
        if self.bytes_per_s is not None:
            self._jobs = queue.Queue()
            self._worker = threading.Thread(target=self._run_link, name="pwbench-link", daemon=True)
            self._worker.start()

    @property
    def asynchronous(self) -> bool:
        """Copies run beside compute (a CUDA copy stream, or the CPU link model's thread);
        otherwise each is a memcpy done at issue, and nothing can overlap it."""
        return self._stream is not None or self._jobs is not None

    # -- the host tier -----------------------------------------------------------------------------
    def host(self, tensor: Tensor) -> Tensor:
        """`tensor` as host-tier storage: on the CPU, pinned when the device is CUDA."""
        if self.device.type == "meta":  # a simulated run's host tier: shapes, like its device
            return tensor
        t = tensor.detach().to("cpu")
        return t.pin_memory() if self.device.type == "cuda" else t.contiguous()

    # -- copies ------------------------------------------------------------------------------------
    def h2d(self, pairs: list[tuple[Tensor, Tensor]], tag: str = "weights") -> CopyHandle:
        """Copy each host-tier `src` into its device buffer `dst` (same shape); one handle."""
        return self._issue(pairs, "h2d", tag)

    def d2h(self, pairs: list[tuple[Tensor, Tensor]], tag: str = "weights") -> CopyHandle:
        return self._issue(pairs, "d2h", tag)

    @property
    def simulated(self) -> bool:
        """A simulated run (meta device): copies are counted and done at issue."""
        return self.device.type == "meta"

    def counted(self, direction: str, nbytes: int, transfers: int, tag: str = "weights") -> CopyHandle:
        """A simulated run's copy of `transfers` tensors holding `nbytes` in all (`direction` 'h2d' or
        'd2h'): counted as `h2d`/`d2h` count the pairs they are given, and done. Meta device only."""
        if self.device.type != "meta":
            raise RuntimeError("CopyEngine.counted is for a simulated run (meta device); copy pairs with h2d/d2h")
        self.ledger.record(direction, nbytes, tag, transfers=transfers)
        return self.done()

    def done(self) -> CopyHandle:
        """A copy done at issue: a simulated run's (one handle serves them all)."""
        if self._done_handle is None:
            self._done_handle = CopyHandle(self, 0)
            self._done_handle._done.set()
        return self._done_handle

    def _issue(self, pairs: list[tuple[Tensor, Tensor]], direction: str, tag: str) -> CopyHandle:
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        self.ledger.record(direction, nbytes, tag, transfers=len(pairs))
        if self.device.type == "meta":  # simulated: counted, nothing to move, done
            return self.done()
        handle = CopyHandle(self, nbytes)
        self._inflight.append(handle)
        if self._stream is not None:
            self._issue_cuda(pairs, handle)
        elif self._jobs is not None:
            self._jobs.put((pairs, handle, time.perf_counter()))
        else:
            t0 = time.perf_counter()
            for dst, src in pairs:
                dst.copy_(src)
            self._add_busy(time.perf_counter() - t0)
            handle._done.set()
        return handle

    def _issue_cuda(self, pairs: list[tuple[Tensor, Tensor]], handle: CopyHandle) -> None:
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # buffers free of compute
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            end.record(stream)
        handle._event = end
        self._timed.append((start, end))

    def _run_link(self) -> None:
        """The CPU link: one copy at a time, each held to bytes / bandwidth of wall time."""
        assert self._jobs is not None and self.bytes_per_s is not None
        while True:
            job = self._jobs.get()
            if job is None:
                return
            pairs, handle, issued = job
            # The modelled link is a timeline: a copy starts when it was issued or when the
            # previous one ended, whichever is later, and lasts bytes / bandwidth. Sleeping to
            # that deadline (not for a duration) keeps one copy's oversleep out of the next.
            start = max(issued, self._link_free_at)
            self._link_free_at = end = start + handle.nbytes / self.bytes_per_s
            try:
                for dst, src in pairs:
                    dst.copy_(src)
            except Exception as exc:  # noqa: BLE001  (re-raised by wait() on the caller's thread)
                handle.error = exc
            while (left := end - time.perf_counter()) > 0:
                time.sleep(left)
            self._add_busy(end - start)
            handle._done.set()

    # -- step boundary -----------------------------------------------------------------------------
    def sync(self) -> None:
        """Wait for every copy issued so far (counted as stall where it blocks)."""
        for handle in self._inflight:
            handle.wait()
        self._inflight = []

    def take_step(self) -> CopyStats:
        """Sync, then this step's link time and stall time; reset."""
        self.sync()
        if self._timed:
            self._add_busy(sum(s.elapsed_time(e) for s, e in self._timed) / 1e3)
            self._timed = []
        with self._lock:
            stats = CopyStats(self._busy, self._stall)
            self._busy = self._stall = 0.0
        return stats

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)
            self._worker.join(timeout=5)
            self._jobs = None

    def _add_busy(self, seconds: float) -> None:
        with self._lock:
            self._busy += seconds

    def _add_stall(self, seconds: float) -> None:
        with self._lock:
            self._stall += seconds

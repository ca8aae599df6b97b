"""A simulated step's expert counts per MoE layer, drawn cheaply from a chain routing source.

The synthetic and uniform sources (engines/sim/routing.py) draw a request's rows as a chain: a
row depends on the row before it of the same request (temporal locality), never on other
requests, on the batch or on time. Two consequences make a step's routing cheap without changing
what is drawn for decode rows:

- Decode rows, a window ahead. When a request's decode needs rows it has none for, its next
  `window` positions are drawn as one chain (one `route_layers` call serves every request that
  needs rows in that step, and tops up those with less than a window left), and each step
  reads its row from the buffer. Same law as drawing each row when its step runs: the chain is
  the same Markov chain, drawn earlier. A request that ends or is preempted leaves the rest of
  its window unused (`rows_drawn_unused`); a request whose next position is not the one its
  buffer continues (a restart) draws a new window.
- Long prefill chunks, counted in bulk. Only per-layer token counts per expert reach the expert
  backends and the cost model in a simulated step. A chunk of more than `tail` rows has its last
  row drawn by the source (the state its decode continues from: a row whose previous position
  the source has not seen takes the stationary law); the rows before it are counted per layer
  from the layer's inclusion probabilities, each expert Binomial(rows, pi_e) (`bulk_counts`):
  the exact count of an expert over rows drawn independently. What it leaves out: the locality
  between those rows, which makes an expert's count over a chunk vary more (its mean is the
  same), and the exactly-top_k rows (the counts' sum varies around rows x top_k). A chunk of
  `tail` rows or fewer is drawn as a chain, row by row (there the locality changes how many
  experts a step runs).

A replayed trace is read row by row as recorded: the executor uses this only for a source with
`draws_ahead` (synthetic, uniform).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engines.runtime.batch import StepBatch

BUFFER_BYTES = 1 << 15  # per request and window: layers x window x top_k ids of 2 bytes (window 8-64)
STALE_STEPS = 256  # a buffer unread this many steps is freed (its request ended or waits preempted)


def tally_layers(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Tokens per expert [layers, E] from expert ids [layers, ...] (any rows per layer)."""
    n_layers = ids.shape[0]
    offsets = (np.arange(n_layers, dtype=np.int64) * num_experts).reshape(-1, *([1] * (ids.ndim - 1)))
    return np.bincount((ids + offsets).ravel(), minlength=n_layers * num_experts).reshape(n_layers, num_experts)


class AheadRouter:
    def __init__(self, source: Any, layers: tuple[int, ...], num_experts: int, top_k: int, tail: int = 64) -> None:
        self.source, self.layers, self.e, self.k, self.tail = source, tuple(layers), int(num_experts), int(top_k), tail
        n_layers = len(self.layers)
        w = BUFFER_BYTES // max(1, 2 * n_layers * self.k)
        self.window = max(8, min(128, 1 << (w.bit_length() - 1))) if w else 8
        self._dtype = np.int16 if self.e < (1 << 15) else np.int32
        self._slot_of: dict[str, int] = {}
        self._rid: list[str | None] = []
        self._free: list[int] = []
        self._grow(64)
        self._step = 0
        # The last decode step's (ids, positions, slots, rows every one has left beyond it, offsets,
        # step); its next positions and step are written back by `_settle`.
        self._run: tuple | None = None
        self.stats = {"decode_rows": 0, "rows_drawn_ahead": 0, "rows_drawn_unused": 0, "window_calls": 0,
                      "prefill_rows_chained": 0, "prefill_rows_counted": 0}

    def describe(self) -> dict[str, Any]:
        return {"decode_window": self.window, "prefill_tail": self.tail, **self.stats,
                "rule": "decode rows drawn per request a window ahead as one chain (the same law); a prefill "
                        "chunk over prefill_tail rows: its last row drawn, the rows before it counted per expert as "
                        "Binomial(rows, inclusion probability); shorter chunks drawn as chains "
                        "(engines/sim/ahead.py)"}

    # -- buffers ------------------------------------------------------------------------------------
    def _grow(self, cap: int) -> None:
        old = len(self._rid)
        if cap <= old:
            return
        buf = np.zeros((cap, len(self.layers), 2 * self.window, self.k), dtype=self._dtype)
        start, fill, nxt, seen = (np.zeros(cap, dtype=np.int64) for _ in range(4))
        if old:
            buf[:old], start[:old], fill[:old], nxt[:old], seen[:old] = \
                self._buf, self._start, self._fill, self._next, self._seen
        nxt[old:] = -1
        self._buf, self._start, self._fill, self._next, self._seen = buf, start, fill, nxt, seen
        self._rid += [None] * (cap - old)
        self._free += range(cap - 1, old - 1, -1)

    def _slot(self, rid: str) -> int:
        s = self._slot_of.get(rid)
        if s is None:
            if not self._free:
                self._grow(2 * len(self._rid))
            s = self._slot_of[rid] = self._free.pop()
            self._rid[s] = rid
            self._next[s], self._fill[s] = -1, 0
        return s

    def _discard_rows(self, s: int) -> None:
        """Count the rows of slot `s`'s window never read (its request ended or restarted), then empty it."""
        used = self._next[s] - self._start[s] if self._next[s] >= 0 else 0
        self.stats["rows_drawn_unused"] += int(max(0, self._fill[s] - used))
        self._fill[s] = 0

    def _release(self, s: int) -> None:
        self._discard_rows(s)
        del self._slot_of[self._rid[s]]
        self._rid[s] = None
        self._free.append(s)

    def _settle(self) -> None:
        """Write back what steps on the fast path (`_decode`) kept aside: each request's next position
        and the step it was read at. Before anything reads them or frees a slot."""
        run, self._run = self._run, None
        if run is not None:
            _, starts, slots, _, _, step = run
            self._next[slots] = np.array(starts, dtype=np.int64) + 1
            self._seen[slots] = step

    def _prune(self) -> None:
        self._settle()
        for s in np.flatnonzero(self._seen < self._step - STALE_STEPS).tolist():
            if self._rid[s] is not None:
                self._release(s)

    # -- a step -------------------------------------------------------------------------------------
    def matrix(self, batch: StepBatch) -> np.ndarray:
        """Tokens per expert [MoE layers, E] for the batch's rows."""
        self._step += 1
        if self._step % STALE_STEPS == 0:
            self._prune()
        n_layers, e, k = len(self.layers), self.e, self.k
        total = np.zeros((n_layers, e), dtype=np.int64)
        nd = batch.num_decode
        keys: list[tuple[str, int]] = []
        counted = 0
        for c in batch.chunks[nd:]:
            rid = c.seq.request.request_id
            if rid in self._slot_of:  # its positions start again: the buffer no longer continues
                self._settle()
                self._release(self._slot_of[rid])
            head = c.length - 1 if c.length > self.tail else 0  # counted; the last row drawn (the state)
            counted += head
            keys += [(rid, p) for p in range(c.start + head, c.start + c.length)]
        if counted:
            total += self.source.bulk_counts(self.layers, counted, e, k)
            self.stats["prefill_rows_counted"] += counted
        if keys:
            total += tally_layers(self.source.route_layers(self.layers, keys, e, k), e)
            self.stats["prefill_rows_chained"] += len(keys)
        if nd:
            ids = self._decode(batch.chunks[:nd])  # [B, layers, k]
            total += tally_layers(ids.transpose(1, 0, 2).astype(np.int64), e)
        return total

    def _decode(self, chunks: list[Any]) -> np.ndarray:
        rids = [c.seq.request.request_id for c in chunks]
        starts = [c.start for c in chunks]
        self.stats["decode_rows"] += len(rids)
        run = self._run
        # The fast path: the same requests as the previous step, each one position on, and every
        # one's buffer holding the row (the usual decode step): no lookups, no checks.
        if run is not None and run[3] > 0 and run[0] == rids and all(a == b + 1 for a, b in zip(starts, run[1])):
            off = run[4] + 1
            self._run = (rids, starts, run[2], run[3] - 1, off, self._step)
            return self._buf[run[2], :, off]
        self._settle()
        slots = np.fromiter(map(self._slot, rids), dtype=np.int64, count=len(rids))
        pos = np.array(starts, dtype=np.int64)
        off = pos - self._start[slots]
        ok = (self._next[slots] == pos) & (off < self._fill[slots])
        if not ok.all():
            self._refill(rids, slots, pos, ok, off)
            off = pos - self._start[slots]
        self._run = (rids, starts, slots, int((self._fill[slots] - off).min()) - 1, off, self._step)
        return self._buf[slots, :, off]

    def _refill(self, rids: list[str], slots: np.ndarray, pos: np.ndarray, ok: np.ndarray, off: np.ndarray) -> None:
        """Rows for every request without its next one, and a top-up for those with under a window left."""
        w, n_layers = self.window, len(self.layers)
        top = ok & (self._fill[slots] - off < w)
        keys: list[tuple[str, int]] = []
        sel = np.flatnonzero(~ok | top).tolist()
        for i in sel:
            s, p = int(slots[i]), int(pos[i])
            if ok[i]:  # keep the rows from this one on, at the front
                o, f = int(off[i]), int(self._fill[s])
                self._buf[s, :, : f - o] = self._buf[s, :, o:f]
                self._fill[s] = f - o
            else:  # a new window from this position (the source continues its chain where it can)
                self._discard_rows(s)
            self._start[s] = p
            begin = p + int(self._fill[s])
            keys += [(rids[i], q) for q in range(begin, begin + w)]
        ids = self.source.route_layers(self.layers, keys, self.e, self.k).reshape(n_layers, len(sel), w, self.k)
        for j, i in enumerate(sel):
            s = int(slots[i])
            f = int(self._fill[s])
            self._buf[s, :, f : f + w] = ids[:, j]
            self._fill[s] = f + w
        self.stats["window_calls"] += 1
        self.stats["rows_drawn_ahead"] += len(keys)

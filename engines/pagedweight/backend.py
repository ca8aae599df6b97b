"""PagedWeightBackend: every routed expert on the device at a bit width that changes while serving.

Each (layer, expert) has a store in the host tier (engines/pagedweight/formats.py) that names the
parts a version at b bits is made of: for bit-planes the top b planes plus the shared scales
and zeros, for re-quantize that width's own codes, at 16 bits the full-precision master; and,
for experts with biases (gpt-oss), the full-precision biases in every version. The device
holds one committed `Held` per expert (its parts' device buffers) or nothing (bits 0).

Changing an expert's width is a *move*: the parts the target has and the held version lacks
are copied host->device into new buffers (through the CopyEngine: counted, asynchronous);
parts the target does not use are dropped. So a bit-plane demotion copies nothing and frees
the trailing planes, a promotion copies only the missing planes, and a re-quantize change
copies the whole new version. A promotion becomes visible only at a step boundary, after
its copies landed (`commit`): a step never reads buffers a copy is writing, and the held
version is never written in place. A demotion needs no copy for bit-planes and is applied at
once; one that copies (re-quantize, or down from the 16-bit master, which shares no part with
the quantized versions) is waited for before the step: the memory it frees is needed now.

A layer's forward groups the experts that ran by committed width and computes each group in
one call (`store.group_forward`), writes each assignment's output row, and sums rows with
routing weights in expert order (`combine`), so a layer held entirely at 16 bits gives
exactly the resident backend's result. Every few steps the quality feedback recomputes a
sampled share of quantized rows with the host master and reports relative errors (the
engine turns them into sensitivity updates and fallbacks). A width equal to the master (16, or
an MXFP4 checkpoint's own MXFP4, whose master is its dequantized values) is never sampled.

Each forward also adds, per row of the step's batch, the widths its routed choices ran at (their
sum, their minimum and how many; in quarter bits, so an MXFP4 checkpoint's own width counts its
4.25 bits per weight): the controller turns the step's rows into per-request precision
(`take_token_bits`). Tensor ops over the dispatch; one small table per layer goes to
the device and the step's rows come back once, both through the ledger (tag `expert_bits`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from engines.pagedweight.formats import weight_bits
from engines.pagedweight.importance import Importance, Key
from engines.runtime.copies import CopyEngine, CopyHandle
from engines.runtime.experts import Dispatch, ExpertBackend, combine, segments


@dataclass
class Held:
    """What the device holds for one expert: a version's parts, never written once committed."""

    bits: int
    parts: dict[str, Tensor]

    @cached_property
    def nbytes(self) -> int:  # parts are never written once committed
        return sum(t.nbytes for t in self.parts.values())


@dataclass
class Move:
    key: Key
    from_bits: int
    to_bits: int
    held: Held  # the new version (parts reused from the old one plus new buffers)
    handle: CopyHandle | None
    nbytes: int  # bytes copied host->device


@dataclass
class FeedbackSample:
    """Relative errors measured by one feedback pass (per layer and per expert)."""

    layer_error: dict[int, float] = field(default_factory=dict)
    expert_error: dict[Key, tuple[int, float]] = field(default_factory=dict)  # key -> (bits, error)
    rows: int = 0
    seconds: float = 0.0
    bytes: int = 0


class PagedWeightBackend(ExpertBackend):
    def __init__(self, stores: Mapping[Key, object], copies: CopyEngine, device: torch.device,
                 importance: Importance, feedback_share: float = 0.0, seed: int = 0, mxfp4: bool = False) -> None:
        super().__init__()
        self.mxfp4 = mxfp4  # the stores are an MXFP4 checkpoint's: width formats.MXFP4 is its own
        self.stores = dict(stores)
        self.copies, self.device, self.importance = copies, device, importance
        self.held: dict[Key, Held] = {}  # changed only through _hold (the byte ledger follows it)
        self._widths: dict[int, int] = {0: len(self.stores)}  # bits -> experts holding it (kept by _hold)
        self.pending: list[Move] = []  # changed only through _track / _untrack
        # The byte ledger: id(tensor) -> [references from held versions and moves in flight,
        # bytes, the tensor], and the bytes of all of them. A part shared by two versions (the
        # bit planes a demotion keeps) counts once; device_bytes reads it in O(1) (the arbiter
        # asks after every demotion, and a walk over every part of 256+ experts was most of a
        # simulated Mixtral step).
        self._refs: dict[int, list] = {}
        self._bytes = 0
        self.feedback_share = feedback_share
        self.seed = seed
        self.step_index = 0
        self.feedback_due = False
        self.feedback = FeedbackSample()
        # Staging slots for experts fetched on demand: two where copies run beside compute (one
        # copies while the other's expert computes), else one (a copy is then a memcpy at
        # issue: a second slot would hide nothing and only take budget from the pages).
        self.fetch_slots = 2 if copies.asynchronous else 1
        # Room for fetch_slots experts at their fetch width (set when a floor is 0 bits):
        # counted in device_bytes; at most that many are on the device at once.
        self.staging_bytes = 0
        self.fetch_bits: dict[Key, int] = {}  # width of an on-demand fetch (default: the lowest)
        self._token_bits: tuple[Tensor, Tensor, Tensor] | None = None  # per batch row: sum, min, choices
        self._layers = sorted({layer for layer, _ in self.stores})
        self._num = {i: sum(1 for layer, _ in self.stores if layer == i) for i in self._layers}
        # Held bytes per (layer, expert) as a matrix over self._layers x experts, kept by _hold:
        # a simulated step reads every layer's bytes at once (simulate_step).
        self._row = {layer: i for i, layer in enumerate(self._layers)}
        self._held_bytes = np.zeros((len(self._layers), max(self._num.values(), default=0)), dtype=np.int64)

    # -- ExpertBackend -----------------------------------------------------------------------------
    def layers(self) -> list[int]:
        return self._layers

    @property
    def dequant_scheme(self) -> str:
        """How the quantized widths are stored, for --simulate's CPU pricing (engines/sim/cost.py):
        bit planes, or RTN records (re-quantize: the packed dequantization of engines/quant)."""
        if self.mxfp4:
            return "mxfp4"
        store = next(iter(self.stores.values()), None)
        return "bitplanes" if getattr(store, "representation", "") == "bitplanes" else "packed"

    def num_experts(self, layer: int) -> int:
        return self._num[layer]

    def expert_bytes(self, layer: int, expert: int) -> int:
        held = self.held.get((layer, expert))
        return held.nbytes if held is not None else 0

    def count_experts(self, layer: int, counts: list[int]) -> None:
        """ExpertBackend's count (the held bytes of each expert with tokens), without a call per
        expert: every simulated step counts every MoE layer."""
        held, read = self.held, 0
        for e, n in enumerate(counts):
            if n and (h := held.get((layer, e))) is not None:
                read += h.nbytes
        self._stats["expert_bytes_read"] += read

    def device_bytes(self) -> int:
        """Committed versions, the buffers of moves in flight and the on-demand staging slot
        (what the device holds now, at most)."""
        return self._bytes + self.staging_bytes

    def walked_bytes(self) -> int:
        """device_bytes by walking every part (what the ledger must equal; tests check it)."""
        held = {id(t): t for h in self.held.values() for t in h.parts.values()}
        for m in self.pending:
            held.update({id(t): t for t in m.held.parts.values()})
        return sum(t.numel() * t.element_size() for t in held.values()) + self.staging_bytes

    def _ref(self, parts: Mapping[str, Tensor], n: int) -> None:
        for t in parts.values():
            r = self._refs.get(id(t))
            if r is None:
                r = self._refs[id(t)] = [0, t.nbytes, t]
                self._bytes += r[1]
            r[0] += n
            if r[0] == 0:
                del self._refs[id(t)]
                self._bytes -= r[1]

    def _hold(self, key: Key, version: Held | None) -> None:
        """Make `version` the held one of `key` (None: nothing held)."""
        old = self.held.get(key)
        if version is not None and old is not None:
            # Only the parts the versions do not share change references (a bit-plane demotion
            # keeps most of its planes): +1 then -1 on a shared part would leave it as it was.
            was, now = old.parts, version.parts
            self._ref({n: t for n, t in now.items() if was.get(n) is not t}, 1)
            self._ref({n: t for n, t in was.items() if now.get(n) is not t}, -1)
        elif version is not None:
            self._ref(version.parts, 1)
        elif old is not None:
            self._ref(old.parts, -1)
        self._tally(key, old, version)

    def _tally(self, key: Key, old: Held | None, version: Held | None) -> None:
        """The held map, the held-bytes matrix and the width counts follow `key`'s change from
        `old` to `version` (the byte ledger is the caller's)."""
        if version is None:
            self.held.pop(key, None)
        else:
            self.held[key] = version
        self._held_bytes[self._row[key[0]], key[1]] = 0 if version is None else version.nbytes
        widths = self._widths
        was, now = 0 if old is None else old.bits, 0 if version is None else version.bits
        widths[was] -= 1
        widths[now] = widths.get(now, 0) + 1

    def width_counts(self) -> dict[int, int]:
        """Bits -> how many experts hold that width now (0: not resident); a tally kept by every
        change of a held version, so reading it walks no expert."""
        return {b: n for b, n in self._widths.items() if n}

    def _track(self, move: Move) -> None:
        self._ref(move.held.parts, 1)
        self.pending.append(move)

    def _untrack(self, keep: Callable[[Move], bool]) -> list[Move]:
        """Drop the moves in flight that `keep` refuses; returns them."""
        kept, gone = [], []
        for m in self.pending:
            (kept if keep(m) else gone).append(m)
        self.pending = kept
        for m in gone:
            self._ref(m.held.parts, -1)
        return gone

    def _fetch_width(self, key: Key) -> int:
        return self.fetch_bits.get(key) or min(b for b in self.stores[key].bits if b > 0)

    def staging_slot_bytes(self) -> int:
        """The largest expert at its fetch width: one staging slot of an on-demand fetch (the
        backend needs fetch_slots of them)."""
        return max(store.nbytes(self._fetch_width(key)) for key, store in self.stores.items())

    def bits(self, key: Key) -> int:
        held = self.held.get(key)
        return held.bits if held is not None else 0

    # -- moves -------------------------------------------------------------------------------------
    def move_bytes(self, key: Key, to_bits: int) -> int:
        """Bytes a move of `key` to `to_bits` copies host->device."""
        if to_bits == 0:
            return 0
        return self.stores[key].transfer_bytes(self.bits(key), to_bits)

    def start_move(self, key: Key, to_bits: int) -> Move:
        """Issue the copies that make `key`'s version at `to_bits`. Parts held already are
        reused (not copied); nothing held is written. A move with no copy (a bit-plane
        demotion, or to 0) is committed at once."""
        held = self.held.get(key)
        from_bits = held.bits if held is not None else 0
        have = held.parts if held is not None else {}
        if to_bits == 0:
            move = Move(key, from_bits, 0, Held(0, {}), None, 0)
            self._hold(key, None)
            return move
        store = self.stores[key]
        parts, pairs = store.device_tensors(to_bits, self.device, have)
        new = Held(to_bits, parts)
        # The held parts are those of its width, so the copies' bytes are the store's (memoised).
        nbytes = store.transfer_bytes(from_bits, to_bits)
        handle = self._copy_in(pairs, nbytes) if pairs else None
        move = Move(key, from_bits, to_bits, new, handle, nbytes)
        if handle is not None and to_bits < from_bits:
            # A demotion that copies (re-quantize, or from the 16-bit master) frees memory the
            # KV cache needs now: finish it before the step (its wait counts as stall).
            handle.wait()
            move.handle = None
        if move.handle is None:
            self._hold(key, new)
        else:
            self._track(move)
        return move

    def _copy_in(self, pairs: list[tuple[Tensor, Tensor]], nbytes: int) -> CopyHandle:
        """A move's host->device copies (`nbytes`: their source bytes); counted in a simulated run."""
        if self.copies.simulated:
            return self.copies.counted("h2d", nbytes, len(pairs), tag="expert_pages")
        return self.copies.h2d(pairs, tag="expert_pages")

    def commit(self) -> list[Move]:
        """At a step boundary: wait for the moves issued so far and make their versions the
        held ones (deterministic: every move issued in a step is committed at the next)."""
        moves, self.pending = self.pending, []
        for move in moves:
            if move.handle is not None:
                move.handle.wait()
            # The move's reference to each of its parts (taken by _track) becomes the held
            # version's; the version it replaces gives up its own.
            old = self.held.get(move.key)
            self._tally(move.key, old, move.held)
            if old is not None:
                self._ref(old.parts, -1)
        return moves

    def cancel(self, keys: list[Key]) -> None:
        """Drop in-flight moves of `keys` (the arbiter took their room back): the copies still
        land, in buffers nothing will read, and are freed with the move."""
        drop = set(keys)
        for move in self.pending:
            if move.key in drop and move.handle is not None:
                move.handle.wait()  # its buffers must not be reused while the link writes them
        self._untrack(lambda m: m.key not in drop)

    def _resident(self, key: Key) -> Held | None:
        """The held version, or the one a move in flight is making (waited for); None for an
        expert at 0 bits."""
        held = self.held.get(key)
        if held is not None:
            return held
        for move in self.pending:
            if move.key == key:
                move.handle.wait()
                return move.held
        return None

    def _fetch(self, key: Key) -> tuple[Held, CopyHandle]:
        """Issue the on-demand copy of an expert at 0 bits into a staging slot at its fetch
        width (the engine's quality floor; else the lowest): used for one call, not kept."""
        store = self.stores[key]
        lowest = self._fetch_width(key)
        # Normal tensors, not inference ones: the CPU link model copies into them on its own
        # thread, outside inference mode, where writing an inference tensor is an error.
        with torch.inference_mode(False):
            parts, pairs = store.device_tensors(lowest, self.device)
        self._stats["on_demand_fetches"] += 1
        self._stats["on_demand_fetch_bytes"] += sum(src.numel() * src.element_size() for _, src in pairs)
        return Held(lowest, parts), self.copies.h2d(pairs, tag="expert_pages")

    # -- compute -----------------------------------------------------------------------------------
    def forward(self, layer: int, x: Tensor, d: Dispatch) -> Tensor:
        self._count(layer, d)
        self.importance.observe(layer, d)
        rows = segments(d)
        xs = x[d.token_index]
        out = torch.empty_like(xs)
        groups: dict[int, list[tuple[int, Held]]] = {}
        missing: list[int] = []
        for e in rows:
            held = self._resident((layer, e))
            if held is None:
                missing.append(e)
            else:
                groups.setdefault(held.bits, []).append((e, held))
        width = [0] * self._num[layer]
        for bits, members in groups.items():
            for e, _ in members:
                width[e] = bits
        for e in missing:
            width[e] = self._fetch_width((layer, e))
        self._add_token_bits(x.shape[0], d, [round(4 * weight_bits(b, self.mxfp4)) for b in width])
        # Experts off the device: the first fetch_slots copies go out before the resident experts
        # compute, then each fetched one computes while the next copies into the slot it freed.
        inflight = deque((e, *self._fetch((layer, e))) for e in missing[:self.fetch_slots])
        for bits, members in sorted(groups.items()):
            if bits == 16:  # the master itself: exactly the resident backend's computation
                for e, held in members:
                    out[rows[e]] = self.stores[(layer, e)].forward(held.parts, 16, xs[rows[e]])
                continue
            store = self.stores[(layer, members[0][0])]
            ys = store.group_forward([h.parts for _, h in members], bits, [xs[rows[e]] for e, _ in members])
            for (e, _), y in zip(members, ys):
                out[rows[e]] = y
        queued = iter(missing[self.fetch_slots:])
        while inflight:
            e, fetched, handle = inflight.popleft()
            handle.wait()
            out[rows[e]] = self.stores[(layer, e)].forward(fetched.parts, fetched.bits, xs[rows[e]])
            del fetched  # its slot is free: at most fetch_slots fetched experts on the device
            nxt = next(queued, None)
            if nxt is not None:
                inflight.append((nxt, *self._fetch((layer, nxt))))
        if self.feedback_due:
            self._check(layer, xs, out, rows, groups)
        return combine(x, d, out)

    def simulate(self, layer: int, d: Dispatch, upcoming: tuple[int, list[int]] | None = None) -> None:
        """`forward`'s decisions and counts with no compute (--simulate: `d` carries counts only):
        the bytes read, the importance from the counts (no routing weights exist), the held
        version or the move in flight each expert runs from, and an on-demand fetch, counted and
        copied through the copy engine, for each expert at 0 bits. Not kept: the per-row widths
        (the simulated dispatch has no rows, so `request_bits` stays empty) and the quality
        feedback (it compares outputs)."""
        self._count(layer, d)
        self.importance.observe_counts(layer, d.counts)
        if len(self.held) == len(self.stores):  # every expert held (floors above 0): none to fetch
            return
        self._count_fetches([(layer, e) for e in segments(d) if self._resident((layer, e)) is None])

    def _count_fetches(self, keys: list[Key]) -> list[int]:
        """A simulated step's on-demand fetches of `keys`: what `_fetch` counts, from the stores'
        memoised sizes, in one copy record (nothing reads a simulated fetch's parts; the ledger
        keeps sums). Returns each fetched version's bytes (what its compute reads)."""
        sizes, transfers = [], 0
        for key in keys:
            store, width = self.stores[key], self._fetch_width(key)
            sizes.append(store.transfer_bytes(0, width))
            transfers += len(store.parts(width))
        if keys:
            nbytes = sum(sizes)
            self._stats["on_demand_fetches"] += len(keys)
            self._stats["on_demand_fetch_bytes"] += nbytes
            self.copies.counted("h2d", nbytes, transfers, tag="expert_pages")
        return sizes

    def simulate_step(self, layers: list[int], counts: np.ndarray) -> np.ndarray | None:
        """`simulate` for every layer at once (nothing it decides depends on layer order): the
        bytes read and the importance from the counts, and the on-demand fetches of the experts
        with tokens that are neither held nor being moved in, counted in one copy record (the
        ledger keeps sums). Returns the bytes each expert runs from, for pricing: its held
        version's, or for one at 0 bits that ran, the version it computes from as `forward` does
        (the move in flight's new version, else the fetched one). The bytes read it counts are the
        held ones, as `expert_bytes` gives them layer by layer (a fetched expert's are copy bytes)."""
        held = self._held_bytes
        if layers != self._layers or counts.shape != held.shape:
            return None
        ran = counts > 0
        self._stats["expert_bytes_read"] += int(held[ran].sum())
        self.importance.observe_matrix(layers, counts)
        if len(self.held) == len(self.stores):  # every expert held (floors above 0): none to fetch
            return held
        cells = np.argwhere(ran & (held == 0)).tolist()
        if not cells:
            return held
        priced, moving, fetched, where = held.copy(), {m.key: m for m in self.pending}, [], []
        for r, e in cells:
            move = moving.get(key := (layers[r], e))
            if move is not None:
                priced[r, e] = move.held.nbytes
            else:
                fetched.append(key)
                where.append((r, e))
        for (r, e), nbytes in zip(where, self._count_fetches(fetched)):
            priced[r, e] = nbytes
        return priced

    @property
    def copies_overlap(self) -> bool:
        """--simulate: page moves are issued before a step and committed at the next boundary, so
        their copies run beside the step's compute (demotions that copy and on-demand fetches
        are waited for, a share the simulated step does not separate)."""
        return True

    def _add_token_bits(self, rows: int, d: Dispatch, width: list[int]) -> None:
        """Add this layer's choices to each batch row's running sum, minimum and count of the
        widths its experts computed at (`width`: expert -> quarter bits per weight it ran at)."""
        table = self.copies.ledger.tensor([width, d.counts], torch.long, "expert_bits")
        index = d.token_index
        per_choice = torch.repeat_interleave(table[0], table[1], output_size=index.shape[0])
        if self._token_bits is None or self._token_bits[0].shape[0] != rows:
            zeros = torch.zeros(rows, dtype=torch.long, device=index.device)
            self._token_bits = (zeros, torch.full_like(zeros, torch.iinfo(torch.long).max), zeros.clone())
        total, lowest, choices = self._token_bits
        total.index_add_(0, index, per_choice)
        lowest.scatter_reduce_(0, index, per_choice, "amin")
        choices.index_add_(0, index, torch.ones_like(per_choice))

    def take_token_bits(self) -> Tensor | None:
        """Per row of the batch since the last call, on the host: [3, rows] int64 = summed
        widths and lowest width (both in quarter bits per weight) and routed choices over every
        MoE layer (None: no forward ran); then reset."""
        bits, self._token_bits = self._token_bits, None
        return None if bits is None else self.copies.ledger.to_host(torch.stack(bits), "expert_bits")

    def _check(self, layer: int, xs: Tensor, out: Tensor, rows: dict[int, slice],
               groups: dict[int, list[tuple[int, Held]]]) -> None:
        """Quality feedback: a seeded share of this layer's quantized assignments recomputed
        with the host master; squared error over squared master output, per layer and expert."""
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step_index * 1_009 + layer)
        err_sum = ref_sum = 0.0
        for bits, members in groups.items():
            if bits in self.stores[(layer, members[0][0])].exact_bits:  # the master's own values
                continue
            for e, _ in members:
                n = rows[e].stop - rows[e].start
                take = max(1, round(n * self.feedback_share))
                pick = torch.randperm(n, generator=gen)[:take].sort().values + rows[e].start
                x_host = self.copies.ledger.to_host(xs[pick], "feedback")
                y_host = self.copies.ledger.to_host(out[pick], "feedback")
                ref = self.stores[(layer, e)].reference(x_host)  # biases and clamp as the model's
                err = float((y_host.float() - ref.float()).pow(2).sum())
                norm = float(ref.float().pow(2).sum())
                self.feedback.expert_error[(layer, e)] = (bits, err / max(norm, 1e-30))
                err_sum += err
                ref_sum += norm
                self.feedback.rows += take
                self.feedback.bytes += (x_host.numel() + y_host.numel()) * x_host.element_size()
        if ref_sum:
            self.feedback.layer_error[layer] = err_sum / ref_sum
        self.feedback.seconds += time.perf_counter() - t0

    def take_feedback(self) -> FeedbackSample:
        sample, self.feedback = self.feedback, FeedbackSample()
        return sample

    def step_stats(self) -> dict[str, int]:
        fetches = self._stats.get("on_demand_fetches", 0)
        fetched = self._stats.get("on_demand_fetch_bytes", 0)
        out = super().step_stats()
        out.update(on_demand_fetches=fetches, on_demand_fetch_bytes=fetched)
        return out

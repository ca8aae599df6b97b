"""Layer-major execution of a step (module-based batching) and attention next to a host-tier KV.

`LayerMajorExecutor.forward` runs the whole step's batch one layer at a time through the
model's public blocks: attention in micro-batches (each decode micro-batch at most
`micro_batch` sequences, each prefill chunk its own), then the layer's MLP over every token
at once, so each routed expert runs once over all tokens routed to it. Before a layer starts,
the next MoE layer's experts are queued on the expert backend (`prefetch`), so its copies
overlap this layer's compute; any ExpertBackend works (resident, streamed, paged).

`HostAttention` is the attention placement with the KV cache in the host tier: this batch's
q/k/v cross to the host (counted d2h), K/V are written into the host pool, attention runs on
the host CPU next to the KV, and its output crosses back (counted h2d). On a CPU run both
sides are the same cores and the copies go through the link model; on CUDA they are real.

Every placement runs every attention kind: the model hands each call the layer's
LayerAttention (window, softmax scale, sinks, and for MLA the expansion of the cached latent
and rope key into keys and values), so k/v here are whatever the layer's cache stores.

`StreamAttention` keeps the KV pool in the host tier but attends on the device: each
micro-batch's blocks are copied per layer into one half of a device staging buffer, the next
micro-batch's copy issued before this one attends (`stream`); with a host share, each decode
micro-batch's first sequences are attended as HostAttention does and the rest so (`split`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.runtime.attention import AttentionBatch, DecodeGroup, LayerAttention, PrefillSegment, attend_cached
from engines.runtime.batch import StepBatch
from engines.runtime.copies import CopyEngine, CopyHandle
from engines.runtime.executor import Executor
from engines.runtime.kv_cache import KVCache, block_rows, gather_blocks, gather_tables
from engines.runtime.model import Attend, ForwardResult, MoEModel
from engines.runtime.transfer import TransferLedger

MicroBatch = tuple[int, int, AttentionBatch]  # rows [lo, hi) of the flat batch, rebased layout


def slice_decodes(attn: AttentionBatch, lo: int, hi: int) -> AttentionBatch:
    """Decode rows [lo, hi) of `attn` as their own layout, rows rebased to 0, each group's
    block tables trimmed to its longest context."""
    groups = []
    for g in attn.decodes:
        a, b = max(g.row, lo), min(g.row + g.tables.shape[0], hi)
        if a >= b:
            continue
        ctx = g.ctx[a - g.row : b - g.row]
        blocks = -(-int(ctx.max()) // g.block_size)
        groups.append(DecodeGroup(a - lo, g.tables[a - g.row : b - g.row, :blocks], ctx, g.block_size))
    return AttentionBatch(attn.slots[lo:hi], hi - lo, groups)


def split_attention(attn: AttentionBatch, micro_batch: int) -> list[MicroBatch]:
    """Cut a step's attention layout into micro-batches: decode rows in runs of at most
    `micro_batch` sequences (a decode group split where a run ends, each piece's block tables
    trimmed to its longest context), then every prefill chunk together (their rows follow the
    decodes': the projections run once over all of them, attention per chunk inside). Rows
    are rebased to 0."""
    out: list[MicroBatch] = []
    for lo in range(0, attn.num_decode, micro_batch):
        hi = min(lo + micro_batch, attn.num_decode)
        out.append((lo, hi, slice_decodes(attn, lo, hi)))
    if attn.prefills:
        lo, hi = attn.prefills[0].row, attn.prefills[-1].row + attn.prefills[-1].length
        pieces = [PrefillSegment(seg.row - lo, seg.length, seg.start_pos, seg.table) for seg in attn.prefills]
        out.append((lo, hi, AttentionBatch(attn.slots[lo:hi], 0, prefills=pieces)))
    return out


def on_host(attn: AttentionBatch, ledger: TransferLedger) -> AttentionBatch:
    """The attention layout's index tensors on the host (counted when they cross)."""
    if attn.slots.device.type == "cpu":
        return attn

    def host(t: Tensor) -> Tensor:
        return ledger.to_host(t, "attention")

    return AttentionBatch(
        host(attn.slots), attn.num_decode,
        [DecodeGroup(g.row, host(g.tables), host(g.ctx), g.block_size) for g in attn.decodes],
        [PrefillSegment(p.row, p.length, p.start_pos, host(p.table)) for p in attn.prefills],
    )


def normal_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool = False) -> Tensor:
    """A zeroed buffer that is not an inference tensor: the CPU link model copies into it on
    its own thread, outside inference mode, where writing an inference tensor is an error."""
    with torch.inference_mode(False):
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)


class HostAttention:
    """Attention over a host-tier KV cache, computed on the host (see the module docstring)."""

    def __init__(self, kv: KVCache, copies: CopyEngine) -> None:
        self.kv, self.copies = kv, copies
        self._sinks: dict[int, Tensor] = {}  # layer -> host copy of its sink logits (CUDA runs)

    def _buffer(self, t: Tensor, device: torch.device) -> Tensor:
        # Normal (not inference-mode) tensors: the CPU link model copies into them on its own
        # thread, outside inference mode, where writing an inference tensor is an error.
        with torch.inference_mode(False):
            pin = device.type == "cpu" and self.copies.device.type == "cuda"
            return torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)

    def send(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, CopyHandle]:
        """Issue q/k/v's crossing to the host (counted d2h); `finish` waits for it."""
        cpu = torch.device("cpu")
        qh, kh, vh = self._buffer(q, cpu), self._buffer(k, cpu), self._buffer(v, cpu)
        return qh, kh, vh, self.copies.d2h([(qh, q), (kh, k), (vh, v)], tag="activations")

    def finish(self, i: int, sent: tuple[Tensor, Tensor, Tensor, CopyHandle], attn: AttentionBatch,
               device: torch.device, spec: LayerAttention) -> Tensor:
        """Write K/V into the host pool, attend on the host, send the output back (counted h2d)."""
        qh, kh, vh, handle = sent
        handle.wait()
        self.kv.write(i, attn.slots, kh, vh)
        o = attend_cached(qh, kh, vh, self.kv, i, attn, self._on_host(i, spec))
        out = self._buffer(o, device)
        self.copies.h2d([(out, o)], tag="activations").wait()
        return out

    def _on_host(self, i: int, spec: LayerAttention) -> LayerAttention:
        """`spec` with its sink logits on the host: copied once per layer (counted d2h, tag
        "weights"), since the host attends and device sinks cannot join a host softmax."""
        if spec.sinks is None or spec.sinks.device.type == "cpu":
            return spec
        if i not in self._sinks:
            self._sinks[i] = self._buffer(spec.sinks, torch.device("cpu"))
            self.copies.d2h([(self._sinks[i], spec.sinks)], tag="weights").wait()
        return dataclasses.replace(spec, sinks=self._sinks[i])

    def __call__(self, i: int, q: Tensor, k: Tensor, v: Tensor, attn: AttentionBatch, spec: LayerAttention) -> Tensor:
        return self.finish(i, self.send(q, k, v), attn, q.device, spec)


class _Staged:
    """One staging half as a KV cache for paged_attention: blocks [K, n, B, hd] (any layer)."""

    def __init__(self, k: Tensor, v: Tensor, block_size: int) -> None:
        self.k, self.v, self.block_size = k, v, block_size

    def pools(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.k, self.v

    def gather(self, layer: int, tables: Tensor) -> tuple[Tensor, Tensor]:
        return gather_tables(self.k, self.v, tables)


@dataclass
class StagedPart:
    """One attention micro-batch of a streamed-KV step: rows [lo, hi) of the flat batch, the
    first `host_rows` attended on the host (split), the rest on the device over staged blocks."""

    lo: int
    hi: int
    host_rows: int
    host_attn: AttentionBatch | None  # the host rows' layout over the host pool (host tensors)
    attn: AttentionBatch | None  # the device rows' layout rebased onto the staging half (device)
    host_slots: Tensor | None  # the device rows' slots in the host pool, for their new K/V
    copy_ids: Tensor  # host-pool blocks copied in, in staging order (cpu)
    space: int  # staging blocks the part uses (copied + blocks holding only new tokens)


def decode_cuts(ctxs: list[int], micro_batch: int, host_share: float, block: int,
                cap: int) -> list[tuple[int, int, int]]:
    """The decode rows of a step (context lengths `ctxs`, shortest first) cut into parts, as
    (lo, hi, host rows from lo): runs of at most `micro_batch` sequences, `host_share` of each
    attended on the host, the rest cut further so each part's KV blocks fit a staging half of
    `cap` blocks of `block` tokens. The measured executor and the simulated one cut alike."""
    parts: list[tuple[int, int, int]] = []
    for lo in range(0, len(ctxs), micro_batch):
        hi = min(lo + micro_batch, len(ctxs))
        h = round(host_share * (hi - lo))
        a, first = lo + h, True
        if a == hi:
            parts.append((lo, hi, h))
        while a < hi:
            b, space = a, 0
            while b < hi and space + -(-ctxs[b] // block) <= cap:
                space += -(-ctxs[b] // block)
                b += 1
            if b == a:
                raise ValueError(f"a sequence of {ctxs[a]} tokens needs {-(-ctxs[a] // block)} staging blocks; "
                                 f"a staging half holds {cap}")
            parts.append((lo, b, h) if first else (a, b, 0))
            a, first = b, False
    return parts


class StreamAttention:
    """Device attention over a host-tier KV cache (`stream`), or a split of each decode
    micro-batch between the host and that (`split`).

    Per micro-batch and layer the blocks holding its sequences' earlier tokens are gathered on
    the host into a host staging copy and copied (CopyEngine, tag "kv") into one half of a
    device staging buffer; the block tables are rebased onto it (copied blocks first, then the
    blocks only this step's tokens fill). The new K/V are written into the staging half, so
    attention reads exactly what the host pool will hold, then cross d2h (tag "kv") and are
    written into the host pool when the step ends (no block a step writes is read again
    within it). The next micro-batch's copy (the next layer's first, after a layer's last) is
    issued before this one attends, into the other half: the link overlaps attention.
    Prefill chunks are attended the same way (a chunk starting its sequence copies nothing).
    """

    def __init__(self, kv, copies: CopyEngine, ledger: TransferLedger,
                 half_blocks: int, host_share: float = 0.0) -> None:
        if half_blocks < 1:
            raise ValueError(f"a staging half needs at least one block, got {half_blocks}")
        self.kv, self.copies, self.ledger = kv, copies, ledger
        self.half_blocks, self.host_share = half_blocks, host_share
        self.host = HostAttention(kv, copies)
        k0, v0 = kv.k[0], kv.v[0]
        self.heads, _, self.block_size, self.kdim = k0.shape
        self.vdim = v0.shape[-1]
        dev, cpu = copies.device, torch.device("cpu")
        pin = dev.type == "cuda"
        B, K = self.block_size, self.heads
        self.stage = [(normal_tensor((K, half_blocks, B, self.kdim), k0.dtype, dev),
                       normal_tensor((K, half_blocks, B, self.vdim), v0.dtype, dev)) for _ in range(2)]
        self.host_stage = [(normal_tensor((K * half_blocks * B * self.kdim,), k0.dtype, cpu, pin),
                            normal_tensor((K * half_blocks * B * self.vdim,), v0.dtype, cpu, pin)) for _ in range(2)]
        self.num_layers = len(kv.k)
        self._parts: list[StagedPart] = []
        self._issued: dict[tuple[int, int], tuple[int, CopyHandle | None]] = {}
        self._pending: list[tuple[int, Tensor, Tensor, Tensor, CopyHandle]] = []
        self._current = (0, 0)

    def nbytes(self) -> int:
        """Device bytes of the staging buffer (both halves)."""
        return sum(t.numel() * t.element_size() for pair in self.stage for t in pair)

    # -- the step's micro-batches --------------------------------------------------------------------
    def begin(self, attn: AttentionBatch, host: AttentionBatch, micro_batch: int) -> list[MicroBatch]:
        """Cut the step into parts (decode runs of at most `micro_batch` sequences, the device
        rows of each cut further to fit a staging half; then each prefill chunk) and lay each
        out over the staging buffer. `attn` is the device layout, `host` the same on the host."""
        ctxs = [int(c) for g in host.decodes for c in g.ctx.tolist()]
        parts: list[StagedPart] = [self._decode_part(attn, host, lo, hi, h) for lo, hi, h in
                                   decode_cuts(ctxs, micro_batch, self.host_share, self.block_size, self.half_blocks)]
        for dev_seg, seg in zip(attn.prefills, host.prefills):
            parts.append(self._prefill_part(dev_seg, seg, host.slots))
        self._parts, self._issued = parts, {}
        return [(p.lo, p.hi, p.attn) for p in parts]  # type: ignore[misc]

    def _decode_part(self, attn: AttentionBatch, host: AttentionBatch, lo: int, hi: int, h: int) -> StagedPart:
        B = self.block_size
        host_attn = slice_decodes(host, lo, lo + h) if h else None
        if lo + h == hi:
            return StagedPart(lo, hi, h, host_attn, None, None, torch.zeros(0, dtype=torch.long), 0)
        dev, src = slice_decodes(attn, lo + h, hi), slice_decodes(host, lo + h, hi)
        rows = [(t, int(c)) for g in src.decodes for t, c in zip(g.tables.tolist(), g.ctx.tolist())]
        n_copy = sum(-(-(c - 1) // B) for _, c in rows)
        ids: list[int] = []
        maps: list[list[int]] = []
        fresh = n_copy
        for table, c in rows:
            held, space = -(-(c - 1) // B), -(-c // B)
            maps.append(list(range(len(ids), len(ids) + held)) + list(range(fresh, fresh + space - held)))
            ids += table[:held]
            fresh += space - held
        slots = [m[(c - 1) // B] * B + (c - 1) % B for m, (_, c) in zip(maps, rows)]
        groups, r = [], 0
        for g in dev.decodes:
            n, width = g.tables.shape
            tables = [m + [0] * (width - len(m)) for m in maps[r : r + n]]
            groups.append(DecodeGroup(g.row, self.ledger.tensor(tables, torch.long, "attention"), g.ctx, B))
            r += n
        staged = AttentionBatch(self.ledger.tensor(slots, torch.long, "attention"), hi - lo - h, groups)
        return StagedPart(lo, hi, h, host_attn, staged, src.slots, torch.tensor(ids, dtype=torch.long), fresh)

    def _prefill_part(self, dev_seg: PrefillSegment, seg: PrefillSegment, host_slots: Tensor) -> StagedPart:
        B, s, n = self.block_size, seg.start_pos, seg.length
        held, space = -(-s // B), -(-(s + n) // B)
        if space > self.half_blocks:
            raise ValueError(f"a prefill chunk reaching {s + n} tokens needs {space} staging blocks; "
                             f"a staging half holds {self.half_blocks}")
        table = self.ledger.tensor(list(range(space)), torch.long, "attention")
        slots = self.ledger.tensor(list(range(s, s + n)), torch.long, "attention")
        staged = AttentionBatch(slots, 0, prefills=[PrefillSegment(0, n, s, table)])
        ids = seg.table[:held].to("cpu", torch.long)
        return StagedPart(seg.row, seg.row + n, 0, None, staged, host_slots[seg.row : seg.row + n], ids, space)

    # -- copies --------------------------------------------------------------------------------------
    def enter(self, i: int, j: int) -> None:
        """Part j of layer i attends next: make sure its copy is issued, and issue the next
        part's (the next layer's first after a layer's last) into the other half."""
        m, g = len(self._parts), i * len(self._parts) + j
        self._current = (i, j)
        if (i, j) not in self._issued:
            self._issue(i, j, g)
        nxt = (i, j + 1) if j + 1 < m else ((i + 1, 0) if i + 1 < self.num_layers else None)
        if nxt is not None and nxt not in self._issued:
            self._issue(*nxt, g + 1)

    def _issue(self, i: int, j: int, g: int) -> None:
        part, half = self._parts[j], g % 2
        n = part.copy_ids.numel()
        handle = None
        if n and part.attn is not None:
            K, B = self.heads, self.block_size
            hk = self.host_stage[half][0][: K * n * B * self.kdim].view(K, n, B, self.kdim)
            hv = self.host_stage[half][1][: K * n * B * self.vdim].view(K, n, B, self.vdim)
            rows = block_rows(self.kv.k[i], part.copy_ids)
            gather_blocks(self.kv.k[i], rows, out=hk)
            gather_blocks(self.kv.v[i], rows, out=hv)
            dk, dv = self.stage[half]
            handle = self.copies.h2d([(dk[:, :n], hk), (dv[:, :n], hv)], tag="kv")
        self._issued[(i, j)] = (half, handle)

    # -- attention -----------------------------------------------------------------------------------
    def __call__(self, i: int, q: Tensor, k: Tensor, v: Tensor, attn: AttentionBatch, spec: LayerAttention) -> Tensor:
        ci, j = self._current
        if ci != i:
            raise RuntimeError(f"StreamAttention: layer {i} attends, but part {j} of layer {ci} was entered")
        part = self._parts[j]
        half, handle = self._issued.pop((i, j))
        h = part.host_rows
        sent = self.host.send(q[:h], k[:h], v[:h]) if h else None  # issued first: crosses while the device attends
        outs = []
        if part.attn is not None:
            qd, kd, vd = q[h:], k[h:], v[h:]
            if handle is not None:
                handle.wait()
            dk, dv = self.stage[half]
            K = kd.shape[1]
            dk.view(K, -1, kd.shape[2])[:, part.attn.slots] = kd.transpose(0, 1)
            dv.view(K, -1, vd.shape[2])[:, part.attn.slots] = vd.transpose(0, 1)
            outs.append(attend_cached(qd, kd, vd, _Staged(dk, dv, self.block_size), i, part.attn, spec))
            kh = normal_tensor(tuple(kd.shape), kd.dtype, torch.device("cpu"), self.copies.device.type == "cuda")
            vh = normal_tensor(tuple(vd.shape), vd.dtype, torch.device("cpu"), self.copies.device.type == "cuda")
            self._pending.append((i, part.host_slots, kh, vh, self.copies.d2h([(kh, kd), (vh, vd)], tag="kv")))
        if sent is not None:
            outs.insert(0, self.host.finish(i, sent, part.host_attn, q.device, spec))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def finish_step(self) -> None:
        """Write the step's new K/V (device rows) into the host pool once their copies landed."""
        for i, slots, kh, vh, handle in self._pending:
            handle.wait()
            self.kv.write(i, slots, kh, vh)
        self._pending, self._issued = [], {}


class LayerMajorExecutor(Executor):
    def __init__(self, model: MoEModel, ledger: TransferLedger, micro_batch: int,
                 attend: Attend | None = None, host_layout: bool = False) -> None:
        super().__init__(model, ledger)
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        self.micro_batch, self.attend, self.host_layout = micro_batch, attend, host_layout

    def device_kv_bytes(self) -> int:
        """The KV staging buffer of placements stream and split (0 for host and device)."""
        return self.attend.nbytes() if isinstance(self.attend, StreamAttention) else 0

    def forward(self, batch: StepBatch) -> ForwardResult:
        m = self.model
        cfg, experts = m.config, m.experts
        with torch.inference_mode():
            x, (cos, sin) = m.embed(batch.token_ids, batch.positions)
            stream = self.attend if isinstance(self.attend, StreamAttention) else None
            if stream is not None:
                parts = stream.begin(batch.attn, on_host(batch.attn, self.ledger), self.micro_batch)
            else:
                attn = on_host(batch.attn, self.ledger) if self.host_layout else batch.attn
                parts = split_attention(attn, self.micro_batch)
            moe_layers = experts.layers()
            # Queue a layer ahead only when every expert is likely to run (T x top_k >= E):
            # for a small batch the copies wait for the router, so no unused expert is copied.
            ahead = x.shape[0] * cfg.top_k >= cfg.num_experts
            if ahead and moe_layers:
                experts.prefetch(moe_layers[0])
            counts: dict[int, list[int]] = {}
            for i in range(cfg.num_layers):
                nxt = next((j for j in moe_layers if j > i), None)
                if ahead and nxt is not None:
                    experts.prefetch(nxt)
                outs = []
                for j, (lo, hi, sub) in enumerate(parts):
                    if stream is not None:
                        stream.enter(i, j)  # also issues the next part's KV copy
                    outs.append(m.attention_block(i, x[lo:hi], (cos[lo:hi], sin[lo:hi]), sub, self.attend))
                x = torch.cat(outs)
                x, layer_counts = m.mlp_block(i, x)
                if layer_counts is not None:
                    counts[i] = layer_counts
            if stream is not None:
                stream.finish_step()
            return ForwardResult(m.head(x, batch.logit_rows), counts)

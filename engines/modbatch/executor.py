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
"""

from __future__ import annotations

import torch
from torch import Tensor

from engines.runtime.attention import AttentionBatch, DecodeGroup, PrefillSegment, paged_attention
from engines.runtime.copies import CopyEngine
from engines.runtime.executor import Executor
from engines.runtime.kv_cache import KVCache
from engines.runtime.model import Attend, ForwardResult, MoEModel
from engines.runtime.transfer import TransferLedger
from engines.runtime.batch import StepBatch

MicroBatch = tuple[int, int, AttentionBatch]  # rows [lo, hi) of the flat batch, rebased layout


def split_attention(attn: AttentionBatch, micro_batch: int) -> list[MicroBatch]:
    """Cut a step's attention layout into micro-batches: decode rows in runs of at most
    `micro_batch` sequences (a decode group split where a run ends, each piece's block tables
    trimmed to its longest context), then one per prefill chunk. Rows are rebased to 0."""
    out: list[MicroBatch] = []
    for lo in range(0, attn.num_decode, micro_batch):
        hi = min(lo + micro_batch, attn.num_decode)
        groups = []
        for g in attn.decodes:
            a, b = max(g.row, lo), min(g.row + g.tables.shape[0], hi)
            if a >= b:
                continue
            ctx = g.ctx[a - g.row : b - g.row]
            blocks = -(-int(ctx.max()) // g.block_size)
            groups.append(DecodeGroup(a - lo, g.tables[a - g.row : b - g.row, :blocks], ctx, g.block_size))
        out.append((lo, hi, AttentionBatch(attn.slots[lo:hi], hi - lo, groups)))
    for seg in attn.prefills:
        lo, hi = seg.row, seg.row + seg.length
        piece = PrefillSegment(0, seg.length, seg.start_pos, seg.table)
        out.append((lo, hi, AttentionBatch(attn.slots[lo:hi], 0, prefills=[piece])))
    return out


def on_host(attn: AttentionBatch, ledger: TransferLedger) -> AttentionBatch:
    """The attention layout's index tensors on the host (counted when they cross)."""
    if attn.slots.device.type == "cpu":
        return attn
    host = (lambda t: ledger.to_host(t, "attention"))
    return AttentionBatch(
        host(attn.slots), attn.num_decode,
        [DecodeGroup(g.row, host(g.tables), host(g.ctx), g.block_size) for g in attn.decodes],
        [PrefillSegment(p.row, p.length, p.start_pos, host(p.table)) for p in attn.prefills],
    )


class HostAttention:
    """Attention over a host-tier KV cache, computed on the host (see the module docstring)."""

    def __init__(self, kv: KVCache, copies: CopyEngine, windows: tuple[int | None, ...]) -> None:
        self.kv, self.copies, self.windows = kv, copies, windows

    def _buffer(self, t: Tensor, device: torch.device) -> Tensor:
        # Normal (not inference-mode) tensors: the CPU link model copies into them on its own
        # thread, outside inference mode, where writing an inference tensor is an error.
        with torch.inference_mode(False):
            pin = device.type == "cpu" and self.copies.device.type == "cuda"
            return torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)

    def __call__(self, i: int, q: Tensor, k: Tensor, v: Tensor, attn: AttentionBatch) -> Tensor:
        cpu = torch.device("cpu")
        qh, kh, vh = self._buffer(q, cpu), self._buffer(k, cpu), self._buffer(v, cpu)
        self.copies.d2h([(qh, q), (kh, k), (vh, v)], tag="activations").wait()
        self.kv.write(i, attn.slots, kh, vh)
        o = paged_attention(qh, kh, vh, self.kv, i, attn, self.windows[i])
        out = self._buffer(o, q.device)
        self.copies.h2d([(out, o)], tag="activations").wait()
        return out


class LayerMajorExecutor(Executor):
    def __init__(self, model: MoEModel, ledger: TransferLedger, micro_batch: int,
                 attend: Attend | None = None, host_layout: bool = False) -> None:
        super().__init__(model, ledger)
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        self.micro_batch, self.attend, self.host_layout = micro_batch, attend, host_layout

    def forward(self, batch: StepBatch) -> ForwardResult:
        m = self.model
        cfg, experts = m.config, m.experts
        with torch.inference_mode():
            x, (cos, sin) = m.embed(batch.token_ids, batch.positions)
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
                x = torch.cat([m.attention_block(i, x[lo:hi], (cos[lo:hi], sin[lo:hi]), sub, self.attend)
                               for lo, hi, sub in parts])
                x, layer_counts = m.mlp_block(i, x)
                if layer_counts is not None:
                    counts[i] = layer_counts
            return ForwardResult(m.head(x, batch.logit_rows), counts)

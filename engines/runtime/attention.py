"""Rotary embeddings and attention over the paged KV cache (torch reference path).

A step's tokens are one flat batch [T, ...] with no padding: first the decode tokens (one
per sequence), then each prefill chunk. Decodes share a few batched SDPA calls over their
gathered block tables; each prefill chunk gets its own call, with a plain causal kernel when
the chunk starts the sequence (the common case) and an explicit mask when it continues one.
Decodes are grouped by context length (the engine orders them shortest first) so that the
padding of a group's gathered blocks stays small: on CPU the gather copy dominates a decode
step, and one table padded to the longest sequence nearly doubled it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.runtime.kv_cache import KVCache


def rope_inv_freq(head_dim: int, theta: float, device: torch.device) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [T, hd] computed in float32 (as transformers does), then cast to the model dtype."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, hd]; rotate-half convention of Llama-family checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclass
class PrefillSegment:
    row: int  # first row of the chunk in the flat batch
    length: int
    start_pos: int  # position of the chunk's first token in its sequence
    table: Tensor  # [nb] block ids covering positions [0, start_pos + length)


@dataclass
class DecodeGroup:
    """Decode rows [row, row + n) of similar context length, attended in one batched call."""

    row: int
    tables: Tensor  # [n, nb] block tables, padded with block 0
    ctx: Tensor  # [n] context length including the new token
    block_size: int
    _masks: dict[int | None, Tensor] = field(default_factory=dict)

    def mask(self, window: int | None) -> Tensor:
        """[1, n, 1, nb*B] keys visible to each decode token (shared by all layers)."""
        if window not in self._masks:
            padded = self.tables.shape[1] * self.block_size
            ctx = self.ctx[:, None]
            key_pos = torch.arange(padded, device=ctx.device)[None, :]
            mask = key_pos < ctx
            if window is not None:
                mask &= key_pos > ctx - 1 - window
            self._masks[window] = mask[None, :, None, :]
        return self._masks[window]


@dataclass
class AttentionBatch:
    """Where each token of the flat batch goes in the cache and what it may attend to."""

    slots: Tensor  # [T] flat cache slot of each token
    num_decode: int
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)


def group_by_length(lengths: list[int], slack: float = 1.25) -> list[tuple[int, int]]:
    """Split ascending `lengths` into runs [lo, hi) whose longest is at most `slack` x the
    shortest: each run is padded to its longest, so padding stays under (slack - 1)."""
    groups, lo = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] > slack * lengths[lo]:
            groups.append((lo, i))
            lo = i
    return groups


def paged_attention(
    q: Tensor, k: Tensor, v: Tensor, cache: KVCache, layer: int, batch: AttentionBatch, window: int | None
) -> Tensor:
    """q [T, H, hd], k/v [T, K, hd] of this step (already written to the cache) -> [T, H, hd]."""
    out = torch.empty_like(q)
    for g in batch.decodes:
        # GQA without repeating K/V: the G query heads sharing a KV head are that head's
        # "query rows". q [n, H, hd] -> [K, n, G, hd] against K/V [K, n, L, hd].
        n = g.tables.shape[0]
        kc, vc = cache.gather(layer, g.tables)
        qg = q[g.row : g.row + n].view(n, kc.shape[0], -1, q.shape[-1]).transpose(0, 1)
        o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=g.mask(window))
        out[g.row : g.row + n] = o.transpose(0, 1).reshape(n, q.shape[1], q.shape[2])
    for seg in batch.prefills:
        rows = slice(seg.row, seg.row + seg.length)
        qs = q[rows].transpose(0, 1)[None]  # [1, H, n, hd]
        if seg.start_pos == 0 and window is None:
            ks, vs = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            ctx = seg.start_pos + seg.length
            kc, vc = cache.gather(layer, seg.table[None])  # [K, 1, nb*B, hd]
            ks, vs = kc[:, 0, :ctx][None], vc[:, 0, :ctx][None]
            q_pos = torch.arange(seg.start_pos, ctx, device=q.device)[:, None]
            key_pos = torch.arange(ctx, device=q.device)[None, :]
            mask = key_pos <= q_pos
            if window is not None:
                mask &= key_pos > q_pos - window
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out

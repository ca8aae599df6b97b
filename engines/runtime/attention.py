"""Rotary embeddings and attention over the paged KV cache (torch reference path).

A step's tokens are one flat batch [T, ...] with no padding: first the decode tokens (one
per sequence), then each prefill chunk. Decodes share one batched SDPA call over their
gathered block tables; each prefill chunk gets its own call, with a plain causal kernel when
the chunk starts the sequence (the common case) and an explicit mask when it continues one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.runtime.kv_cache import PagedKVCache


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
class AttentionBatch:
    """Where each token of the flat batch goes in the cache and what it may attend to."""

    slots: Tensor  # [T] flat cache slot of each token
    num_decode: int
    decode_tables: Tensor | None = None  # [Nd, nb], padded with block 0
    decode_ctx: Tensor | None = None  # [Nd] context length including the new token
    prefills: list[PrefillSegment] = field(default_factory=list)
    _decode_masks: dict[int | None, Tensor] = field(default_factory=dict)

    def decode_mask(self, padded_len: int, window: int | None) -> Tensor:
        """[Nd, 1, 1, padded_len] keys visible to each decode token (shared by all layers)."""
        if window not in self._decode_masks:
            ctx = self.decode_ctx[:, None]
            key_pos = torch.arange(padded_len, device=ctx.device)[None, :]
            mask = key_pos < ctx
            if window is not None:
                mask &= key_pos > ctx - 1 - window
            self._decode_masks[window] = mask[:, None, None, :]
        return self._decode_masks[window]


def paged_attention(
    q: Tensor, k: Tensor, v: Tensor, cache: PagedKVCache, layer: int, batch: AttentionBatch, window: int | None
) -> Tensor:
    """q [T, H, hd], k/v [T, K, hd] of this step (already written to the cache) -> [T, H, hd]."""
    out = torch.empty_like(q)
    nd = batch.num_decode
    if nd:
        kc, vc = cache.gather(layer, batch.decode_tables)  # [Nd, L, K, hd]
        mask = batch.decode_mask(kc.shape[1], window)
        out[:nd] = F.scaled_dot_product_attention(
            q[:nd, :, None, :],  # [Nd, H, 1, hd]
            kc.transpose(1, 2),
            vc.transpose(1, 2),
            attn_mask=mask,
            enable_gqa=True,
        )[:, :, 0, :]
    for seg in batch.prefills:
        rows = slice(seg.row, seg.row + seg.length)
        qs = q[rows].transpose(0, 1)[None]  # [1, H, n, hd]
        if seg.start_pos == 0 and window is None:
            ks, vs = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            ctx = seg.start_pos + seg.length
            kc, vc = cache.gather(layer, seg.table[None])
            ks, vs = kc[0, :ctx].transpose(0, 1)[None], vc[0, :ctx].transpose(0, 1)[None]
            q_pos = torch.arange(seg.start_pos, ctx, device=q.device)[:, None]
            key_pos = torch.arange(ctx, device=q.device)[None, :]
            mask = key_pos <= q_pos
            if window is not None:
                mask &= key_pos > q_pos - window
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out

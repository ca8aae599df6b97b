"""Rotary embeddings (plain, partial, interleaved, YaRN), RMSNorm and attention over the
paged KV cache (torch reference path).

A step's tokens are one flat batch [T, ...] with no padding: first the decode tokens (one
per sequence), then each prefill chunk. Decodes share a few batched SDPA calls over their
gathered block tables; each prefill chunk gets its own call, with a plain causal kernel when
the chunk starts the sequence (the common case) and an explicit mask when it continues one.
Decodes are grouped by context length (the engine orders them shortest first) so that the
padding of a group's gathered blocks stays small: on CPU the gather copy dominates a decode
step, and one table padded to the longest sequence nearly doubled it.

`LayerAttention` carries what a layer's attention needs besides q/k/v (window, scale, sinks,
MLA's expansion of its latent), so `attend_cached` runs it over any KV the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.runtime import cpu_attention
from engines.runtime.config import RopeConfig
from engines.runtime.kv_cache import KVCache


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """In float32, then back to x's dtype before the weight (transformers' order of operations)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device) -> Tensor:
    if torch.device(device).type == "meta":  # shapes only; meta arange costs a ~3 s import of torch._refs
        return torch.empty(head_dim // 2, dtype=torch.float32, device=device)
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def rope_frequencies(spec: RopeConfig, device: torch.device) -> tuple[Tensor, float]:
    """(inverse frequencies [dim/2], factor on cos/sin): plain RoPE, or YaRN (arXiv 2309.00071):
    frequencies below the correction range interpolated by `factor`, above it kept, a linear
    ramp between, and cos/sin scaled by the attention factor."""
    inv_freq = rope_inv_freq(spec.dim, spec.theta, device)
    if spec.yarn is None:
        return inv_freq, 1.0
    p, dim = spec.yarn, spec.dim
    original = float(p["original_max_position_embeddings"])
    factor = float(p.get("factor") or spec.max_position_embeddings / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention_factor)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """cos/sin [T, dim] computed in float32 (as transformers does), then cast to the model dtype."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool = False) -> Tensor:
    """x [T, heads, hd]; the first cos.shape[-1] dims rotate (partial rotary), the rest pass.
    Rotate-half pairs (x_i, x_{i+dim/2}) as Llama-family checkpoints do; `interleave` pairs
    (x_2i, x_2i+1), as DeepSeek does, and writes the result de-interleaved (transformers' layout:
    the same dot products, since queries and keys both get it)."""
    dim = cos.shape[-1]
    rot, rest = (x, None) if dim == x.shape[-1] else (x[..., :dim], x[..., dim:])
    cos, sin, half = cos[:, None, :], sin[:, None, :], dim // 2
    if interleave:
        c, s = cos[..., :half], sin[..., :half]
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    else:
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
    return out if rest is None else torch.cat((out, rest), dim=-1)


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
    _starts: dict[int | None, Tensor] = field(default_factory=dict)

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

    def first_key(self, window: int | None) -> Tensor:
        """[n] the first key position each decode token sees (keys first_key <= t < ctx: the
        same keys as `mask`), for attention that reads the table in place."""
        if window not in self._starts:
            self._starts[window] = ((self.ctx - window).clamp(min=0) if window is not None
                                    else torch.zeros_like(self.ctx))
        return self._starts[window]


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


# What the cache holds -> attention's K/V, [K, N, L, d] each (MLA expands its latent here).
Expand = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention needs besides q, this step's K/V and the layout, wherever it
    runs (the model's cache, a host pool, a device staging buffer): its sliding window, softmax
    scale (None: 1/sqrt(query head dim)), per-head sink logits [H] (gpt-oss) and, for MLA,
    `expand`: how the cache's contents (latent, rope key) become keys and values."""

    window: int | None = None
    scale: float | None = None
    sinks: Tensor | None = None
    expand: Expand | None = None


def attend_cached(q: Tensor, k: Tensor, v: Tensor, cache: KVCache, layer: int, batch: AttentionBatch,
                  spec: LayerAttention) -> Tensor:
    """paged_attention for `spec`'s layer, where k and v are this step's cache contents (already
    written to `cache`): expanded as the cached ones are (MLA), -> [T, H, value dim]."""
    ks, vs = (k, v) if spec.expand is None else spec.expand(k, v)
    return paged_attention(q, ks, vs, cache, layer, batch, spec.window, scale=spec.scale, expand=spec.expand,
                           sinks=spec.sinks)


def no_per_shape_attention_plans() -> None:
    """On CUDA, leave SDPA's cuDNN backend out (process-wide): it builds a graph for each new
    sequence length (a first call of each shape costs milliseconds to tens of them; torchtune#1652,
    ml-explore/mlx#2743), and decode meets a new context length every KV block, a prefill every new
    prompt length; flash and memory-efficient attention run any shape at once
    (harness/bench/sdpa_shapes.py times both on a GPU)."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def context_mask(start: int, ctx: int, window: int | None, device: torch.device | str | None = None) -> Tensor:
    """[ctx - start, ctx] bool: which keys each query of a prefill chunk at positions start..ctx-1
    attends (those at or before it, and within `window` of it): a chunk after context, or under a
    sliding window, is attended with this mask over the whole rectangle (SDPA's is_causal aligns
    the diagonal to the top left corner, right only for a chunk from position 0)."""
    q_pos = torch.arange(start, ctx, device=device)[:, None]
    key_pos = torch.arange(ctx, device=device)[None, :]
    mask = key_pos <= q_pos
    if window is not None:
        mask &= key_pos > q_pos - window
    return mask


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None,
            sinks: Tensor | None) -> Tensor:
    """SDPA over [..., n, d] queries and [..., L, d] keys (key heads repeated to the query heads
    where they are fewer). With `sinks` (broadcastable to [..., n, 1]) each softmax row gets one
    extra logit that takes probability mass and adds no value (gpt-oss); SDPA has no such
    input, so that case computes the softmax itself."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[-3] != k.shape[-3])
    if q.shape[-3] != k.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    logits = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        n, L = logits.shape[-2], logits.shape[-1]
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    logits = torch.cat((logits, sinks.to(logits.dtype).expand(*logits.shape[:-1], 1)), dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def paged_attention(
    q: Tensor, k: Tensor, v: Tensor, cache: KVCache, layer: int, batch: AttentionBatch, window: int | None,
    scale: float | None = None, expand: Expand | None = None, sinks: Tensor | None = None,
) -> Tensor:
    """q [T, H, hd], k [T, K, hd], v [T, K, hd_v] of this step (already written to the cache)
    -> [T, H, hd_v]. `expand` turns gathered cache contents into K/V (identity when None);
    `sinks` [H] are gpt-oss's per-head sink logits."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    kp, vp = cache.pools(layer)
    in_place = bool(batch.decodes) and expand is None and sinks is None and cpu_attention.applies(q, kp, vp)
    for g in batch.decodes:
        n = g.tables.shape[0]
        if in_place:  # CPU: the C kernel reads the blocks where they are (engines/runtime/cpu_attention.py)
            qg = q[g.row : g.row + n].view(n, kp.shape[0], -1, q.shape[-1])
            o = cpu_attention.paged_decode_attention(qg, kp, vp, g.tables, g.first_key(window), g.ctx,
                                                     q.shape[-1] ** -0.5 if scale is None else scale)
            out[g.row : g.row + n] = o.view(n, q.shape[1], v.shape[-1])
            continue
        # GQA without repeating K/V: the G query heads sharing a KV head are that head's
        # "query rows". q [n, H, hd] -> [K, n, G, hd] against K/V [K, n, L, hd].
        kc, vc = cache.gather(layer, g.tables)
        if expand is not None:
            kc, vc = expand(kc, vc)
        qg = q[g.row : g.row + n].view(n, kc.shape[0], -1, q.shape[-1]).transpose(0, 1)
        group_sinks = None if sinks is None else sinks.view(kc.shape[0], 1, -1, 1)  # [K, 1, G, 1]
        o = _attend(qg, kc, vc, g.mask(window), False, scale, group_sinks)
        out[g.row : g.row + n] = o.transpose(0, 1).reshape(n, q.shape[1], v.shape[-1])
    head_sinks = None if sinks is None else sinks.view(1, -1, 1, 1)
    for seg in batch.prefills:
        rows = slice(seg.row, seg.row + seg.length)
        qs = q[rows].transpose(0, 1)[None]  # [1, H, n, hd]
        if seg.start_pos == 0 and window is None:
            ks, vs = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            o = _attend(qs, ks, vs, None, True, scale, head_sinks)
        else:
            ctx = seg.start_pos + seg.length
            kc, vc = cache.gather(layer, seg.table[None])  # [K, 1, nb*B, hd]
            if expand is not None:
                kc, vc = expand(kc, vc)
            ks, vs = kc[:, 0, :ctx][None], vc[:, 0, :ctx][None]
            o = _attend(qs, ks, vs, context_mask(seg.start_pos, ctx, window, q.device), False, scale, head_sinks)
        out[rows] = o[0].transpose(0, 1)
    return out

"""DeepSeek's multi-head latent attention (MLA) over the paged KV cache (torch reference path).

Per token and layer the cache holds what MLA compresses K/V into: the normalised latent
[r = kv_lora_rank] in the K pool and the rotated shared rope key [rope] in the V pool, one
"head" each, so KV bytes per token are (r + rope) x layers x dtype size instead of
2 x heads x head dim. Attention runs in the absorbed form: kv_b_proj's key half is folded
into the queries and its value half applied after the weighted sum, so no per-head K/V is
ever materialised (transformers expands them; the results differ only in float rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.runtime.attention import AttentionBatch, apply_rope, paged_attention, rms_norm
from engines.runtime.config import ModelConfig
from engines.runtime.kv_cache import KVCache
from engines.runtime.weights import MLAWeights


def mla_attention(cfg: ModelConfig, w: MLAWeights, h: Tensor, cos: Tensor, sin: Tensor, kv: KVCache,
                  layer: int, attn: AttentionBatch) -> Tensor:
    """h [T, D] -> attention output [T, D]; writes this step's latent and rope key to the cache."""
    m, T, H, eps = cfg.mla, h.shape[0], cfg.num_heads, cfg.rms_norm_eps
    assert m is not None
    nope, rope, r, vd = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
    if w.q is not None:
        q = F.linear(h, w.q)
    else:
        q = F.linear(rms_norm(F.linear(h, w.q_a, w.q_a_bias), w.q_a_norm, eps), w.q_b)
    q_nope, q_rot = q.view(T, H, nope + rope).split([nope, rope], dim=-1)
    latent, k_rot = F.linear(h, w.kv_a, w.kv_a_bias).split([r, rope], dim=-1)
    latent = rms_norm(latent, w.kv_a_norm, eps).view(T, 1, r)
    interleave = cfg.rope_spec.interleave
    q_rot = apply_rope(q_rot, cos, sin, interleave)
    k_rot = apply_rope(k_rot.reshape(T, 1, rope), cos, sin, interleave)
    kv.write(layer, attn.slots, latent, k_rot)
    # Absorbed form: q_nope . (W_uk latent) = (q_nope W_uk) . latent, and the values' W_uv
    # applies after the weighted sum, so attention runs as one shared (MQA) head of keys
    # [latent, rope key] and values [latent] straight from the cache, never per-head K/V.
    w_kv = w.kv_b.view(H, nope + vd, r)
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w_kv[:, :nope])
    q = torch.cat((q_lat, q_rot), dim=-1)  # [T, H, r + rope]

    def keys_values(lat: Tensor, kr: Tensor) -> tuple[Tensor, Tensor]:
        return torch.cat((lat, kr), dim=-1), lat

    k, v = keys_values(latent, k_rot)  # this step's [T, 1, r + rope] and [T, 1, r]
    o_lat = paged_attention(q, k, v, kv, layer, attn, None, scale=cfg.attn_scale, expand=keys_values)
    o = torch.einsum("thr,hvr->thv", o_lat, w_kv[:, nope:])  # [T, H, vd]
    return F.linear(o.reshape(T, H * vd), w.o, w.o_bias)

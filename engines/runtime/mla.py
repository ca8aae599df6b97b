"""DeepSeek's multi-head latent attention (MLA) over the paged KV cache (torch reference path).

Per token and layer the cache holds what MLA compresses K/V into: the normalised latent
[r = kv_lora_rank] in the K pool and the rotated shared rope key [rope] in the V pool, one
"head" each, so KV bytes per token are (r + rope) x layers x dtype size instead of
2 x heads x head dim. Attention expands the gathered latents through kv_b_proj into per-head
keys (nope part, with the rope key appended) and values, as transformers does; the absorbed
form (folding kv_b into q and o) is a later kernel's job.
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

    def expand(lat: Tensor, kr: Tensor) -> tuple[Tensor, Tensor]:
        # [1, N, L, r] latents and [1, N, L, rope] keys -> K [H, N, L, nope+rope], V [H, N, L, vd]
        N, L = lat.shape[1], lat.shape[2]
        kvb = F.linear(lat[0], w.kv_b).view(N, L, H, nope + vd).permute(2, 0, 1, 3)
        k_nope, v = kvb.split([nope, vd], dim=-1)
        return torch.cat((k_nope, kr.expand(H, N, L, rope)), dim=-1), v

    k, v = expand(latent.view(1, 1, T, r), k_rot.view(1, 1, T, rope))  # this step's, for fresh prefills
    k, v = k[:, 0].transpose(0, 1), v[:, 0].transpose(0, 1)  # [T, H, ...]
    q = torch.cat((q_nope, q_rot), dim=-1)
    o = paged_attention(q, k, v, kv, layer, attn, None, scale=cfg.attn_scale, expand=expand)
    return F.linear(o.reshape(T, H * vd), w.o, w.o_bias)

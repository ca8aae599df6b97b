"""DeepSeek's multi-head latent attention (MLA) in three parts, so it runs over any KV (torch
reference path).

Per token and layer the cache holds what MLA compresses K/V into: the normalised latent
[r = kv_lora_rank] in the K pool and the rotated shared rope key [rope] in the V pool, one
"head" each, so KV bytes per token are (r + rope) x layers x dtype size instead of
2 x heads x head dim. Attention runs in the absorbed form: kv_b_proj's key half is folded
into the queries and its value half applied after the weighted sum, so no per-head K/V is
ever materialised (transformers expands them; the results differ only in float rounding).

`mla_project` gives the absorbed queries and this step's latent and rope key (what the cache
stores); `mla_keys_values` turns cache contents into one shared (MQA) head of keys
[latent, rope key] and values [latent] (paged_attention's `expand`); `mla_output` expands
the attended latent by kv_b's value half and applies o_proj. Where the attention between
them runs (the model's cache, a host pool, a staging buffer) is the caller's choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.runtime.attention import apply_rope, rms_norm
from engines.runtime.config import ModelConfig
from engines.runtime.weights import MLAWeights


def mla_project(cfg: ModelConfig, w: MLAWeights, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """h [T, D] -> absorbed queries [T, H, r + rope], latent [T, 1, r] and rope key [T, 1, rope]
    (the latter two are what the cache stores for this step)."""
    m, T, H, eps = cfg.mla, h.shape[0], cfg.num_heads, cfg.rms_norm_eps
    assert m is not None
    nope, rope, r = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
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
    # Absorbed form: q_nope . (W_uk latent) = (q_nope W_uk) . latent, and the values' W_uv
    # applies after the weighted sum (mla_output), so attention runs as one shared (MQA) head
    # of keys [latent, rope key] and values [latent] straight from the cache.
    q_lat = torch.einsum("thn,hnr->thr", q_nope, _kv_b(cfg, w)[:, :nope])
    return torch.cat((q_lat, q_rot), dim=-1), latent, k_rot


def mla_keys_values(latent: Tensor, k_rot: Tensor) -> tuple[Tensor, Tensor]:
    """Cache contents [..., r] and [..., rope] -> keys [..., r + rope] and values [..., r]."""
    return torch.cat((latent, k_rot), dim=-1), latent


def mla_output(cfg: ModelConfig, w: MLAWeights, o_lat: Tensor) -> Tensor:
    """Attended latents [T, H, r] -> per-head values by kv_b's value half, then o_proj: [T, D]."""
    m, (T, H) = cfg.mla, o_lat.shape[:2]
    assert m is not None
    o = torch.einsum("thr,hvr->thv", o_lat, _kv_b(cfg, w)[:, m.qk_nope_head_dim :])  # [T, H, vd]
    return F.linear(o.reshape(T, H * m.v_head_dim), w.o, w.o_bias)


def _kv_b(cfg: ModelConfig, w: MLAWeights) -> Tensor:
    """kv_b_proj as [H, nope + vd, r]: per head, the key (nope) rows then the value rows."""
    m = cfg.mla
    assert m is not None
    return w.kv_b.view(cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)

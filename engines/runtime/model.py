"""The MoE decoder forward pass over one step's flat token batch.

Reads like the architecture: embed -> L x (RMSNorm, attention over the paged cache,
residual, RMSNorm, routed experts [+ shared expert] or a dense MLP, residual) -> norm ->
LM head on the rows that need a next token. Everything architecture-specific comes from
ModelConfig; where expert weights live (ExpertStore) and how experts are computed
(`expert_fn`) are passed in, so quantized or offloaded experts reuse this file unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.runtime.attention import AttentionBatch, apply_rope, paged_attention, rope_cos_sin, rope_inv_freq
from engines.runtime.config import ModelConfig
from engines.runtime.experts import Dispatch, dense_mlp, dispatch, grouped_swiglu, route
from engines.runtime.kv_cache import PagedKVCache
from engines.runtime.transfer import TransferLedger
from engines.runtime.weights import AttentionWeights, ExpertStore, MoEWeights, ModelWeights

ExpertFn = Callable[[Tensor, Dispatch, object], Tensor]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """In float32, then back to x's dtype before the weight (transformers' order of operations)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass
class ForwardResult:
    logits: Tensor  # [S, V] float32, one row per requested logit row
    expert_counts: dict[int, list[int]]  # MoE layer -> tokens routed to each expert this step


class MoEModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        experts: ExpertStore,
        kv: PagedKVCache,
        ledger: TransferLedger,
        expert_fn: ExpertFn = grouped_swiglu,
    ) -> None:
        self.config, self.weights, self.experts, self.kv, self.ledger = config, weights, experts, kv, ledger
        self.expert_fn = expert_fn
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, weights.embed.device)

    @torch.inference_mode()
    def forward(self, token_ids: Tensor, positions: Tensor, attn: AttentionBatch, logit_rows: Tensor) -> ForwardResult:
        cfg, w = self.config, self.weights
        x = F.embedding(token_ids, w.embed)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        counts: dict[int, list[int]] = {}
        for i, layer in enumerate(w.layers):
            h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
            x = x + self._attention(i, layer.attn, h, cos, sin, attn)
            h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
            if isinstance(layer.mlp, MoEWeights):
                y, counts[i] = self._moe(i, layer.mlp, h)
            else:
                y = dense_mlp(h, layer.mlp)
            x = x + y
        x = rms_norm(x[logit_rows], w.norm, cfg.rms_norm_eps)
        return ForwardResult(F.linear(x, w.lm_head).float(), counts)

    def _attention(
        self, i: int, w: AttentionWeights, h: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBatch
    ) -> Tensor:
        cfg, T = self.config, h.shape[0]
        q = F.linear(h, w.q, w.q_bias)
        k = F.linear(h, w.k, w.k_bias)
        v = F.linear(h, w.v, w.v_bias)
        if cfg.qk_norm == "full":
            q, k = rms_norm(q, w.q_norm, cfg.rms_norm_eps), rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.view(T, cfg.num_heads, cfg.head_dim)
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm == "head":
            q, k = rms_norm(q, w.q_norm, cfg.rms_norm_eps), rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.kv.write(i, attn.slots, k, v)
        o = paged_attention(q, k, v, self.kv, i, attn, cfg.sliding_windows[i])
        return F.linear(o.reshape(T, cfg.q_size), w.o, w.o_bias)

    def _moe(self, i: int, w: MoEWeights, h: Tensor) -> tuple[Tensor, list[int]]:
        cfg = self.config
        ids, weights = route(h, w.router, cfg.top_k, cfg.norm_topk_prob)
        counts = self.ledger.to_host(torch.bincount(ids.flatten(), minlength=cfg.num_experts), "routing").tolist()
        y = self.expert_fn(h, dispatch(ids, weights, counts), self.experts.layer(i))
        if w.shared is not None:
            y = y + torch.sigmoid(F.linear(h, w.shared_gate)) * dense_mlp(h, w.shared)
        return y, counts

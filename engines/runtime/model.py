"""The MoE decoder as public per-layer blocks over one step's flat token batch.

Reads like the architecture: `embed` -> L x (`attention_block`: RMSNorm, attention over the
KV cache, residual; `mlp_block`: RMSNorm, routed experts [+ shared expert] or a dense MLP,
residual) -> `head`: norm and LM head on the rows that need a next token. `forward` is that
composition; a layer-major executor calls the blocks itself over many micro-batches.
Everything architecture-specific comes from ModelConfig; where expert weights live and how
they run is the ExpertBackend passed in, so quantized or offloaded experts reuse this file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.runtime.attention import (
    AttentionBatch,
    LayerAttention,
    apply_rope,
    attend_cached,
    rms_norm,
    rope_cos_sin,
    rope_frequencies,
)
from engines.runtime.config import ModelConfig
from engines.runtime.experts import ExpertBackend, dense_mlp, dispatch, route, route_groups
from engines.runtime.gemm import PackedWeight, linear, pack, packed_bytes
from engines.runtime.kv_cache import KVCache
from engines.runtime.mla import mla_keys_values, mla_output, mla_project
from engines.runtime.transfer import TransferLedger
from engines.runtime.weights import MLAWeights, ModelWeights, MoEWeights

# (layer, q [T, H, hd], this step's cache contents k and v [T, K, hd_k / hd_v], the batch's
# attention layout, the layer's LayerAttention) -> [T, H, value dim]: writes k/v to its KV, attends.
Attend = Callable[[int, Tensor, Tensor, Tensor, AttentionBatch, LayerAttention], Tensor]


@dataclass
class ForwardResult:
    logits: Tensor  # [S, V] float32, one row per requested logit row
    expert_counts: dict[int, list[int]]  # MoE layer -> tokens routed to each expert this step


class MoEModel:
    def __init__(
        self, config: ModelConfig, weights: ModelWeights, experts: ExpertBackend, kv: KVCache, ledger: TransferLedger
    ) -> None:
        self.config, self.weights, self.experts, self.kv, self.ledger = config, weights, experts, kv, ledger
        self.inv_freq, self.rope_scale = rope_frequencies(config.rope_spec, weights.embed.device)
        self._lm_head: PackedWeight | None = None  # prepack
        # Sees each MoE layer's expert choices (layer, ids [T, top_k]) as they are made: the
        # routing recorder of a measured run (RuntimeConfig.record_routing); None: off.
        self.on_route: Callable[[int, Tensor], None] | None = None

    @torch.inference_mode()
    def forward(self, token_ids: Tensor, positions: Tensor, attn: AttentionBatch, logit_rows: Tensor) -> ForwardResult:
        x, rope = self.embed(token_ids, positions)
        counts: dict[int, list[int]] = {}
        for i in range(self.config.num_layers):
            x = self.attention_block(i, x, rope, attn)
            x, layer_counts = self.mlp_block(i, x)
            if layer_counts is not None:
                counts[i] = layer_counts
        return ForwardResult(self.head(x, logit_rows), counts)

    # -- the blocks ------------------------------------------------------------------------------
    def embed(self, token_ids: Tensor, positions: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """token ids [T] -> hidden states [T, D] and the rotary (cos, sin) of their positions."""
        x = F.embedding(token_ids, self.weights.embed)
        return x, rope_cos_sin(positions, self.inv_freq, x.dtype, self.rope_scale)

    def attention_block(self, i: int, x: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionBatch,
                        attend: Attend | None = None) -> Tensor:
        """Layer i's RMSNorm, attention over the KV cache (writing this batch's K/V), residual.
        `attend` replaces where the attention itself runs (default `self.attend`: this
        model's KV cache, on the device), given the layer's LayerAttention (window, scale,
        sinks, MLA's expansion); projections, the output projection and the residual stay here."""
        h = rms_norm(x, self.weights.layers[i].attn_norm, self.config.rms_norm_eps)
        q, k, v = self.project_qkv(i, h, *rope)
        o = (attend or self.attend)(i, q, k, v, attn, self.layer_attention(i))
        return x + self.attention_output(i, o)

    def mlp_block(self, i: int, x: Tensor) -> tuple[Tensor, list[int] | None]:
        """Layer i's RMSNorm, routed experts (+ shared expert) or dense MLP, residual; also the
        tokens routed to each expert (None for a dense layer)."""
        layer = self.weights.layers[i]
        h = rms_norm(x, layer.mlp_norm, self.config.rms_norm_eps)
        if isinstance(layer.mlp, MoEWeights):
            y, counts = self._moe(i, layer.mlp, h)
            return x + y, counts
        return x + dense_mlp(h, layer.mlp), None

    def head(self, x: Tensor, logit_rows: Tensor) -> Tensor:
        """Final norm and LM head on rows `logit_rows` of x -> logits [S, V] float32."""
        w = self.weights
        packed = self._lm_head if self._lm_head is not None and self._lm_head.weight is w.lm_head else None
        return linear(rms_norm(x[logit_rows], w.norm, self.config.rms_norm_eps), packed or w.lm_head).float()

    def prepack(self) -> int:
        """Pack the LM head and the resident experts for MKL's GEMM where that applies
        (engines/runtime/gemm.py); the packed bytes, held beside the weights."""
        head = pack(self.weights.lm_head)
        self._lm_head = head if isinstance(head, PackedWeight) else None
        return packed_bytes([head]) + self.experts.prepack()

    def project_qkv(self, i: int, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Layer i's normalised input h [T, D] -> q [T, H, hd], k and v [T, K, hd], with the
        architecture's q/k norms, clipping and RoPE applied: what the cache stores as k and v.
        MLA: absorbed queries [T, H, r + rope], latent [T, 1, r] and rope key [T, 1, rope]."""
        cfg, w, T = self.config, self.weights.layers[i].attn, h.shape[0]
        if isinstance(w, MLAWeights):
            return mla_project(cfg, w, h, cos, sin)
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
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def layer_attention(self, i: int) -> LayerAttention:
        """What layer i's attention needs wherever it runs: window, scale, sinks, MLA's expansion."""
        cfg, w = self.config, self.weights.layers[i].attn
        if isinstance(w, MLAWeights):
            return LayerAttention(cfg.sliding_windows[i], cfg.attn_scale, None, mla_keys_values)
        return LayerAttention(cfg.sliding_windows[i], cfg.attn_scale, w.sinks)

    def attention_output(self, i: int, o: Tensor) -> Tensor:
        """Attention's output [T, H, value dim] -> o_proj's [T, D] (MLA: expanded by kv_b first)."""
        w = self.weights.layers[i].attn
        if isinstance(w, MLAWeights):
            return mla_output(self.config, w, o)
        return F.linear(o.reshape(o.shape[0], self.config.q_size), w.o, w.o_bias)

    def attend(self, i: int, q: Tensor, k: Tensor, v: Tensor, attn: AttentionBatch, spec: LayerAttention) -> Tensor:
        """Write this batch's K/V into the model's cache and attend: -> [T, H, value dim]."""
        self.kv.write(i, attn.slots, k, v)
        return attend_cached(q, k, v, self.kv, i, attn, spec)

    def _moe(self, i: int, w: MoEWeights, h: Tensor) -> tuple[Tensor, list[int]]:
        cfg = self.config
        if w.correction_bias is not None:
            ids, weights = route_groups(h, w.router, w.correction_bias, cfg.top_k, cfg.n_group, cfg.topk_group,
                                        cfg.norm_topk_prob, cfg.routed_scaling_factor)
        else:
            ids, weights = route(h, w.router, cfg.top_k, cfg.norm_topk_prob, w.router_bias)
        if self.on_route is not None:
            self.on_route(i, ids)
        counts = self.ledger.to_host(torch.bincount(ids.flatten(), minlength=cfg.num_experts), "routing").tolist()
        y = self.experts.forward(i, h, dispatch(ids, weights, counts))
        if w.shared is not None:
            shared = dense_mlp(h, w.shared)
            y = y + (shared if w.shared_gate is None else torch.sigmoid(F.linear(h, w.shared_gate)) * shared)
        return y, counts

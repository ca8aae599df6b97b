"""A model's sizes from its config alone (no weights, no torch): `ModelShape` and `model_shape`.

What the cost models price (moegen's plan, the simulator's steps) and what `pwbench plan`
sizes a large model with on a small machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    layers: int
    moe_layers: int
    experts: int  # per MoE layer
    top_k: int
    hidden: int
    q_size: int  # heads x head_dim
    kv_size: int  # KV heads x head_dim
    heads: int
    head_dim: int
    intermediate: int  # routed expert
    vocab: int
    dense_bytes: int  # every dense tensor on the device (embedding once)
    layer_dense_bytes: int  # dense bytes one layer reads (attention, norms, router, shared/dense MLP)
    head_bytes: int  # LM head (+ final norm)
    expert_bytes: int  # one routed expert
    kv_bytes_per_token: int  # all layers, K and V
    dtype_bytes: int
    # "gqa" (multi-head and grouped-query attention) or "mla" (DeepSeek's multi-head latent
    # attention): cost models count the runtime's torch calls per layer by it.
    attention: str = "gqa"

    @property
    def expert_flops_per_token(self) -> int:
        return 2 * 3 * self.hidden * self.intermediate

    @property
    def total_experts(self) -> int:
        return self.moe_layers * self.experts



def attention_params(mc: Any) -> int:
    """Parameters of one layer's attention (projections, their biases, q/k norms, sinks)."""
    D, H = mc.hidden_size, mc.num_heads
    sinks = H if mc.attention_sinks else 0
    m = mc.mla
    if m is not None:  # DeepSeek's MLA: low-rank (or plain) query, latent + rope key, kv_b, o
        qk, r, rope = m.qk_nope_head_dim + m.qk_rope_head_dim, m.kv_lora_rank, m.qk_rope_head_dim
        ql = m.q_lora_rank
        q = (D * ql + ql + ql * H * qk) if ql else D * H * qk  # q_a, q_a_norm, q_b; or q_proj
        kv = D * (r + rope) + r + H * (m.qk_nope_head_dim + m.v_head_dim) * r  # kv_a, kv_a_norm, kv_b
        bias = (ql + (r + rope) + D) if m.bias else 0  # q_a, kv_a and o carry biases
        return q + kv + H * m.v_head_dim * D + bias + sinks
    q, kv = mc.q_size, mc.kv_size
    norms = {"none": 0, "head": 2 * mc.head_dim, "full": q + kv}[mc.qk_norm]
    return 2 * D * q + 2 * D * kv + (q + 2 * kv if mc.qkv_bias else 0) + (D if mc.o_bias else 0) + norms + sinks


def model_shape(mc: Any, dtype_bytes: int) -> ModelShape:
    """ModelShape of a runtime ModelConfig `mc` at `dtype_bytes` per weight, from the config
    alone (no weights read, so `pwbench plan` sizes a large model on a small machine);
    tests/integration/test_moegen.py checks these bytes against the loaded weights for every
    architecture. Weights and KV bytes are exact; for MLA the attention terms the cost model
    prices from q_size, kv_size, heads and head_dim are approximate: the absorbed queries
    (heads x (kv_lora_rank + rope)) stand for q, half the cached latent + rope key for each of
    K and V, so attention FLOPs per key and the activations crossing to host attention are
    within a rope key's share of the absorbed form's, and the projections' FLOPs are counted
    as D x (2 q + 2 kv), not MLA's low-rank chain."""
    D, V, L, I = mc.hidden_size, mc.vocab_size, mc.num_layers, mc.moe_intermediate_size
    q, kv, heads, head_dim = mc.q_size, mc.kv_size, mc.num_heads, mc.head_dim
    if mc.mla is not None:
        cached = mc.mla.kv_lora_rank + mc.mla.qk_rope_head_dim  # latent + rope key per token and layer
        q, kv, head_dim = heads * cached, (cached + 1) // 2, cached
    gate = D if mc.shared_expert_gated else 0
    shared = (3 * D * mc.shared_expert_intermediate_size + gate) if mc.shared_expert_intermediate_size else 0
    # The routing correction bias (sigmoid groups) or the router's logit bias (gpt-oss).
    bias = mc.num_experts if mc.router == "sigmoid_groups" or mc.router_logit_bias else 0
    attn = attention_params(mc)
    layers = sum(attn + 2 * D + (mc.num_experts * D + bias + shared if moe else 3 * D * mc.dense_intermediate_size)
                 for moe in mc.moe_layers)
    head = V * D + D  # LM head and the final norm
    dense = (V * D + layers + D + (0 if mc.tie_word_embeddings else V * D)) * dtype_bytes
    expert = 3 * D * I + (2 * I + D if mc.expert_bias else 0)  # gate, up, down (+ their biases: gpt-oss)
    cache_heads, key_dim, value_dim = mc.kv_cache_dims
    return ModelShape(
        layers=L, moe_layers=sum(mc.moe_layers), experts=mc.num_experts, top_k=mc.top_k,
        hidden=D, q_size=q, kv_size=kv, heads=heads, head_dim=head_dim,
        intermediate=I, vocab=V, dense_bytes=dense, layer_dense_bytes=layers * dtype_bytes // L,
        head_bytes=head * dtype_bytes, expert_bytes=expert * dtype_bytes,
        kv_bytes_per_token=L * cache_heads * (key_dim + value_dim) * dtype_bytes, dtype_bytes=dtype_bytes,
        attention="mla" if mc.mla is not None else "gqa",
    )

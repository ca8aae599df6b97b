"""Weight records of the runtime: plain tensors in dataclasses.

Dense weights (embeddings, attention, norms, routers, shared experts) live here. Routed
experts of a layer load as one `DenseExperts` record and are then owned by an
`ExpertBackend` (engines/runtime/experts.py), so later engines can keep them quantized,
paged, or on the host without touching the model code.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import Tensor


@dataclass
class AttentionWeights:
    q: Tensor  # [H*hd, D]
    k: Tensor  # [K*hd, D]
    v: Tensor  # [K*hd, D]
    o: Tensor  # [D, H*hd]
    q_bias: Tensor | None = None
    k_bias: Tensor | None = None
    v_bias: Tensor | None = None
    o_bias: Tensor | None = None
    q_norm: Tensor | None = None  # [hd] per head, or [H*hd] over the projection
    k_norm: Tensor | None = None
    sinks: Tensor | None = None  # [H] gpt-oss: a learned logit per head in each softmax


@dataclass
class MLAWeights:
    """DeepSeek's latent attention (r kv_lora_rank, qk = nope + rope dims, vd v_head_dim)."""

    kv_a: Tensor  # [r + rope, D]: the latent and the shared rope key
    kv_a_norm: Tensor  # [r]
    kv_b: Tensor  # [H*(nope + vd), r]: latent -> per-head key (nope part) and value
    o: Tensor  # [D, H*vd]
    q: Tensor | None = None  # [H*qk, D] when q_lora_rank is 0, else the low-rank pair below
    q_a: Tensor | None = None  # [q_lora_rank, D]
    q_a_norm: Tensor | None = None  # [q_lora_rank]
    q_b: Tensor | None = None  # [H*qk, q_lora_rank]
    q_a_bias: Tensor | None = None
    kv_a_bias: Tensor | None = None
    o_bias: Tensor | None = None


@dataclass
class MLPWeights:
    """A SwiGLU MLP: gate rows first in gate_up, like transformers' fused experts."""

    gate_up: Tensor  # [2I, D]
    down: Tensor  # [D, I]


@dataclass
class MoEWeights:
    router: Tensor  # [E, D]
    shared: MLPWeights | None = None
    shared_gate: Tensor | None = None  # [1, D]; None: the shared expert's output is added as is
    correction_bias: Tensor | None = None  # [E] of sigmoid-group routing (steers the choice only)
    router_bias: Tensor | None = None  # [E] added to the router logits (gpt-oss)


@dataclass
class LayerWeights:
    attn_norm: Tensor
    attn: AttentionWeights | MLAWeights
    mlp_norm: Tensor
    mlp: MLPWeights | MoEWeights


@dataclass
class ModelWeights:
    embed: Tensor  # [V, D]
    norm: Tensor  # [D]
    lm_head: Tensor  # [V, D]; the same tensor as embed when tied
    layers: list[LayerWeights]

    def nbytes(self) -> int:
        """Bytes of every dense tensor, counting a tied embedding once."""
        seen: set[int] = set()
        total = 0
        for t in _tensors(self):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total


def _tensors(obj: object):
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, list):
        for item in obj:
            yield from _tensors(item)
    elif hasattr(obj, "__dataclass_fields__"):
        for f in fields(obj):
            yield from _tensors(getattr(obj, f.name))


@dataclass
class DenseExperts:
    """All routed experts of one layer, full precision: the compute's input."""

    gate_up: Tensor  # [E, 2I, D]
    down: Tensor  # [E, D, I]
    gate_up_bias: Tensor | None = None  # [E, 2I] (gpt-oss)
    down_bias: Tensor | None = None  # [E, D]
    clamp: tuple[float, float] | None = None  # clamped SwiGLU (limit, alpha); None: plain SwiGLU

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    def nbytes(self) -> int:
        tensors = (self.gate_up, self.down, self.gate_up_bias, self.down_bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def expert_nbytes(self, expert: int) -> int:
        return self.nbytes() // self.num_experts

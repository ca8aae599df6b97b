"""ModelConfig: one normalised description of a supported MoE architecture, read from config.json.

Each architecture's quirks (router normalisation or grouped sigmoid routing, shared experts,
q/k norms, biases, sliding windows, dense layers, partial/interleaved/YaRN rope, MLA,
attention sinks, clamped SwiGLU experts) become plain fields here, so the model code has no
per-architecture branches. Rules follow transformers 5.x's modeling files for each model type.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engines.base import ModelLoadError

SUPPORTED_ARCHITECTURES = ("deepseek_v3", "glm4_moe", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: `dim` rotated dims of each head (partial rotary when < head dim),
    pairs (x_i, x_{i+dim/2}) (rotate-half) or interleaved (x_2i, x_2i+1) (DeepSeek), and
    YaRN's scaled frequencies when `yarn` holds its parameters (factor, beta_fast, ...)."""

    theta: float
    dim: int
    interleave: bool = False
    yarn: Mapping[str, Any] | None = None
    max_position_embeddings: int = 0  # YaRN's default factor is max / original max


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention. Per token and layer the KV cache holds the
    normalised latent [kv_lora_rank] and the rotated shared key [qk_rope_head_dim] only;
    kv_b_proj expands them into per-head keys (nope part) and values at attention time."""

    q_lora_rank: int  # 0: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    bias: bool  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj carry biases


@dataclass(frozen=True)
class ModelConfig:
    """Shape legend used across the runtime: D hidden, H heads, K kv heads, hd head dim,
    E experts, A experts per token (top-k), I expert intermediate, V vocab, L layers."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    # Per layer: True = routed-expert block, False = dense SwiGLU MLP (Qwen mlp_only_layers).
    moe_layers: tuple[bool, ...]
    dense_intermediate_size: int
    # Router: softmax over all experts, take top-k, then optionally renormalise the k weights.
    # (Taking top-k of the logits and then a softmax over the k equals softmax+topk+renormalise.)
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0 = no shared expert
    qkv_bias: bool
    o_bias: bool
    qk_norm: str  # "none" | "head" (per head, Qwen3) | "full" (over the projection, OLMoE)
    clip_qkv: float | None
    sliding_windows: tuple[int | None, ...]  # per layer; None = full causal attention
    hidden_act: str
    eos_token_ids: tuple[int, ...]
    quantization: Mapping[str, Any] | None = None
    rope: RopeConfig | None = None  # None: full rotate-half rotary of head_dim at rope_theta
    # Router "softmax" (above) or "sigmoid_groups" (DeepSeek-V3, GLM-4.5): sigmoid scores, a
    # per-expert correction bias added for the choice only, the best `topk_group` of `n_group`
    # groups (by the sum of each group's two best), top-k within them, weights from the
    # uncorrected scores, renormalised if norm_topk_prob, times routed_scaling_factor.
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Qwen2-MoE's `shared_expert` is scaled by a sigmoid gate; DeepSeek's `shared_experts` is not.
    shared_expert_name: str = "shared_expert"
    shared_expert_gated: bool = True
    mla: MLAConfig | None = None
    attn_scale: float | None = None  # softmax scale; None: 1/sqrt(query head dim)
    # Decoder layers past num_layers in the files (DeepSeek's multi-token-prediction layers):
    # not used for generation, skipped at load and named in the log.
    skipped_layers: int = 0
    # gpt-oss: the router is `mlp.router` with a logit bias; a learned per-head sink logit joins
    # each softmax; experts carry biases and run the clamped SwiGLU (limit, alpha):
    # gate.clamp(max=limit) * sigmoid(alpha * gate) * (up.clamp(-limit, limit) + 1).
    router_name: str = "gate"
    router_logit_bias: bool = False
    attention_sinks: bool = False
    expert_bias: bool = False
    swiglu_clamp: tuple[float, float] | None = None

    @property
    def plain_experts(self) -> bool:
        """Routed experts are bias-free SwiGLU (what every expert backend and kernel runs)."""
        return not self.expert_bias and self.swiglu_clamp is None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(heads, key dim, value dim) the KV cache stores per token per layer. MLA stores one
        "head" of the latent (as key) and the rope key (as value), not per-head K/V."""
        if self.mla is not None:
            return 1, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def rope_spec(self) -> RopeConfig:
        return self.rope or RopeConfig(self.rope_theta, self.head_dim)


def parse_config(raw: Mapping[str, Any], source: str, generation: Mapping[str, Any] | None = None) -> ModelConfig:
    """Normalise a Hugging Face config dict; `source` names the file in error messages."""
    model_type = raw.get("model_type")
    if model_type not in _PARSERS:
        raise ModelLoadError(
            f"{source}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    get = _Getter(raw, source)
    act = get.opt("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported; supported: silu")
    num_layers = get.int("num_hidden_layers")
    hidden = get.int("hidden_size")
    heads = get.int("num_attention_heads")
    common = dict(
        architecture=model_type,
        vocab_size=get.int("vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(get.opt("num_key_value_heads", heads)),
        head_dim=int(get.opt("head_dim", None) or hidden // heads),
        rope_theta=_rope_theta(get, ROPE_TYPES if model_type in _YARN_ARCHS else ("default",)),
        max_position_embeddings=get.int("max_position_embeddings"),
        rms_norm_eps=float(get.opt("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(get.opt("tie_word_embeddings", False)),
        top_k=get.int("num_experts_per_tok"),
        hidden_act=act,
        eos_token_ids=_eos_ids(generation or {}, raw),
        quantization=raw.get("quantization_config"),
    )
    specific = _PARSERS[model_type](get, num_layers)
    cfg = ModelConfig(**{**common, **specific})
    if cfg.top_k > cfg.num_experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok={cfg.top_k} > number of experts {cfg.num_experts}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelLoadError(f"{source}: num_attention_heads must be a multiple of num_key_value_heads")
    return cfg


class _Getter:
    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def int(self, key: str) -> int:
        value = self.raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ModelLoadError(f"{self.source}: field {key!r} must be a non-negative integer, got {value!r}")
        return value

    def opt(self, key: str, default: Any) -> Any:
        value = self.raw.get(key, default)
        return default if value is None and default is not None else value


def _rope_params(get: _Getter) -> dict[str, Any]:
    # transformers 5 writes rope_parameters; older checkpoints have rope_theta + rope_scaling.
    return {**(get.raw.get("rope_scaling") or {}), **(get.raw.get("rope_parameters") or {})}


def _rope_theta(get: _Getter, allowed: tuple[str, ...] = ("default",)) -> float:
    params = _rope_params(get)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in allowed:
        raise ModelLoadError(
            f"{get.source}: rope_type {rope_type!r} is not supported for model_type {get.raw.get('model_type')!r}; "
            f"supported: {', '.join(allowed)}"
        )
    return float(params.get("rope_theta") or get.raw.get("rope_theta") or 10000.0)


def _rope(get: _Getter, dim: int, interleave: bool) -> RopeConfig:
    """RoPE of `dim` dims (partial_rotary_factor applied by the caller), default or YaRN."""
    theta = _rope_theta(get, ROPE_TYPES)
    params = _rope_params(get)
    yarn = None
    if (params.get("rope_type") or params.get("type")) == "yarn":
        if params.get("original_max_position_embeddings") is None:
            raise ModelLoadError(f"{get.source}: YaRN rope needs 'original_max_position_embeddings' in rope_parameters")
        yarn = dict(params)
    return RopeConfig(theta, dim, interleave, yarn, get.int("max_position_embeddings"))


def _eos_ids(generation: Mapping[str, Any], raw: Mapping[str, Any]) -> tuple[int, ...]:
    # generate() takes EOS from generation_config.json first, like we do.
    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _num_experts(get: _Getter) -> int:
    # The key differs by architecture and by transformers version (attribute_map aliases).
    key = "num_local_experts" if get.raw.get("num_local_experts") is not None else "num_experts"
    return get.int(key)


def _qwen_moe_layers(get: _Getter, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    step = int(get.opt("decoder_sparse_step", 1))
    dense = set(get.opt("mlp_only_layers", []) or [])
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def _mixtral(get: _Getter, num_layers: int) -> dict[str, Any]:
    window = get.raw.get("sliding_window")
    return dict(
        num_experts=_num_experts(get),
        moe_intermediate_size=get.int("intermediate_size"),
        moe_layers=(True,) * num_layers,
        dense_intermediate_size=0,
        norm_topk_prob=True,
        shared_expert_intermediate_size=0,
        qkv_bias=False,
        o_bias=False,
        qk_norm="none",
        clip_qkv=None,
        sliding_windows=(window,) * num_layers,
    )


def _qwen2_moe(get: _Getter, num_layers: int) -> dict[str, Any]:
    num_experts = _num_experts(get)
    windows: list[int | None] = [None] * num_layers
    if get.opt("use_sliding_window", False):
        window = get.int("sliding_window")
        types = get.raw.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 and i < int(get.opt("max_window_layers", 28)) else "full"
            for i in range(num_layers)
        ]
        windows = [window if t == "sliding_attention" else None for t in types]
    return dict(
        num_experts=num_experts,
        moe_intermediate_size=get.int("moe_intermediate_size"),
        moe_layers=_qwen_moe_layers(get, num_layers, num_experts),
        dense_intermediate_size=get.int("intermediate_size"),
        norm_topk_prob=bool(get.opt("norm_topk_prob", False)),
        shared_expert_intermediate_size=get.int("shared_expert_intermediate_size"),
        qkv_bias=bool(get.opt("qkv_bias", True)),
        o_bias=False,
        qk_norm="none",
        clip_qkv=None,
        sliding_windows=tuple(windows),
    )


def _qwen3_moe(get: _Getter, num_layers: int) -> dict[str, Any]:
    num_experts = _num_experts(get)
    window = get.raw.get("sliding_window") if get.opt("use_sliding_window", False) else None
    bias = bool(get.opt("attention_bias", False))
    return dict(
        num_experts=num_experts,
        moe_intermediate_size=get.int("moe_intermediate_size"),
        moe_layers=_qwen_moe_layers(get, num_layers, num_experts),
        dense_intermediate_size=get.int("intermediate_size"),
        norm_topk_prob=bool(get.opt("norm_topk_prob", False)),
        shared_expert_intermediate_size=0,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        clip_qkv=None,
        sliding_windows=(window,) * num_layers,
    )


def _olmoe(get: _Getter, num_layers: int) -> dict[str, Any]:
    bias = bool(get.opt("attention_bias", False))
    clip = get.raw.get("clip_qkv")
    return dict(
        num_experts=_num_experts(get),
        moe_intermediate_size=get.int("intermediate_size"),
        moe_layers=(True,) * num_layers,
        dense_intermediate_size=0,
        norm_topk_prob=bool(get.opt("norm_topk_prob", False)),
        shared_expert_intermediate_size=0,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="full",
        clip_qkv=float(clip) if clip is not None else None,
        sliding_windows=(None,) * num_layers,  # OLMoE builds a plain causal mask
    )


def _sigmoid_groups(get: _Getter, num_layers: int) -> dict[str, Any]:
    """What DeepSeek-V3 and GLM-4.5-MoE share: grouped sigmoid routing with a correction bias,
    ungated `shared_experts` of n_shared_experts x moe_intermediate_size, dense first layers."""
    for key, allowed in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        value = get.raw.get(key, allowed)
        if value != allowed:
            raise ModelLoadError(
                f"{get.source}: {key} {value!r} is not supported for model_type {get.raw['model_type']!r}; "
                f"supported: {allowed!r} (DeepSeek-V3 routing)"
            )
    num_experts = get.int("n_routed_experts")
    n_group, topk_group = int(get.opt("n_group", 1)), int(get.opt("topk_group", 1))
    if n_group < 1 or num_experts % n_group or num_experts // n_group < 2 or not 1 <= topk_group <= n_group:
        raise ModelLoadError(
            f"{get.source}: n_group={n_group}, topk_group={topk_group} do not fit n_routed_experts={num_experts}; "
            "need groups of at least 2 experts that divide them evenly and 1 <= topk_group <= n_group"
        )
    first_dense = int(get.opt("first_k_dense_replace", 0))
    inter = get.int("moe_intermediate_size")
    return dict(
        num_experts=num_experts,
        moe_intermediate_size=inter,
        moe_layers=tuple(i >= first_dense for i in range(num_layers)),
        dense_intermediate_size=get.int("intermediate_size"),
        norm_topk_prob=bool(get.opt("norm_topk_prob", True)),
        shared_expert_intermediate_size=inter * int(get.opt("n_shared_experts", 0)),
        shared_expert_name="shared_experts",
        shared_expert_gated=False,
        router="sigmoid_groups",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(get.opt("routed_scaling_factor", 1.0)),
        clip_qkv=None,
        sliding_windows=(None,) * num_layers,
        skipped_layers=int(get.opt("num_nextn_predict_layers", 0) or 0),
    )


def _deepseek_v3(get: _Getter, num_layers: int) -> dict[str, Any]:
    nope, rope_dim = get.int("qk_nope_head_dim"), get.int("qk_rope_head_dim")
    mla = MLAConfig(
        q_lora_rank=int(get.opt("q_lora_rank", 0) or 0),
        kv_lora_rank=get.int("kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=get.int("v_head_dim"),
        bias=bool(get.opt("attention_bias", False)),
    )
    rope = _rope(get, rope_dim, bool(get.opt("rope_interleave", True)))
    scale = (nope + rope_dim) ** -0.5
    if rope.yarn is not None and rope.yarn.get("mscale_all_dim"):
        # DeepSeek scales the softmax by YaRN's mscale squared, besides cos/sin.
        factor = float(rope.yarn["factor"])
        mscale = 0.1 * float(rope.yarn["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return dict(
        _sigmoid_groups(get, num_layers),
        head_dim=nope + rope_dim,  # the query/key head; values have v_head_dim
        qkv_bias=False,
        o_bias=False,
        qk_norm="none",
        rope=rope,
        mla=mla,
        attn_scale=scale,
    )


def _glm4_moe(get: _Getter, num_layers: int) -> dict[str, Any]:
    head_dim = int(get.opt("head_dim", None) or get.int("hidden_size") // get.int("num_attention_heads"))
    factor = float(_rope_params(get).get("partial_rotary_factor") or get.opt("partial_rotary_factor", 1.0))
    return dict(
        _sigmoid_groups(get, num_layers),
        qkv_bias=bool(get.opt("attention_bias", False)),
        o_bias=False,
        qk_norm="head" if get.opt("use_qk_norm", False) else "none",
        rope=_rope(get, int(head_dim * factor), False),
    )


def _gpt_oss(get: _Getter, num_layers: int) -> dict[str, Any]:
    head_dim = int(get.opt("head_dim", None) or get.int("hidden_size") // get.int("num_attention_heads"))
    window = get.raw.get("sliding_window")
    types = get.raw.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
    ]
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{get.source}: layer_types must list sliding_attention or full_attention per layer")
    bias = bool(get.opt("attention_bias", True))
    return dict(
        num_experts=_num_experts(get),
        moe_intermediate_size=get.int("intermediate_size"),
        moe_layers=(True,) * num_layers,
        dense_intermediate_size=0,
        norm_topk_prob=True,  # softmax over the top-k logits
        shared_expert_intermediate_size=0,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="none",
        clip_qkv=None,
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in types),
        rope=_rope(get, head_dim, False),
        router_name="router",
        router_logit_bias=True,
        attention_sinks=True,
        expert_bias=True,
        swiglu_clamp=(float(get.opt("swiglu_limit", 7.0)), float(get.opt("swiglu_alpha", 1.702))),
    )


_YARN_ARCHS = ("deepseek_v3", "glm4_moe", "gpt_oss")

_PARSERS: dict[str, Callable[[_Getter, int], dict[str, Any]]] = {
    "deepseek_v3": _deepseek_v3,
    "glm4_moe": _glm4_moe,
    "gpt_oss": _gpt_oss,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
}

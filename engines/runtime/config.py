"""ModelConfig: one normalised description of a supported MoE architecture, read from config.json.

Each architecture's quirks (router normalisation, shared expert, q/k norms, biases, sliding
windows, dense layers) become plain fields here, so the model code has no per-architecture
branches. Rules follow transformers 5.x's modeling files for each model type.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engines.base import ModelLoadError

SUPPORTED_ARCHITECTURES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe")


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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


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
        rope_theta=_rope_theta(get),
        max_position_embeddings=get.int("max_position_embeddings"),
        rms_norm_eps=float(get.opt("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(get.opt("tie_word_embeddings", False)),
        top_k=get.int("num_experts_per_tok"),
        hidden_act=act,
        eos_token_ids=_eos_ids(generation or {}, raw),
        quantization=raw.get("quantization_config"),
    )
    specific = _PARSERS[model_type](get, num_layers)
    cfg = ModelConfig(**common, **specific)
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


def _rope_theta(get: _Getter) -> float:
    # transformers 5 writes rope_parameters; older checkpoints have rope_theta + rope_scaling.
    params = get.raw.get("rope_parameters") or {}
    scaling = get.raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ModelLoadError(f"{get.source}: rope_type {rope_type!r} is not supported; supported: default")
    return float(params.get("rope_theta") or get.raw.get("rope_theta") or 10000.0)


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


_PARSERS: dict[str, Callable[[_Getter, int], dict[str, Any]]] = {
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
}

"""Read a local Hugging Face MoE folder (config.json + safetensors) into runtime weights.

Handles one `model.safetensors` or shards listed in `model.safetensors.index.json`, experts
stored per expert (`experts.{e}.w1|w3|w2` or `experts.{e}.{gate,up,down}_proj`) or fused
(`experts.gate_up_proj [E, 2I, D]`, `experts.down_proj [E, D, I]`). Loading is strict: every
expected tensor must exist with the shape config.json implies, and every tensor in the
files must be used, so a checkpoint we do not understand fails loudly instead of running
with random weights. Errors are ModelLoadError with the file and tensor named; the one
exception is DeepSeek/GLM multi-token-prediction layers (`model.layers.{L}` and up), skipped
and logged. gpt-oss experts (fused, or MXFP4: dequantized, or kept packed by
`load_mxfp4_weights`) are read by engines/runtime/mxfp4.py.

The reader is pluggable and knows no quantization: `load_model` takes the loader of a
layer's routed experts and, optionally, a `LinearFormat` for linear layers stored other than
as a plain `.weight`. Quantized folders load through engines/quant/load.py, which plugs both.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from engines.base import ModelLoadError
from engines.runtime.config import ModelConfig, parse_config
from engines.runtime.mxfp4 import Mxfp4Experts, gpt_oss_experts, is_mxfp4, mxfp4_experts
from engines.runtime.transfer import TransferLedger
from engines.runtime.weights import (
    AttentionWeights,
    DenseExperts,
    LayerWeights,
    MLAWeights,
    MLPWeights,
    ModelWeights,
    MoEWeights,
)

_log = logging.getLogger(__name__)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Buffers some exporters save that carry no learned weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Per-expert projection names: Mixtral's original ones, and everyone else's (GPTQModel's too).
EXPERT_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: ModelConfig
    raw_config: dict[str, Any]
    key_files: dict[str, Path]  # tensor name -> safetensors file holding it


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None


def open_checkpoint(path: str | Path, config_only: bool = False) -> Checkpoint:
    """Validate the folder layout and parse its config; reads no tensor data yet. With
    `config_only` (a simulated run, whose weights are shapes on the meta device) the folder
    needs only config.json; weight files, if any, are not opened."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ModelLoadError(f"model folder {root} does not exist")
    if not root.is_dir():
        raise ModelLoadError(f"--model must be a folder with config.json and safetensors files; {root} is a file")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{root} has no config.json; expected a Hugging Face model folder")
    raw = read_json(config_path)
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path}: expected a JSON object")
    gen_path = root / "generation_config.json"
    generation = read_json(gen_path) if gen_path.is_file() else None
    config = parse_config(raw, str(config_path), generation)
    return Checkpoint(root, config, raw, {} if config_only else _key_files(root))


def _key_files(root: Path) -> dict[str, Path]:
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: missing or empty 'weight_map'")
        for shard in sorted(set(weight_map.values())):
            if not (root / shard).is_file():
                raise ModelLoadError(f"shard {shard} listed in {index} is missing from {root}")
        return {key: root / shard for key, shard in weight_map.items()}
    single = root / SINGLE_FILE
    if single.is_file():
        try:
            with safe_open(single, "pt") as f:
                return {key: single for key in f.keys()}
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {single}: {exc}") from None
    if not any(root.glob("*.safetensors")) and not any(root.glob("*.bin")):
        raise ModelLoadError(f"{root} holds config.json but no weights: a config-only model runs only simulated "
                             "(add --simulate HARDWARE, e.g. --simulate h100-sxm; `pwbench hw list` shows them)")
    if any(root.glob("*.bin")):
        raise ModelLoadError(f"{root} holds PyTorch .bin weights; pwbench reads safetensors only "
                             "(re-save with save_pretrained)")
    raise ModelLoadError(f"{root} has neither {SINGLE_FILE} nor {INDEX_FILE}")


class LinearFormat(Protocol):
    """How a folder stores linear layers other than as a plain `{prefix}.weight`."""

    def stored(self, reader: TensorReader, prefix: str) -> bool:
        """True when linear layer `prefix` is stored in this format."""

    def dense(self, reader: TensorReader, prefix: str, shape: tuple[int, int]) -> Tensor | None:
        """Its weight [out, in] at the reader's dtype on the device; None if a tensor is missing."""


class TensorReader:
    """Tensor access by name across shards, with shape checks and a record of what was used."""

    def __init__(self, ckpt: Checkpoint, stack: ExitStack, device: torch.device, dtype: torch.dtype,
                 ledger: TransferLedger, linear_format: LinearFormat | None = None):
        self.ckpt, self.stack, self.device, self.dtype, self.ledger = ckpt, stack, device, dtype, ledger
        self.linear_format = linear_format
        self.handles: dict[Path, Any] = {}
        self.used: set[str] = set()
        self.missing: list[str] = []

    def _handle(self, file: Path) -> Any:
        if file not in self.handles:
            try:
                self.handles[file] = self.stack.enter_context(safe_open(file, "pt"))
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(f"cannot read {file}: {exc}") from None
        return self.handles[file]

    def has(self, key: str) -> bool:
        return key in self.ckpt.key_files

    def get(self, key: str, shape: tuple[int, ...]) -> Tensor | None:
        """The tensor at model dtype on the device; None (and recorded as missing) if absent."""
        tensor = self._read(key, shape)
        return None if tensor is None else self.ledger.to_device(tensor.to(self.dtype), tag="load")

    def raw(self, key: str) -> Tensor | None:
        """The tensor as stored (packed int32, fp16 scales) on the device; the caller checks shapes."""
        tensor = self._read(key, None)
        return None if tensor is None else self.ledger.to_device(tensor, tag="load")

    def _read(self, key: str, shape: tuple[int, ...] | None) -> Tensor | None:
        file = self.ckpt.key_files.get(key)
        if file is None:
            self.missing.append(key)
            return None
        handle = self._handle(file)
        try:
            found = tuple(handle.get_slice(key).get_shape())
            if shape is not None and found != shape:
                raise ModelLoadError(
                    f"tensor {key} in {file} has shape {list(found)}, but config.json implies {list(shape)}"
                )
            tensor = handle.get_tensor(key)
        except SafetensorError as exc:
            raise ModelLoadError(f"cannot read tensor {key} from {file}: {exc}") from None
        self.used.add(key)
        return tensor

    def linear(self, prefix: str, shape: tuple[int, int]) -> Tensor | None:
        """The weight [out, in] of linear layer `prefix` at model dtype (through the folder's
        LinearFormat when it is stored that way)."""
        fmt = self.linear_format
        if fmt is not None and not self.has(prefix + ".weight") and fmt.stored(self, prefix):
            return fmt.dense(self, prefix, shape)
        return self.get(prefix + ".weight", shape)


class ShapeReader(TensorReader):
    """Every tensor config.json implies, as an empty tensor on the meta device: the weights of a
    simulated run (shapes and bytes, no data; --simulate). Layout probes answer for the fused
    layout (`experts.gate_up_proj`), and for MXFP4 blocks when the config says MXFP4."""

    def has(self, key: str) -> bool:
        if key.endswith("gate_up_proj_blocks"):
            return is_mxfp4(self.ckpt.config)
        return key.endswith("experts.gate_up_proj")

    def _read(self, key: str, shape: tuple[int, ...] | None) -> Tensor | None:
        self.used.add(key)
        if shape is not None:
            return torch.empty(shape, dtype=self.dtype, device="meta")
        return torch.empty(self._packed_shape(key), dtype=torch.uint8, device="meta")

    def _packed_shape(self, key: str) -> tuple[int, ...]:
        """MXFP4 `*_blocks` [E, rows, cols/32, 16] and `*_scales` [E, rows, cols/32] (uint8)."""
        cfg = self.ckpt.config
        E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        rows, cols = (2 * I, D) if ".gate_up_proj_" in key else (D, I)
        if key.endswith("_blocks"):
            return E, rows, cols // 32, 16
        if key.endswith("_scales"):
            return E, rows, cols // 32
        raise ModelLoadError(f"a simulated model has no stored shape for {key}")


# Reads one MoE layer's routed experts: (reader, config, "model.layers.N.<moe>.experts.") -> experts | None.
ExpertLoader = Callable[[TensorReader, ModelConfig, str], Any]


def load_weights(
    ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, ledger: TransferLedger
) -> tuple[ModelWeights, dict[int, DenseExperts]]:
    """Dense weights plus each MoE layer's routed experts at full precision."""
    cfg = ckpt.config
    if cfg.quantization and not is_mxfp4(cfg):
        method = cfg.quantization.get("quant_method", "?")
        raise ModelLoadError(
            f"{ckpt.path} is a quantized checkpoint (quant_method {method!r}); the full-precision "
            "engine needs a full-precision folder (quantized folders run with --engine static-gptq, "
            "static-awq or static-rtn)"
        )
    return load_model(ckpt, device, dtype, ledger, dense_experts)


def load_mxfp4_weights(
    ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, ledger: TransferLedger
) -> tuple[ModelWeights, dict[int, Mxfp4Experts]]:
    """Dense weights plus each MoE layer's routed experts kept in MXFP4 (an MXFP4 gpt-oss folder)."""
    if not is_mxfp4(ckpt.config):
        method = (ckpt.config.quantization or {}).get("quant_method")
        raise ModelLoadError(f"{ckpt.path} is not a gpt-oss folder with MXFP4 experts ({ckpt.config.architecture}, "
                             f"quant_method {method!r}); MXFP4 experts can be served only from one")
    return load_model(ckpt, device, dtype, ledger, mxfp4_experts)


def load_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, ledger: TransferLedger,
               load_experts: ExpertLoader,
               linear_format: LinearFormat | None = None) -> tuple[ModelWeights, dict[int, Any]]:
    """Every tensor of the folder, strictly: routed experts through `load_experts`, other linear
    layers plain or through `linear_format`. Raises ModelLoadError naming missing tensors and
    tensors nothing used."""
    reader = ShapeReader if device.type == "meta" else TensorReader
    with ExitStack() as stack:
        return _load(reader(ckpt, stack, device, dtype, ledger, linear_format), load_experts)


def _load(reader: TensorReader, load_experts: ExpertLoader) -> tuple[ModelWeights, dict[int, Any]]:
    """Every tensor of the model through `reader`; routed experts through `load_experts`.
    Raises ModelLoadError naming missing tensors and tensors nothing used."""
    ckpt, cfg = reader.ckpt, reader.ckpt.config
    D, V = cfg.hidden_size, cfg.vocab_size
    embed = reader.get("model.embed_tokens.weight", (V, D))
    norm = reader.get("model.norm.weight", (D,))
    lm_head = embed if cfg.tie_word_embeddings else reader.linear("lm_head", (V, D))
    layers, experts = [], {}
    for i in range(cfg.num_layers):
        layer, layer_experts = _load_layer(reader, cfg, i, load_experts)
        layers.append(layer)
        if layer_experts is not None:
            experts[i] = layer_experts
    if reader.missing:
        shown = ", ".join(reader.missing[:4])
        more = f" (and {len(reader.missing) - 4} more)" if len(reader.missing) > 4 else ""
        raise ModelLoadError(f"{ckpt.path}: {len(reader.missing)} tensors missing: {shown}{more}")
    skipped = {k for k in ckpt.key_files if _layer_index(k) >= cfg.num_layers} if cfg.skipped_layers else set()
    if skipped:
        _log.info("%s: skipped %d tensors of %d multi-token-prediction layer(s) (model.layers.%d and up; "
                  "not used for generation)", ckpt.path, len(skipped), cfg.skipped_layers, cfg.num_layers)
    unused = sorted(k for k in ckpt.key_files if k not in reader.used and not k.endswith(_IGNORED_SUFFIXES)
                    and k not in skipped)
    if unused:
        raise ModelLoadError(
            f"{ckpt.path}: {len(unused)} tensors do not belong to a {cfg.architecture} model of this "
            f"config (first: {unused[0]}); a different architecture or a quantized export?"
        )
    return ModelWeights(embed, norm, lm_head, layers), experts  # type: ignore[arg-type]


def _layer_index(key: str) -> int:
    """N of a `model.layers.N.` tensor; -1 for any other."""
    parts = key.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


def _load_mla(reader: TensorReader, cfg: ModelConfig, p: str) -> MLAWeights:
    m, D, H = cfg.mla, cfg.hidden_size, cfg.num_heads
    assert m is not None
    get, linear = reader.get, reader.linear
    qk, r = m.qk_nope_head_dim + m.qk_rope_head_dim, m.kv_lora_rank
    w = MLAWeights(
        kv_a=linear(p + "kv_a_proj_with_mqa", (r + m.qk_rope_head_dim, D)),
        kv_a_norm=get(p + "kv_a_layernorm.weight", (r,)),
        kv_b=linear(p + "kv_b_proj", (H * (m.qk_nope_head_dim + m.v_head_dim), r)),
        o=linear(p + "o_proj", (D, H * m.v_head_dim)),
    )  # type: ignore[arg-type]
    if m.q_lora_rank:
        w.q_a = linear(p + "q_a_proj", (m.q_lora_rank, D))
        w.q_a_norm = get(p + "q_a_layernorm.weight", (m.q_lora_rank,))
        w.q_b = linear(p + "q_b_proj", (H * qk, m.q_lora_rank))
    else:
        w.q = linear(p + "q_proj", (H * qk, D))
    if m.bias:
        w.q_a_bias = get(p + "q_a_proj.bias", (m.q_lora_rank,)) if m.q_lora_rank else None
        w.kv_a_bias = get(p + "kv_a_proj_with_mqa.bias", (r + m.qk_rope_head_dim,))
        w.o_bias = get(p + "o_proj.bias", (D,))
    return w


def _load_attention(reader: TensorReader, cfg: ModelConfig, p: str) -> AttentionWeights:
    D, hd = cfg.hidden_size, cfg.head_dim
    get, linear = reader.get, reader.linear
    bias = cfg.qkv_bias
    norm_q = {"head": (hd,), "full": (cfg.q_size,)}.get(cfg.qk_norm)
    norm_k = {"head": (hd,), "full": (cfg.kv_size,)}.get(cfg.qk_norm)
    return AttentionWeights(
        q=linear(p + "self_attn.q_proj", (cfg.q_size, D)),
        k=linear(p + "self_attn.k_proj", (cfg.kv_size, D)),
        v=linear(p + "self_attn.v_proj", (cfg.kv_size, D)),
        o=linear(p + "self_attn.o_proj", (D, cfg.q_size)),
        q_bias=get(p + "self_attn.q_proj.bias", (cfg.q_size,)) if bias else None,
        k_bias=get(p + "self_attn.k_proj.bias", (cfg.kv_size,)) if bias else None,
        v_bias=get(p + "self_attn.v_proj.bias", (cfg.kv_size,)) if bias else None,
        o_bias=get(p + "self_attn.o_proj.bias", (D,)) if cfg.o_bias else None,
        q_norm=get(p + "self_attn.q_norm.weight", norm_q) if norm_q else None,
        k_norm=get(p + "self_attn.k_norm.weight", norm_k) if norm_k else None,
        sinks=get(p + "self_attn.sinks", (cfg.num_heads,)) if cfg.attention_sinks else None,
    )  # type: ignore[arg-type]


def _load_layer(reader: TensorReader, cfg: ModelConfig, i: int, load_experts: ExpertLoader) -> tuple[LayerWeights, Any]:
    p = f"model.layers.{i}."
    D, get = cfg.hidden_size, reader.get
    attn = _load_mla(reader, cfg, p + "self_attn.") if cfg.mla is not None else _load_attention(reader, cfg, p)
    attn_norm = get(p + "input_layernorm.weight", (D,))
    mlp_norm = get(p + "post_attention_layernorm.weight", (D,))
    if not cfg.moe_layers[i]:
        mlp = _load_mlp(reader, p + "mlp.", cfg.dense_intermediate_size, D)
        return LayerWeights(attn_norm, attn, mlp_norm, mlp), None  # type: ignore[arg-type]
    # Mixtral checkpoints say block_sparse_moe; transformers' in-memory names and GPTQModel say mlp.
    mp = p + ("block_sparse_moe." if reader.has(p + "block_sparse_moe.gate.weight") else "mlp.")
    moe = MoEWeights(router=get(mp + cfg.router_name + ".weight", (cfg.num_experts, D)))  # type: ignore[arg-type]
    if cfg.router == "sigmoid_groups":
        moe.correction_bias = get(mp + "gate.e_score_correction_bias", (cfg.num_experts,))
    if cfg.router_logit_bias:
        moe.router_bias = get(mp + cfg.router_name + ".bias", (cfg.num_experts,))
    if cfg.shared_expert_intermediate_size:
        moe.shared = _load_mlp(reader, mp + cfg.shared_expert_name + ".", cfg.shared_expert_intermediate_size, D)
        if cfg.shared_expert_gated:
            moe.shared_gate = get(mp + "shared_expert_gate.weight", (1, D))
    experts = load_experts(reader, cfg, mp + "experts.")
    return LayerWeights(attn_norm, attn, mlp_norm, moe), experts  # type: ignore[arg-type]


def _load_mlp(reader: TensorReader, prefix: str, inter: int, D: int) -> MLPWeights | None:
    gate = reader.linear(prefix + "gate_proj", (inter, D))
    up = reader.linear(prefix + "up_proj", (inter, D))
    down = reader.linear(prefix + "down_proj", (D, inter))
    if gate is None or up is None or down is None:
        return None
    return MLPWeights(torch.cat([gate, up]), down)


def dense_experts(reader: TensorReader, cfg: ModelConfig, prefix: str) -> DenseExperts | None:
    """A layer's routed experts at full precision, per-expert or fused on disk -> one stacked record."""
    E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if cfg.expert_bias:
        return gpt_oss_experts(reader, cfg, prefix)
    if reader.has(prefix + "gate_up_proj"):
        gate_up = reader.get(prefix + "gate_up_proj", (E, 2 * I, D))
        down = reader.get(prefix + "down_proj", (E, D, I))
        return DenseExperts(gate_up, down) if gate_up is not None and down is not None else None
    names = expert_names(reader, prefix, "weight")
    gate_up = torch.empty(E, 2 * I, D, dtype=reader.dtype, device=reader.device)
    down = torch.empty(E, D, I, dtype=reader.dtype, device=reader.device)
    complete = True
    for e in range(E):
        g = reader.get(f"{prefix}{e}.{names[0]}.weight", (I, D))
        u = reader.get(f"{prefix}{e}.{names[1]}.weight", (I, D))
        d = reader.get(f"{prefix}{e}.{names[2]}.weight", (D, I))
        if g is None or u is None or d is None:
            complete = False
            continue
        gate_up[e, :I], gate_up[e, I:], down[e] = g, u, d
    return DenseExperts(gate_up, down) if complete else None


def expert_names(reader: TensorReader, prefix: str, suffix: str) -> tuple[str, str, str]:
    """(gate, up, down) projection names of the per-expert layout this folder uses."""
    return next((n for n in EXPERT_NAMES if reader.has(f"{prefix}0.{n[0]}.{suffix}")), EXPERT_NAMES[1])

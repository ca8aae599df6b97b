"""MoE calibration: quantize every routed expert from the tokens it really sees, layer by layer.

All calibration prompts run through the runtime's own MoEModel as one flat prefill batch, with
the expert function replaced by a LayerQuantizer. At MoE layer i it takes each expert's routed
tokens, tops up experts that got fewer than `min_expert_tokens` with the tokens that ranked
them highest outside the top-k (a Hessian from 3 tokens is noise), quantizes the layer (RTN,
GPTQ or AWQ) and returns the *quantized* layer's output through the serving op (fused_moe):
layer i+1 is calibrated on what the quantized model computes, as GPTQ prescribes. Routers,
attention and shared experts stay full precision.

AWQ's gate/up input scale s is one vector per layer, shared by all its experts: their input is
the post-attention RMSNorm's output, which the router and the shared expert read too. The
writer folds it into the checkpoint (norm weight / s; router, shared expert and its gate x s),
which is exact in full precision and yields a standard AWQ folder that any AWQ loader runs
with no extra tensor. Per-expert input scales would fit each expert better but have no place
in any format. Each expert's down-projection scale is folded into its own up rows, except
for gpt-oss's clamped SwiGLU ((clamp(up) + 1) * glu(gate) does not scale with up), whose down
projection is quantized unscaled. Expert biases and the clamp pass through unquantized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.quant.awq import act_scale, fake_quantize, linear_loss, search_clip, search_scale
from engines.quant.gptq import gptq_quantize, hessian
from engines.quant.hf_format import SCALE_DTYPE
from engines.quant.ops import fused_moe
from engines.quant.qweight import (
    PER_ROW,
    SUPPORTED_GROUP_SIZES,
    QuantFormatError,
    QuantizedExperts,
    check_bits,
    check_scheme,
    dequantize,
    quantize_experts,
    quantize_rtn,
    resolve_group,
    stack,
)
from engines.runtime.attention import AttentionBatch, PrefillSegment
from engines.runtime.config import ModelConfig
from engines.runtime.experts import Dispatch, StackedBackend, grouped_swiglu
from engines.runtime.kv_cache import PagedKVCache
from engines.runtime.model import MoEModel
from engines.runtime.transfer import TransferLedger
from engines.runtime.weights import DenseExperts, ModelWeights

METHODS = ("rtn", "gptq", "awq")
BLOCK = 16  # KV block size of the calibration pass


@dataclass(frozen=True)
class QuantizeOptions:
    """How routed experts are quantized. GPTQ defaults follow GPTQModel's (damp 0.01)."""

    method: str  # rtn | gptq | awq
    bits: int = 4
    group_size: int = 128
    symmetric: bool = False
    act_order: bool = False  # GPTQ only: quantize columns by decreasing Hessian diagonal (g_idx)
    damp_percent: float = 0.01  # GPTQ: damping added to the Hessian diagonal, as a fraction of its mean
    min_expert_tokens: int = 128  # top up experts routed fewer calibration tokens than this
    awq_grid: int = 20  # AWQ: alpha steps over [0, 1]

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantFormatError(f"method {self.method!r} is not supported; supported: {', '.join(METHODS)}")
        check_bits(self.bits, "quantize")
        if self.group_size not in (*SUPPORTED_GROUP_SIZES, PER_ROW):
            raise QuantFormatError(f"quantize: group_size must be one of {SUPPORTED_GROUP_SIZES} or {PER_ROW} "
                                   f"(one group per row), got {self.group_size}")
        if self.act_order and self.method != "gptq":
            raise QuantFormatError(f"act_order applies to method gptq only, not {self.method}")
        if not 0 <= self.damp_percent < 1:
            raise QuantFormatError(f"damp_percent must be in [0, 1), got {self.damp_percent}")
        if self.min_expert_tokens < 0 or self.awq_grid < 1:
            raise QuantFormatError("min_expert_tokens must be >= 0 and awq_grid >= 1")


@dataclass(frozen=True)
class LayerReport:
    """One MoE layer: output error on its calibration tokens and what each expert saw."""

    layer: int
    rel_error: float  # ||y_q - y||² / ||y||² of the routed experts' output, this method
    rtn_rel_error: float  # the same for round-to-nearest at the same bits, same inputs
    routed: tuple[int, ...]  # calibration tokens routed to each expert
    added: tuple[int, ...]  # tokens added to reach min_expert_tokens
    awq_alpha: float | None = None  # AWQ: the gate/up scale exponent chosen


@dataclass(frozen=True)
class QuantizedModel:
    experts: dict[int, QuantizedExperts]  # MoE layer -> its quantized routed experts
    input_scales: dict[int, Tensor]  # AWQ: MoE layer -> gate/up input scale s [D] to fold in
    layers: tuple[LayerReport, ...]
    tokens: int  # calibration tokens


class LayerQuantizer(StackedBackend):
    """The calibration pass's expert backend: in layer i's forward it quantizes layer i's
    experts from the tokens routed to them, and returns the quantized layer's output, so
    later layers calibrate on what the quantized model computes."""

    def __init__(self, weights: ModelWeights, dense: dict[int, DenseExperts], options: QuantizeOptions,
                 progress: Callable[[LayerReport], None] | None = None) -> None:
        super().__init__(dense)
        self.weights, self.dense, self.options, self.progress = weights, dense, options, progress
        self.experts: dict[int, QuantizedExperts] = {}
        self.input_scales: dict[int, Tensor] = {}
        self.reports: list[LayerReport] = []

    def forward(self, i: int, h: Tensor, d: Dispatch) -> Tensor:
        dense = self.dense[i]
        o = self.options
        moe = self.weights.layers[i].mlp
        tokens, added = self._expert_tokens(h, d, moe.router, moe.router_bias)  # type: ignore[union-attr]
        rtn = quantize_experts(dense, o.bits, o.group_size, o.symmetric, SCALE_DTYPE)
        scale, alpha = None, None
        if o.method == "gptq":
            q = self._gptq(h, dense, tokens)
        elif o.method == "awq":
            q, scale, alpha = self._awq(h, d, dense, tokens)
            self.input_scales[i] = scale
        else:
            q = rtn
        y_q = fused_moe(h if scale is None else h / scale.to(h.dtype), d, q)
        y = grouped_swiglu(h, d, dense).float()
        self.experts[i] = q
        report = LayerReport(i, _rel_error(y_q, y), _rel_error(fused_moe(h, d, rtn), y), tuple(d.counts),
                             tuple(added), alpha)
        self.reports.append(report)
        if self.progress is not None:
            self.progress(report)
        return y_q

    def _expert_tokens(self, h: Tensor, d: Dispatch, router: Tensor,
                       router_bias: Tensor | None) -> tuple[list[Tensor], list[int]]:
        """Rows of h for each expert: its routed tokens, then the top-ranked others if too few."""
        need = min(self.options.min_expert_tokens, h.shape[0])
        tokens, added, start, probs = [], [], 0, None
        for e, n in enumerate(d.counts):
            rows = d.token_index[start : start + n]
            start += n
            short = need - n
            if short > 0:
                if probs is None:
                    probs = torch.softmax(F.linear(h, router, router_bias).float(), dim=-1)
                score = probs[:, e].clone()
                score[rows] = -torch.inf
                rows = torch.cat([rows, torch.topk(score, short).indices])
            tokens.append(rows)
            added.append(max(0, short))
        return tokens, added

    def _gptq(self, h: Tensor, dense: DenseExperts, tokens: list[Tensor]) -> QuantizedExperts:
        """gate_up from the expert's inputs, then down from its inputs through the *quantized*
        gate_up (GPTQ's true-sequential order)."""
        o = self.options
        args = dict(damp_percent=o.damp_percent, act_order=o.act_order, scale_dtype=SCALE_DTYPE)
        gate_up, down = [], []
        for e, rows in enumerate(tokens):
            x = h[rows].float()  # one expert's inputs at a time: all of them at once is T*A*D floats
            gu = gptq_quantize(dense.gate_up[e], hessian(x), o.bits, o.group_size, o.symmetric, **args)
            a = _activation(x, dequantize(gu, torch.float32), dense, e)
            down.append(gptq_quantize(dense.down[e], hessian(a), o.bits, o.group_size, o.symmetric, **args))
            gate_up.append(gu)
        return QuantizedExperts(stack(gate_up), stack(down), dense.gate_up_bias, dense.down_bias, dense.clamp)

    def _awq(self, h: Tensor, d: Dispatch, dense: DenseExperts,
             tokens: list[Tensor]) -> tuple[QuantizedExperts, Tensor, float]:
        o = self.options
        inter, hidden = dense.down.shape[-1], dense.down.shape[-2]
        qargs = (o.bits, resolve_group(o.group_size, hidden), o.symmetric)  # gate_up's inputs: D
        dargs = (o.bits, resolve_group(o.group_size, inter), o.symmetric)  # down's inputs: I
        hf, down_fp = h.float(), dense.down.float()
        biases = [None if b is None else b.float() for b in (dense.gate_up_bias, dense.down_bias)]

        def f32(gate_up: Tensor) -> DenseExperts:
            return DenseExperts(gate_up, down_fp, *biases, dense.clamp)

        y_ref = grouped_swiglu(hf, d, f32(dense.gate_up.float()))

        def block_loss(s: Tensor) -> float:  # the layer's output with only gate/up quantized
            return float((grouped_swiglu(hf, d, f32(fake_quantize(dense.gate_up, s, *qargs))) - y_ref).pow(2).mean())

        choice = search_scale(act_scale(hf), block_loss, o.awq_grid)
        s = choice.scale
        gate_up, down = dense.gate_up.float() * s, down_fp.clone()
        for e, rows in enumerate(tokens):
            x = hf[rows]
            a = _activation(x, dense.gate_up[e].float(), dense, e)
            if dense.clamp is None:  # a scales with up's rows only without the clamp (see the docstring)
                c = search_scale(act_scale(a), linear_loss(a, down[e], *dargs), o.awq_grid).scale
                down[e] *= c
                gate_up[e, inter:] /= c[:, None]  # up's output rows feed down's input channels
                a = a / c
            gate_up[e] = search_clip(x / s, gate_up[e], *qargs, grid=o.awq_grid)
            down[e] = search_clip(a, down[e], *dargs, grid=o.awq_grid)
        q = QuantizedExperts(quantize_rtn(gate_up, *qargs, SCALE_DTYPE), quantize_rtn(down, *dargs, SCALE_DTYPE),
                             dense.gate_up_bias, dense.down_bias, dense.clamp)
        return q, s, choice.alpha


def _activation(x: Tensor, gate_up: Tensor, dense: DenseExperts, e: int) -> Tensor:
    """Expert e's down-projection input for rows x [n, D] through `gate_up` [2I, D] in float32:
    silu(gate) * up, or gpt-oss's clamped variant with its gate/up bias (as experts.swiglu)."""
    bias = None if dense.gate_up_bias is None else dense.gate_up_bias[e].float()
    gate, up = F.linear(x, gate_up, bias).chunk(2, dim=-1)
    if dense.clamp is None:
        return F.silu(gate) * up
    limit, alpha = dense.clamp
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _rel_error(y_q: Tensor, y: Tensor) -> float:
    return float((y_q.float() - y).pow(2).sum() / y.pow(2).sum().clamp(min=1e-30))


def check_model(options: QuantizeOptions, config: ModelConfig) -> None:
    """Raise QuantFormatError unless the group size divides both expert input dimensions."""
    check_scheme(options.bits, options.group_size, config.hidden_size, "experts gate/up (hidden_size)")
    check_scheme(options.bits, options.group_size, config.moe_intermediate_size, "experts down (moe_intermediate_size)")


def quantize_model(config: ModelConfig, weights: ModelWeights, experts: dict[int, DenseExperts],
                   prompts: Sequence[Sequence[int]], options: QuantizeOptions,
                   progress: Callable[[LayerReport], None] | None = None) -> QuantizedModel:
    """Quantize every MoE layer's routed experts, calibrated on `prompts` (token ids, each at most
    max_position_embeddings long), on the device and dtype the weights are on."""
    check_model(options, config)
    if not prompts or not all(prompts):
        raise QuantFormatError("calibration needs at least one non-empty prompt")
    longest = max(map(len, prompts))
    if longest > config.max_position_embeddings:
        raise QuantFormatError(f"a calibration prompt has {longest} tokens; the model takes at most "
                               f"{config.max_position_embeddings}")
    device, dtype = weights.embed.device, weights.embed.dtype
    ledger = TransferLedger(device)
    quantizer = LayerQuantizer(weights, experts, options, progress)
    kv, batch = _prefill_batch(config, [len(p) for p in prompts], dtype, ledger)
    model = MoEModel(config, weights, quantizer, kv, ledger)
    ids = ledger.tensor([t for p in prompts for t in p], torch.long)
    positions = ledger.tensor([j for p in prompts for j in range(len(p))], torch.long)
    model.forward(ids, positions, batch, ledger.tensor([ids.numel() - 1], torch.long))
    return QuantizedModel(quantizer.experts, quantizer.input_scales, tuple(quantizer.reports), ids.numel())


def _prefill_batch(config: ModelConfig, lengths: list[int], dtype: torch.dtype,
                   ledger: TransferLedger) -> tuple[PagedKVCache, AttentionBatch]:
    """Every prompt as a prefill segment from position 0. Such a segment attends only to its own
    keys unless the layer has a sliding window, so without windows all prompts share one block
    table (the cache is written, never read); with windows each gets its own blocks."""
    per_prompt = [-(-n // BLOCK) for n in lengths]
    windowed = any(w is not None for w in config.sliding_windows)
    firsts = [sum(per_prompt[:j]) for j in range(len(lengths))] if windowed else [0] * len(lengths)
    num_blocks = sum(per_prompt) if windowed else max(per_prompt)
    kv = PagedKVCache.for_model(config, num_blocks, BLOCK, dtype, ledger.device)
    slots: list[int] = []
    segments, row = [], 0
    for n, nb, first in zip(lengths, per_prompt, firsts):
        slots += range(first * BLOCK, first * BLOCK + n)  # blocks first.. are consecutive
        segments.append(PrefillSegment(row, n, 0, ledger.tensor(list(range(first, first + nb)), torch.long)))
        row += n
    return kv, AttentionBatch(slots=ledger.tensor(slots, torch.long), num_decode=0, prefills=segments)


def random_prompts(vocab_size: int, samples: int, length: int, seed: int,
                   exclude: Sequence[int] = ()) -> list[list[int]]:
    """Seeded uniform random token ids, never one of `exclude` (EOS, BOS): the calibration set of
    engines that quantize at start, since engines do not read workloads."""
    skip = set(exclude)
    allowed = torch.tensor([t for t in range(vocab_size) if t not in skip])
    g = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(len(allowed), (samples, length), generator=g)].tolist()

"""The simulator's per-step cost model: a step's duration from what it did (no torch).

A step is priced module by module as a roofline with efficiencies, as MoE-Lightning's
hierarchical roofline (arXiv 2411.11217) and moegen's plan (engines/moegen/cost.py) do: each
module takes max(bytes / (bandwidth x efficiency), FLOPs / (peak x efficiency)), where the
efficiencies are the hardware profile's curves (engines/sim/hardware.py) at the module's size.

- GEMMs: "gemm" and "grouped_gemm" are fractions of the GEMM's roofline bound (the profile's
  basis, engines/sim/hardware.py), so a GEMM reading W weight bytes for F FLOPs over r rows takes
  max(W / bandwidth, F / peak) / eff(r) (its activations' bytes are left out of W: a few
  percent at decode, nothing where it is compute-bound).
- Curves measured on the model's own shapes: a profile may carry `gemm@K`, `grouped_gemm@K`,
  `head@K`, `attention_decode@K`, `attention_prefill@K` and `attention_prefill_context@K` for K =
  `shape_key(shape)` (`pwbench hw calibrate --model DIR` measures the model's dense projections,
  one expert's gate_up + down and its LM head at 1-1024 rows, 16 sequences' decode attention over
  its cache layout at several contexts, and SDPA over its heads at 16-1024-token chunks, causal and
  after context); for that model they replace the generic curves of the same name (the LM head's,
  else "gemm"; a chunk after context's, else "attention_prefill"). A GEMM's efficiency
  depends on its (K, N), not only its rows: on this CPU a [1536, 512] expert matrix at 1-4 rows
  streams at ~6-10 GB/s where the square [1024, 1024] one the generic curve is measured on
  reaches ~16.
- Dense weights (`StepWork.dense_bytes_read`, the LM head split off) are read once per step,
  with FLOPs 2 x their parameters x the step's tokens (every dense weight is one multiply-add per
  token: projections, router, shared experts, dense MLPs), "gemm" over the step's tokens.
- LM head over `logit_rows` rows (a GEMM), plus greedy sampling reading the logits ("sample",
  optional, a fraction of memory_bytes_per_s over rows).
- Each expert that ran (`ExpertRun`): its stored bytes and 2 x 3 x D x I FLOPs per token routed
  to it, "grouped_gemm" over its rows; quantized (bits below the model dtype's) its bytes at
  "dequant_gemm_{b}" (nearest b) of the bandwidth instead: dequant kernels are bandwidth-bound
  at decode. On a shared processor the torch reference dequantizes to full width first, at
  "dequant_cpu_{scheme}" by bits (for RTN records "dequant_cpu_packed@K", measured on the model's
  own experts, where the profile has it), or, where measured, "dequant_group_{scheme}_{b}" by the
  full-width bytes of the experts of that width a layer dequantizes in one stacked call
  (pagedweight's planes; the step's runs of the width over its MoE layers), then a dense GEMM,
  plus the quantized expert's torch calls (OPS_PER_QUANTIZED_EXPERT_CPU) at the per-call price
  (none for RTN records priced on "dequant_cpu_packed@K": its timing holds them).
- Attention: decode reads each sequence's KV (context x kv_bytes_per_token) at
  "attention_decode" over its context (its FLOPs, 4 x heads x head_dim per key and layer, at
  "gemm" over the query heads sharing a KV read); prefill, 4 x heads x head_dim FLOPs per layer
  and query-key pair (`prefill_attention_pairs`: chunk^2 / 2 for a causal chunk from position 0;
  the whole chunk x (context + chunk) rectangle after context, as the runtime's masked SDPA computes
  it) at "attention_prefill" over the chunk ("attention_prefill_context" after context, where the
  profile has it), against reading the context's KV and writing the chunk's.
- This runtime's kernels as counts (facts about engines/runtime, shared with moegen's model):
  activations through the elementwise kernels ("elementwise" over the step's tokens) and a
  dispatch overhead per torch call (`profile.op_overhead_s`, part "dispatch"; the calls counted
  per layer, per decode attention group the runtime forms and per expert run: `torch_calls`) and
  per decode sequence and layer (`profile.decode_sequence_overhead_s`: the small kernels around
  the priced modules take longer as their rows grow), added to compute:
  on the cpu profile the same cores dispatch and compute, and on a device every MoE layer of this
  runtime waits for its routing counts on the host, so launches cannot run ahead of the device
  (measured on an H200: docs/simulation-validation.md). A profile of CUDA-graph serving has
  both 0.
  "elementwise" (optional) is a fraction of memory_bytes_per_s over the step's tokens.
- Copies: h2d and d2h bytes at link_pinned_bytes_per_s x "copy" over bytes per transfer; the two
  directions run at once (PCIe is full duplex). With `copies_overlap` the copies run beside
  compute at the "copy_overlap" share of their speed (over bytes per transfer), except one
  transfer (the step's first: nothing to run beside), which is waited for: the step takes
  first + max(compute, the rest); without, copies add.
  On a shared processor (the `cpu` profile: the "link" is a memcpy on the same cores, as in
  moegen's model) both directions and compute add up, always.
- An engine's parts beyond this runtime's path (`executor_overhead_s`, added by the simulated
  executor, not `step()`): per layer and per layer-token, by the engine's keys (`sim_overhead_keys`:
  pagedweight's bookkeeping per layer, offload's cache, moegen's layer-major loop).
- `step_overhead_s` once per step; `prefill_element_overhead_s` per prefill activation element
  (token x hidden), `prefill_segment_overhead_s` per prefill segment (one sequence's chunk) and
  `prefill_step_overhead_s` per step that prefills, each per layer (`prefill_overhead_s`): the model
  code's time beyond the priced modules that comes with a prefill (per-segment attention calls on
  views, cache writes; `pwbench hw calibrate` fits the three on the bundled model, and with
  `--model` on that model's own checkpoint, which a model of its shape then pays instead
  (`prefill_overhead_rates`); 0 in the GPU profiles).

`roofline_s` is the bytes the step must read (dense + experts that ran + KV attended, prefill
contexts included) at memory_bytes_per_s; every module's time is at least its bytes at that
rate (efficiencies are at most 1), so `seconds >= roofline_s`.

Differences from moegen's plan model by design: no micro-batches, rings or host attention (the
simulated engine's own control code decides placements, the step reports its copies); experts
priced one by one (uneven loads cost more than moegen's even split). Both count dense FLOPs from
every dense parameter.

Interpolation: the curves' points are read once and interpolated here in log(size), flat beyond
the points, as `Curve.at` does (a few lines duplicated from engines/moegen/cost.py's
`_log_interpolate`: engines/sim may not import engines.moegen). Memos by (tokens, bytes, bits)
and by context make `step()` one dict lookup per expert run and per decode sequence; an
executor may pass alike experts of a layer as one run with `count` (measured: ~0.1 ms for a
Mixtral-8x7B decode step, ~5-8 ms for 11,600 separate DeepSeek-V3 runs, ~0.7 ms aggregated, on
this loaded 2-core machine).

VERSION: bump when a formula, a default or a counted constant changes what `step()` returns for
the same profile, shape and StepWork (results of different versions are not comparable);
refactors that keep every number do not bump.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engines.runtime.shape import ModelShape

# Python-level torch calls (views, slices and attribute reads included) per layer of a step, by
# attention kind (ModelShape.attention), counted with a TorchFunctionMode over engine moe's decode
# steps (all layers; 8 per expert that runs taken off): a base per layer, plus per decode attention
# group (engines/runtime/attention.py: the decode sequences batched by similar KV block counts, each
# group its own calls: the CPU kernel's or a gather and SDPA) and 2 per prefill call group.
# Counted on the bundled model (GQA, 2 layers) and the Mixtral- and DeepSeek-V3-shaped bench models
# (8 layers; MLA, a dense first layer and a shared expert), 1-12 sequences:
# - one group (equal contexts): GQA 156-165 per layer (bundled), 140-158 (Mixtral-shaped), MLA 221-275;
# - each group more: GQA +33-36 per layer, MLA +62 (6 sequences of contexts 21-641 tokens: 6 groups,
#   2 x 341 + 8 x 7 calls on the bundled model against 2 x 162 + 8 x 6 in one group).
# The base is what one group leaves: GQA ~122 (bundled 128, Mixtral-shaped 121 at 6 sequences),
# MLA ~194. Before (cost model 6) every decode batch was one group at 180 (MLA 300) per layer: the
# bundled model's offline batch (6 prompts of 79-253 tokens: 5 groups) made ~270 calls more than
# counted. tests/integration/test_sim_op_counts.py counts real decode steps of each kind, in one
# group and in several, against `torch_calls`.
OPS_PER_LAYER = {"gqa": 122, "mla": 194}
OPS_PER_DECODE_GROUP = {"gqa": 34, "mla": 62}
OPS_PER_ATTENTION_GROUP = 2  # a prefill call group
OPS_PER_EXPERT = 8
# On a shared processor (the cpu profile) a quantized expert runs this runtime's torch reference
# (engines/quant/ops.py): it dequantizes both weights to the model dtype each call (written and
# read again: 2 x the full-width bytes through the elementwise kernels) in more torch calls,
# counted with a TorchFunctionMode per storage scheme. "packed" (static-*): a static-rtn decode
# step of 6 sequences makes 1,054 calls against engine moe's 394 over 8 expert runs on the demo
# model (82.5 each; bits 2, 4 and 8 alike) and 6,166 against 1,686 over 55 on the Mixtral-shaped
# one (81.5); 733 before engines/quant's unpack_bits became one broadcast shift. "bitplanes"
# (pagedweight): its Mixtral-shaped decode step makes 2,621 calls against moe's 1,686 with ~32 of
# its 56 expert runs below 16 bits (37 of 64 resident experts at 8 bits): at most ~29 each (its
# controller's calls are in the difference). On a GPU the fused Triton kernel runs instead (the
# profile's dequant_gemm curves).
OPS_PER_QUANTIZED_EXPERT_CPU = {"packed": 82, "bitplanes": 29}
_QUANTIZED_OPS = OPS_PER_QUANTIZED_EXPERT_CPU
# Activation elements the elementwise kernels read and write per layer, counted from
# engines/runtime/model.py and experts.py (duplicated from engines/moegen/cost.py ACT_*): per
# token 14 x hidden + 6 x (q + kv) + q; per expert assignment 6 x hidden + 5 x intermediate.
ACT_PER_TOKEN_HIDDEN, ACT_PER_TOKEN_QKV, ACT_PER_ASSIGNMENT_HIDDEN, ACT_PER_ASSIGNMENT_INTERMEDIATE = 14, 6, 6, 5

# Curves the model reads; an absent one is taken as efficiency 1.0 and said in assumptions().
CURVES = ("gemm", "grouped_gemm", "attention_decode", "attention_prefill", "elementwise", "sample", "copy",
          "copy_overlap")
# Curves a profile may carry for one model's shapes (`name@shape_key(shape)`, fitted by `pwbench hw
# calibrate --model`): the model reads them in place of the generic curve of the same name; "head"
# (the LM head's [vocab, hidden] GEMM, rows sampled) falls back to "gemm" where it has none;
# "dequant_cpu_packed" (the CPU reference's RTN dequantization of one expert) replaces the generic
# one of `CostModel.cpu_dequant`; "attention_prefill_context" (a prefill chunk after context: the
# runtime's masked SDPA over the whole rectangle) falls back to "attention_prefill".
# "grouped_gemm_dequantized" (an RTN expert's GEMMs right after the CPU reference dequantized it:
# its weights just written, in the caches; a fraction of the FLOP peak) prices those GEMMs where the
# profile has it, else they are priced as a resident expert's ("grouped_gemm").
SHAPED = ("gemm", "grouped_gemm", "head", "attention_decode", "attention_prefill", "attention_prefill_context",
          "dequant_cpu_packed", "grouped_gemm_dequantized")
# Optional curves that fall back to another where the profile has neither a shaped nor a generic one.
FALLBACK = {"head": "gemm", "attention_prefill_context": "attention_prefill"}


def shape_key(shape: ModelShape) -> str:
    """The key a profile's shape-measured curves are stored under for a model of `shape`: the
    dimensions its dense projections, experts and LM head are measured at, and the dtype's width."""
    return (f"d{shape.hidden}-h{shape.heads}-q{shape.q_size}-kv{shape.kv_size}-i{shape.intermediate}"
            f"-v{shape.vocab}-b{shape.dtype_bytes}")


def module_curves(efficiency: Mapping[str, Any], shape: ModelShape) -> tuple[dict[str, Any], dict[str, str]]:
    """Which of a profile's curves prices which module of a model of `shape`, by one rule for
    every executor that prices this runtime's GEMMs (this model, moegen's): the curve measured on
    the model's own shapes (`name@shape_key`) where the profile has it, else the generic one of
    the same name; those of FALLBACK (the LM head's "head", a chunk after context's
    "attention_prefill_context") fall back to the curve it names. Returns the chosen curves (those
    of CURVES the profile has, and FALLBACK's where they resolve) and the shaped names used."""
    key = shape_key(shape)
    shaped = {k: f"{k}@{key}" for k in SHAPED if f"{k}@{key}" in efficiency}
    chosen = {k: efficiency[shaped.get(k, k)] for k in CURVES if k in efficiency or k in shaped}
    for name, other in FALLBACK.items():
        curve = efficiency.get(shaped.get(name, name), chosen.get(other))
        if curve is not None:
            chosen[name] = curve
    return chosen, shaped


def prefill_attention_pairs(chunk: int, context: int) -> float:
    """Query-key pairs the runtime's prefill attention computes for a chunk of `chunk` tokens after
    `context` tokens: causal from position 0 (chunk^2 / 2); after context, the whole chunk x
    (context + chunk) rectangle (engines/runtime/attention.py: SDPA with `context_mask`; its
    masked upper corner is computed too)."""
    return chunk * (context + chunk) if context else chunk * chunk / 2


def torch_calls(shape: ModelShape, decode_groups: int, prefill: bool, expert_runs: int) -> int:
    """The torch calls this runtime makes in a step of `shape` with `decode_groups` decode attention
    groups, prefill segments or not, and `expert_runs` experts run (full width), by the counts above."""
    kind = shape.attention if shape.attention in OPS_PER_LAYER else "gqa"
    per_layer = (OPS_PER_LAYER[kind] + OPS_PER_DECODE_GROUP[kind] * decode_groups
                 + (OPS_PER_ATTENTION_GROUP if prefill else 0))
    return per_layer * shape.layers + OPS_PER_EXPERT * expert_runs


def prefill_overhead_rates(profile: Any, shape: ModelShape) -> tuple[float, float, float, str]:
    """The per-layer prefill rates (per activation element, per segment, per step) a model of
    `shape` pays, and where they come from: those `pwbench hw calibrate --model` fitted on a model
    of that shape (the profile's model_prefill_*_overhead_s tables at its `shape_key`) where the
    profile has them, else the profile's own (fitted on the bundled model), 0 where it has none."""
    key = shape_key(shape)
    tables = [getattr(profile, f"model_prefill_{k}_overhead_s", None) or {} for k in ("element", "segment", "step")]
    if any(key in t for t in tables):
        e, g, st = (float(t.get(key, 0.0)) for t in tables)
        return e, g, st, f"fitted on this model's own checkpoint (model_prefill_*_overhead_s[{key}])"
    e, g, st = (float(getattr(profile, f"prefill_{k}_overhead_s", 0.0) or 0.0) for k in ("element", "segment", "step"))
    return e, g, st, "the profile's prefill_*_overhead_s (fitted on the bundled model)"


def prefill_overhead_s(profile: Any, shape: ModelShape, tokens: int, segments: int,
                       rates: tuple[float, float, float, str] | None = None) -> float:
    """The model code's time a prefill of `tokens` tokens in `segments` segments takes beyond the
    priced modules, over the model's layers, by `prefill_overhead_rates` (or `rates`, what it
    returned for this profile and shape, as a step loop keeps them): per activation element
    (token x hidden: the elementwise kernels around the priced modules scale with it), per segment
    (each sequence's chunk attended in its own calls) and once (a step that prefills, whatever its size)."""
    if not tokens:
        return 0.0
    per_element, per_segment, per_step, _ = rates or prefill_overhead_rates(profile, shape)
    return shape.layers * (per_element * tokens * shape.hidden + per_segment * segments + per_step)


def executor_overhead_s(profile: Any, keys: tuple[str, ...], layers: int, tokens: int) -> float:
    """The host time an engine's parts take per step beyond this runtime's priced modules and counted
    calls, over the model's layers: for each of `keys` (the engine's `sim_overhead_keys`) the
    profile's `executor_overhead_s[key]` per layer and `executor_token_overhead_s[key]` per layer
    and token of the step (0 where it has none: the shipped GPU
    profiles, which price CUDA-graph serving: no host Python per layer). `pwbench hw calibrate` fits
    both on the bundled model, stepping each engine beside engine moe."""
    if not keys or not tokens:
        return 0.0
    per_layer = getattr(profile, "executor_overhead_s", None) or {}
    per_token = getattr(profile, "executor_token_overhead_s", None) or {}
    return layers * sum(float(per_layer.get(k, 0.0)) + float(per_token.get(k, 0.0)) * tokens for k in keys)


def gemm_s(weight_bytes: float, flops: float, bw: float, peak: float, efficiency: float) -> float:
    """A GEMM's seconds: its roofline bound (weights at `bw`, FLOPs at `peak`) over its curve's
    efficiency at its rows (the "gemm"/"grouped_gemm"/"head" curves are fractions of that bound)."""
    return max(weight_bytes / bw, flops / peak) / efficiency
_MEMO_LIMIT = 1 << 16


@dataclass(frozen=True, slots=True)
class ExpertRun:
    """An expert that ran this step, as stored: `tokens` routed to it, `nbytes` read, `bits` per
    weight; `count` (added to the design's fields): this many experts of the layer ran alike, so
    an executor may aggregate a large model's runs (cost is the same as `count` separate runs)."""

    layer: int
    tokens: int
    nbytes: int
    bits: float
    count: int = 1
    # How a quantized expert is stored, for the CPU reference's dequantization cost (cpu profile):
    # "packed" (RTN/GPTQ/AWQ records, engines/quant) or "bitplanes" (pagedweight's planes).
    scheme: str = "packed"


@dataclass(slots=True)  # not frozen: built every simulated step, and a frozen __init__ is ~2x slower
class StepWork:
    prefill: tuple[tuple[int, int], ...] = ()  # (chunk tokens, tokens already in context before it) per chunk
    decode_contexts: tuple[int, ...] = ()  # context per decode sequence (tokens attended incl. the new one)
    experts: tuple[ExpertRun, ...] = ()
    dense_bytes_read: int = 0  # dense weights the step reads (LM head included)
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_transfers: int = 0
    d2h_transfers: int = 0
    copies_overlap: bool = False  # copies run beside compute (prefetch/streaming) or are waited for
    kv_bytes_per_token: int = 0  # all layers
    logit_rows: int = 0
    # decode attention groups the runtime forms (engines/runtime/attention.py group_by_length over the
    # sequences' KV blocks); None: one where the step decodes
    decode_groups: int | None = None


@dataclass(slots=True)
class StepCost:
    seconds: float
    # Seconds per part; every part but "link_busy" (the copies' whole time, hidden or not) sums
    # to `seconds`: dense, head, experts, attention, activations, dispatch, overhead, copies
    # (the copy time not hidden under compute).
    parts: dict[str, float] = field(default_factory=dict)
    roofline_s: float = 0.0  # bytes the step must read / memory_bytes_per_s (never above seconds)


class _Interp:
    """A curve's (size, efficiency) points, interpolated linearly in log(size), flat beyond."""

    __slots__ = ("xs", "logs", "ys", "flat")

    def __init__(self, points: Any) -> None:
        pts = sorted((float(x), float(y)) for x, y in points)
        if not pts:
            pts = [(1.0, 1.0)]
        self.xs = [x for x, _ in pts]
        self.logs = [math.log(x) for x in self.xs]
        self.ys = [y for _, y in pts]
        self.flat = len(set(self.ys)) == 1

    def at(self, x: float) -> float:
        ys = self.ys
        if self.flat or x <= self.xs[0]:
            return ys[0]
        i = bisect_right(self.xs, x)
        if i >= len(ys):
            return ys[-1]
        lo, hi = self.logs[i - 1], self.logs[i]
        return ys[i - 1] + (math.log(x) - lo) / (hi - lo) * (ys[i] - ys[i - 1])


class _Memo(dict):
    """A dict that computes a missing value with `fn` and keeps it."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn
        self.kv_bytes_per_token = 0

    def __missing__(self, key: Any) -> float:
        value = self[key] = self.fn(key)
        return value


def _bits_key(efficiency: dict[str, Any], bits: float) -> str | None:
    """The dequant_gemm_{b} curve nearest `bits` (ties to the wider), None if the profile has none."""
    widths = sorted(int(k.rsplit("_", 1)[1]) for k in efficiency
                    if k.startswith("dequant_gemm_") and k.rsplit("_", 1)[1].isdigit())
    if not widths:
        return None
    return f"dequant_gemm_{min(widths, key=lambda b: (abs(b - bits), -b))}"


class CostModel:
    # 2: the cpu profile prices quantized experts as the torch reference runs them; 3: that
    # reference's dequantization at its measured rate per storage scheme (dequant_cpu_* curves);
    # 4: curves measured on the model's own shapes (`gemm@key`, `grouped_gemm@key`, `head@key`,
    # `attention_prefill@key`) replace the generic ones; the LM head reads a "head" curve where there is one;
    # a quantized expert's torch calls on the CPU counted again, per storage scheme (82 / 29, were 733);
    # 5: torch calls per layer by attention kind (MLA 300, was 180 like every other); a quantized expert's
    # CPU dequantization by the experts of its width a layer dequantizes at once (dequant_group_* curves);
    # 6: the profile's per-layer prefill overheads per token and per segment (`prefill_overhead_s`)
    # 7: torch calls per decode attention group the runtime forms (StepWork.decode_groups: 34 a GQA
    # layer, 62 MLA), the base per layer counted again without them (122 / 194, were 180 / 300)
    # 8: the profile's time per decode sequence and layer (`decode_sequence_overhead_s`), part "dispatch"
    # 9: the CPU reference's RTN dequantization measured on the model's own experts where the profile
    # has it (`dequant_cpu_packed@key`: the data's time, its calls priced with the expert's own)
    # 10: a prefill chunk after context computes the whole chunk x (context + chunk) rectangle (the
    # runtime's masked SDPA; was chunk x (context + chunk / 2)), at `attention_prefill_context` where
    # the profile has it (measured on the model's heads by `pwbench hw calibrate --model`); the profile's
    # per-layer prefill_step_overhead_s in a step that prefills (fitted with the other two); decode
    # attention at `attention_decode@key` where the profile has it (the model's own cache layout and
    # path: MLA's gather and expansion read its latent cache several times over)
    # 11: the prefill rates fitted on the model's own checkpoint where the profile has them
    # (`prefill_overhead_rates`: the model_prefill_*_overhead_s tables at its shape key)
    # 12: an RTN ("packed") expert's GEMMs on the CPU reference at `grouped_gemm_dequantized` where the
    # profile has it (timed right after the dequantization, as that reference runs them: weights in the
    # caches; a static-rtn Mixtral-shaped decode step of 6-12 sequences came out 13-17% high without it)
    # 13: `dequant_cpu_packed@key` keeps its timing's torch calls (the indexing and dequantization it times
    # make all of a packed expert's 82), and a packed run priced on it pays no call again (`_quantized_calls`;
    # 12 took 64 out at the tight loop's price and priced 82 at the runtime's: ~10% of a DeepSeek-V3-shaped
    # expert's dequantization more than it takes in a running engine)
    VERSION: ClassVar[str] = "13"

    def __init__(self, profile: Any, shape: ModelShape, dtype: str) -> None:
        if dtype not in profile.flops_per_s:
            raise ValueError(f"hardware profile {profile.name!r} has no FLOP rate for dtype {dtype!r} "
                             f"(flops_per_s has {sorted(profile.flops_per_s)}); add it or pick one of those")
        self.profile, self.shape, self.dtype = profile, shape, dtype
        self.prefill_rates = prefill_overhead_rates(profile, shape)  # fixed for the model: looked up once
        self.bw = float(profile.memory_bytes_per_s)
        self.peak = float(profile.flops_per_s[dtype])
        self.link = float(profile.link_pinned_bytes_per_s)
        self.op_overhead_s = float(getattr(profile, "op_overhead_s", 0.0) or 0.0)
        self.decode_sequence_s = float(getattr(profile, "decode_sequence_overhead_s", 0.0) or 0.0)
        self.shared = profile.shared
        eff = profile.efficiency
        # This model's shape-measured curves, where the profile has them, in place of the generic ones.
        self.shape_key = shape_key(shape)
        chosen, self.shaped = module_curves(eff, shape)
        self.missing = [k for k in CURVES if k not in chosen]
        self.curves = {k: _Interp(chosen[k].points if k in chosen else ()) for k in CURVES}
        for name, other in FALLBACK.items():
            self.curves[name] = _Interp(chosen[name].points) if name in chosen else self.curves[other]
        hot = self.shaped.get("grouped_gemm_dequantized", "grouped_gemm_dequantized")
        self.dequantized_gemm = _Interp(eff[hot].points) if hot in eff else None  # of the FLOP peak
        # Each quantized scheme's torch calls per run priced at op_overhead_s: none for RTN records where
        # the profile has their dequantization measured on this model's experts (that timing holds them all).
        self.quantized_calls = {k: 0 if k == "packed" and "dequant_cpu_packed" in self.shaped else v
                                for k, v in _QUANTIZED_OPS.items()}
        self.dequant = {k: _Interp(c.points) for k, c in eff.items() if k.startswith("dequant_gemm_")}
        # The CPU reference's dequantization by bit width, per storage scheme (measured by `pwbench hw`).
        # (the RTN one measured on this model's own experts where the profile has it: `module_curves`)
        self.cpu_dequant = {k[len("dequant_cpu_"):]: _Interp(eff[self.shaped.get(k, k)].points)
                            for k in {*eff, *self.shaped} if k.startswith("dequant_cpu_") and "@" not in k}
        # ... and by the full-width bytes of the experts of one width a layer dequantizes in one stacked
        # call (pagedweight's bit planes: slower per byte as the group's temporaries leave the caches).
        self.group_dequant: dict[str, dict[int, _Interp]] = {}
        for k, c in eff.items():
            scheme, _, b = k[len("dequant_group_"):].rpartition("_")
            if k.startswith("dequant_group_") and scheme and b.isdigit():
                self.group_dequant.setdefault(scheme, {})[int(b)] = _Interp(c.points)
        s = shape
        self.dtype_bits = 8 * s.dtype_bytes
        self.head_params = s.head_bytes / s.dtype_bytes
        self.layer_params = s.layer_dense_bytes / s.dtype_bytes
        kv_heads = s.kv_size / s.head_dim if s.head_dim else 1.0
        # Query heads sharing one KV read (GQA group; MLA: every head reads the one latent).
        self.query_group = max(1.0, s.heads / max(1.0, kv_heads))
        self.attn_flops_per_key = 4 * s.heads * s.head_dim * s.layers  # scores and values, all layers
        self.act_per_token = (ACT_PER_TOKEN_HIDDEN * s.hidden + ACT_PER_TOKEN_QKV * (s.q_size + s.kv_size)
                              + s.q_size) * s.dtype_bytes * s.layers
        self.act_per_assignment = (ACT_PER_ASSIGNMENT_HIDDEN * s.hidden
                                   + ACT_PER_ASSIGNMENT_INTERMEDIATE * s.intermediate) * s.dtype_bytes
        self._expert_memo = _Memo(lambda key: self._expert_s(*key))
        self._decode_memo = _Memo(lambda ctx: self._decode_s(ctx, self._decode_memo.kv_bytes_per_token))

    # -- modules --------------------------------------------------------------------------
    def _expert_s(self, tokens: int, nbytes: int, bits: float, scheme: str = "packed", group: float = 1.0) -> float:
        c = self.curves
        flops = self.shape.expert_flops_per_token * tokens
        eff = c["grouped_gemm"].at(tokens)
        if bits < self.dtype_bits and self.shared:  # the CPU reference: dequantize, then a dense GEMM
            full = self.shape.expert_bytes  # (never below reading its stored bytes: the roofline)
            if scheme == "packed" and self.dequantized_gemm is not None:
                # each expert dequantized right before its GEMMs: its weights in the caches, the FLOP peak's
                # share alone (pagedweight's planes: a layer's group at once, out of the caches by its GEMMs)
                compute = flops / (self.peak * self.dequantized_gemm.at(tokens))
            else:
                compute = gemm_s(full, flops, self.bw, self.peak, eff)
            return max(nbytes / self.bw, self._cpu_dequant_s(tokens, bits, scheme, group) + compute)
        if bits < self.dtype_bits and self.dequant:
            bw_eff = self.dequant[_bits_key(self.profile.efficiency, bits)].at(tokens)
        else:
            bw_eff = eff
        return max(nbytes / (self.bw * bw_eff), flops / (self.peak * eff))

    def _cpu_dequant_s(self, tokens: int, bits: float, scheme: str, group: float) -> float:
        """The torch reference dequantizing one expert at `bits` to full width (shared processor)."""
        full = self.shape.expert_bytes
        by_group = self.group_dequant.get(scheme)
        if by_group:  # dequantized with `group` - 1 others of its width in one stacked call
            width = min(by_group, key=lambda b: (abs(b - bits), -b))
            return full / (self.bw * by_group[width].at(group * full))
        measured = self.cpu_dequant.get(scheme)
        if measured is not None:  # the full-width weights written once, at the measured efficiency
            return full / (self.bw * measured.at(bits))
        return 2 * full / (self.bw * self.curves["elementwise"].at(tokens))

    def _quantized_calls(self, scheme: str) -> int:
        """Torch calls a quantized expert run of `scheme` makes beyond a full-width one's on the CPU
        reference, priced at op_overhead_s (`self.quantized_calls`, a scheme not counted as packed)."""
        return self.quantized_calls.get(scheme, self.quantized_calls["packed"])

    def cpu_dequantization(self, runs: tuple[ExpertRun, ...]) -> tuple[float, int]:
        """(seconds, torch calls) of the CPU reference's dequantization of `runs`' quantized
        experts to full width, as `step` prices it, for an executor that prices the rest of the
        step itself (engine full's layer-major step on the cpu profile); (0, 0) off a shared processor."""
        if not self.shared:
            return 0.0, 0
        groups = self._dequant_groups(runs)
        seconds, calls = 0.0, 0
        for r in runs:
            if r.bits < self.dtype_bits:
                group = groups.get((r.scheme, r.nbytes), 1.0)
                seconds += self._cpu_dequant_s(r.tokens, r.bits, r.scheme, group) * r.count
                calls += self._quantized_calls(r.scheme) * r.count
        return seconds, calls

    def _decode_s(self, context: int, kv_bytes_per_token: int) -> float:
        nbytes = context * kv_bytes_per_token
        flops = self.attn_flops_per_key * context
        return max(nbytes / (self.bw * self.curves["attention_decode"].at(context)),
                   flops / (self.peak * self.curves["gemm"].at(self.query_group)))

    def _dequant_groups(self, runs: tuple[ExpertRun, ...]) -> dict[tuple[str, int], float]:
        """Quantized experts a layer dequantizes together, per (scheme, stored bytes: one width):
        the step's runs of that width over its MoE layers (every MoE layer runs each step; the
        runs come aggregated over layers), at least 1."""
        total: dict[tuple[str, int], int] = {}
        for r in runs:
            if r.bits < self.dtype_bits:
                total[(r.scheme, r.nbytes)] = total.get((r.scheme, r.nbytes), 0) + r.count
        layers = max(1, self.shape.moe_layers)
        return {k: max(1.0, round(n / layers, 2)) for k, n in total.items()}

    def step(self, work: StepWork) -> StepCost:
        s, c, bw, peak = self.shape, self.curves, self.bw, self.peak
        decode = len(work.decode_contexts)
        prefill_tokens = sum(n for n, _ in work.prefill)
        T = decode + prefill_tokens
        kvb = work.kv_bytes_per_token
        read = float(work.dense_bytes_read)
        dense = head = experts = attention = activations = dispatch = 0.0
        if T:
            # Dense layers and the LM head (split off what the step reports).
            head_bytes = min(s.head_bytes, work.dense_bytes_read)
            layer_bytes = work.dense_bytes_read - head_bytes
            dense = gemm_s(layer_bytes, 2 * T * self.layer_params * s.layers, bw, peak, c["gemm"].at(T))
            rows = work.logit_rows
            if rows:
                head = gemm_s(head_bytes, 2 * rows * self.head_params, bw, peak, c["head"].at(rows))
                head += rows * s.vocab * s.dtype_bytes / (bw * c["sample"].at(rows))
            else:  # no row sampled: the head is not run, but the step reports its bytes read
                head = head_bytes / bw / c["head"].at(1)
            # Experts, memoised by (tokens, bytes, bits): their cost does not depend on the layer.
            memo = self._expert_memo
            if len(memo) > _MEMO_LIMIT:
                memo.clear()
            get = memo.__getitem__
            assignments = n_runs = quantized_ops = 0
            groups = self._dequant_groups(work.experts) if self.group_dequant and self.shared else {}
            for r in work.experts:
                n, t = r.count, r.tokens
                experts += get((t, r.nbytes, r.bits, r.scheme, groups.get((r.scheme, r.nbytes), 1.0))) * n
                assignments += t * n
                read += r.nbytes * n
                n_runs += n
                if r.bits < self.dtype_bits:
                    quantized_ops += self._quantized_calls(r.scheme) * n
            # Attention.
            dmemo = self._decode_memo
            if dmemo.kv_bytes_per_token != kvb or len(dmemo) > _MEMO_LIMIT:
                dmemo.clear()
                dmemo.kv_bytes_per_token = kvb
            attention = sum(map(dmemo.__getitem__, work.decode_contexts))
            read += sum(work.decode_contexts) * kvb
            for chunk, ctx in work.prefill:
                if chunk <= 0:
                    continue
                flops = self.attn_flops_per_key * prefill_attention_pairs(chunk, ctx)
                curve = c["attention_prefill_context" if ctx else "attention_prefill"]
                attention += max((ctx + chunk) * kvb / bw, flops / (peak * curve.at(chunk)))
                read += ctx * kvb
            # This runtime's elementwise kernels and per-call dispatch.
            ew = bw * c["elementwise"].at(T)
            activations = (T * self.act_per_token + assignments * self.act_per_assignment) / ew
            if self.op_overhead_s:
                decode_groups = (1 if decode else 0) if work.decode_groups is None else work.decode_groups
                dispatch = self.op_overhead_s * (torch_calls(s, decode_groups, bool(prefill_tokens), n_runs)
                                                 + (quantized_ops if self.shared else 0))
            dispatch += self.decode_sequence_s * s.layers * decode
        else:
            read = 0.0  # no token computed: nothing read
        compute = dense + head + experts + attention + activations
        # The host's launches and the device's work add, on a device too: every MoE layer of this
        # runtime waits for its routing counts on the host (engines/runtime/model.py `_moe`), so the
        # host cannot launch ahead of the device (docs/simulation-validation.md, the H200 run).
        compute += dispatch
        # Copies.
        h2d = d2h = 0.0
        if work.h2d_bytes:
            h2d = work.h2d_bytes / (self.link * c["copy"].at(work.h2d_bytes / max(1, work.h2d_transfers)))
        if work.d2h_bytes:
            d2h = work.d2h_bytes / (self.link * c["copy"].at(work.d2h_bytes / max(1, work.d2h_transfers)))
        if self.shared:
            busy = h2d + d2h
            exposed = busy
        else:
            busy = max(h2d, d2h)
            exposed = busy
            if work.copies_overlap and busy:
                transfers = max(1, work.h2d_transfers + work.d2h_transfers)
                first = busy / transfers  # the step's first copy has nothing to run beside
                rest = (busy - first) / c["copy_overlap"].at((work.h2d_bytes + work.d2h_bytes) / transfers)
                busy = first + rest
                exposed = first + max(0.0, rest - compute)
        overhead = float(self.profile.step_overhead_s) if (T or busy) else 0.0
        if prefill_tokens:
            overhead += prefill_overhead_s(self.profile, s, prefill_tokens,
                                           sum(1 for n, _ in work.prefill if n > 0), self.prefill_rates)
        seconds = compute + exposed + overhead
        parts = {"dense": dense, "head": head, "experts": experts, "attention": attention,
                 "activations": activations, "dispatch": dispatch, "overhead": overhead, "copies": exposed,
                 "link_busy": busy}
        return StepCost(seconds, parts, read / bw)

    def _quantized_note(self) -> str:
        calls = ", ".join(f"{k} {v}" for k, v in OPS_PER_QUANTIZED_EXPERT_CPU.items())
        old = f"2 x full-width bytes at the elementwise rate, more torch calls per expert run ({calls})"
        if not self.cpu_dequant:
            return f"shared processor: the torch reference dequantizes each call ({old}), then a dense GEMM"
        grouped = (f"; {', '.join(sorted(self.group_dequant))}: by the experts of one width a layer dequantizes in "
                   f"one stacked call (dequant_group_* curves)") if self.group_dequant else ""
        own = (" (packed: measured on this model's experts, its torch calls included: none priced again)"
               if "dequant_cpu_packed" in self.shaped else "")
        hot = ("; packed experts' GEMMs at grouped_gemm_dequantized of the FLOP peak (timed right after the "
               "dequantization: weights in the caches)") if self.dequantized_gemm is not None else ""
        return (f"shared processor: the torch reference dequantizes each call, then a dense GEMM: the full-width "
                f"weights at the measured dequant_cpu_{{{', '.join(sorted(self.cpu_dequant))}}} efficiency by bit "
                f"width{own}{grouped}{hot}, and its torch calls per expert run ({calls}) "
                f"(a scheme not measured: {old})")

    def assumptions(self) -> dict[str, Any]:
        """Every number the model uses and where it comes from, for the result folder."""
        p = self.profile
        eff = p.efficiency
        curves = {k: {"points": [list(pt) for pt in eff[k].points], "source": eff[k].source}
                  for k in sorted(eff) if "@" not in k or k in self.shaped.values()}
        for k in self.missing:
            curves[k] = {"points": [[1.0, 1.0]], "source": "not in the profile: efficiency 1.0 assumed"}
        sources = dict(getattr(p, "sources", {}) or {})
        return {
            "cost_model": "engines/sim/cost.py", "version": self.VERSION,
            "profile": p.name, "description": getattr(p, "description", ""), "dtype": self.dtype,
            "memory_bytes_per_s": self.bw, "flops_per_s": self.peak, "link_pinned_bytes_per_s": self.link,
            "step_overhead_s": float(p.step_overhead_s),
            **dict(zip(("prefill_element_overhead_s", "prefill_segment_overhead_s", "prefill_step_overhead_s",
                        "prefill_overhead_source"), self.prefill_rates)),
            "op_overhead_s": self.op_overhead_s,
            "decode_sequence_overhead_s": self.decode_sequence_s,
            "op_overhead_source": sources.get("op_overhead_s", "the profile's op_overhead_s") if self.op_overhead_s
            else "profile has no op_overhead_s: per-call dispatch not counted (launches in step_overhead_s)",
            "quantized_experts": self._quantized_note() if self.shared
            else "dequant_gemm_{b} curves of the profile" if self.dequant
            else "profile has no dequant_gemm curve: quantized experts priced as full-width GEMMs",
            "shared_processor": self.shared,
            "shared_processor_rule": "copies are memcpys on the compute cores: they add, never overlap" if self.shared
            else "h2d and d2h run at once (full duplex); with copies_overlap one transfer is waited for and the "
                 "rest runs beside compute at copy_overlap x its speed: first + max(compute, rest)",
            "efficiency": curves, "sources": sources,
            "shape_key": self.shape_key,
            "shaped_curves": {k: v for k, v in self.shaped.items()} or
            f"none: the profile has no curve measured on this model's shapes (`pwbench hw calibrate --model` fits "
            f"them, keyed @{self.shape_key}); the generic ones are used",
            "counts": {"ops_per_layer": OPS_PER_LAYER.get(self.shape.attention, OPS_PER_LAYER["gqa"]),
                       "ops_per_decode_group": OPS_PER_DECODE_GROUP.get(self.shape.attention,
                                                                        OPS_PER_DECODE_GROUP["gqa"]),
                       "attention": self.shape.attention, "ops_per_prefill_group": OPS_PER_ATTENTION_GROUP,
                       "ops_per_expert": OPS_PER_EXPERT,
                       "source": "torch calls counted over this runtime's decode steps (engines/sim/cost.py "
                                 "OPS_PER_LAYER and OPS_PER_DECODE_GROUP, by attention kind)",
                       "activation_elements_per_token": "14 hidden + 6 (q + kv) + q per layer",
                       "activation_elements_per_assignment": "6 hidden + 5 intermediate",
                       "activation_source": "engines/runtime/model.py and experts.py, counted"},
            "formulas": {
                "module": "max(bytes / (memory_bytes_per_s x eff), FLOPs / (flops_per_s x eff))",
                "gemm": "max(weight bytes / memory_bytes_per_s, FLOPs / flops_per_s) / eff(rows) (eff: a "
                        "fraction of the roofline bound)",
                "dense": "dense_bytes_read less the LM head, 2 x dense params x T FLOPs, gemm(T)",
                "head": "LM head bytes, 2 x logit_rows x (hidden + 1) x vocab FLOPs, head(rows) (else gemm); "
                        "argmax reads the logits at sample(rows) x memory_bytes_per_s",
                "experts": "per expert that ran: nbytes and 6 x hidden x intermediate x tokens FLOPs at "
                           "grouped_gemm(rows); bits < the dtype's: nbytes at dequant_gemm_{nearest bits}(rows) "
                           "x memory_bytes_per_s",
                "activations": "elements counted per token and per assignment x dtype bytes at elementwise(T) "
                               "x memory_bytes_per_s",
                "dispatch": "op_overhead_s x (122, MLA 194, + 34, MLA 62, per decode attention group + 2 with "
                            "prefill) per layer + 8 per expert that ran, + decode_sequence_overhead_s x layers x "
                            "decode sequences; "
                            "added on a shared processor, else only what exceeds the device's compute",
                "decode_attention": "context x kv_bytes_per_token at attention_decode(context); 4 x heads x "
                                    "head_dim x context x layers FLOPs at gemm(query heads per KV head)",
                "prefill_attention": "4 x heads x head_dim x layers FLOPs per query-key pair: chunk^2 / 2 "
                                     "pairs at attention_prefill(chunk) for a chunk from position 0, chunk x "
                                     "(context + chunk) (the masked rectangle) at attention_prefill_context(chunk) "
                                     "(else attention_prefill) after context; (context + chunk) x "
                                     "kv_bytes_per_token at the bandwidth",
                "copies": "bytes / (link_pinned_bytes_per_s x copy(bytes per transfer))",
                "overhead": "step_overhead_s per step + layers x (prefill_element_overhead_s x prefill tokens x "
                            "hidden + prefill_segment_overhead_s x prefill segments + prefill_step_overhead_s "
                            "in a step that prefills)",
                "roofline": "(dense_bytes_read + experts' nbytes + KV attended) / memory_bytes_per_s",
            },
            "left_out": "the scheduler's Python per sequence; kernel fusion beyond this runtime's; MLA "
                        "attention FLOPs are those of the absorbed shape (engines/runtime/shape.py)",
        }

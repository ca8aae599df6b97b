"""The `cpu` profile's efficiency curves from `pwbench hw`'s measurements of this machine.

Efficiency = measured rate / the peak it is a fraction of (the curve's basis, as
engines/sim/hardware.py defines them), at each size measured; nothing is fitted to an engine.
The peaks are `pwbench hw`'s own (`cpu_rates`): memory_bandwidth_bytes_per_s (a large copy,
read + write) and matmul_flops_per_s (a 1024^3 float32 matmul). What each measurement is
(shapes, sizes) is harness/hw.py's `measure`:

    gemm, grouped_gemm  matmul_flops_at_rows[r] / the roofline bound of that matmul: [r, n] x [n, n]
                        float32 (n: the largest row count listed, whose rate is the peak), bound
                        min(peak, FLOPs / bytes x bandwidth), bytes 4 x (n^2 + 2 r n); the runtime
                        runs each expert as its own matmul, so grouped_gemm is the same curve
    attention_decode    decode_attention_bytes_per_s / bandwidth, at the context measured (64)
    attention_prefill   prefill_attention_flops_per_s / peak, at the chunk measured (128)
    elementwise         elementwise_bytes_per_s_at_tokens[t] / bandwidth (else
                        elementwise_bytes_per_s at 256 tokens)
    sample              argmax_bytes_per_s / bandwidth, at the rows measured (256)
    copy                1.0 at every size: on a CPU the "link" is a memcpy, whose rate
                        link_pinned_bytes_per_s = bandwidth / 2 already is (it reads and writes)
    dequant_cpu_<s>     dequant_full_bytes_per_s_by_bits[s][bits] / bandwidth, by bit width: the torch
                        reference dequantizing an expert's matrices (s = packed: RTN records;
                        bitplanes: pagedweight's planes), full-width bytes written per second
    dequant_group_<s>_<b> dequant_group_bytes_per_s[s][b][n] / bandwidth, by n: the full-width bytes
                        of experts at b bits dequantized in one stacked call, as pagedweight's CPU
                        path runs a layer's experts of one width (s = bitplanes)

    gemm@K, grouped_gemm@K, head@K   one model's shapes (`pwbench hw calibrate --model DIR`,
                        measurements["model_gemm"][K], K = engines/sim/cost.py `shape_key`): the
                        seconds of its dense projections (q, k, v, o of one layer; MLA: q_a, q_b,
                        kv_a, o, its own low-rank chain), of one expert
                        (gate_up then down) and of its LM head at each row count, as the runtime
                        calls them (harness/bench/cpu_ops.py `model_gemm_seconds`), against the
                        roofline bound of those matrices: max(bytes / bandwidth, FLOPs / peak)
    attention_prefill@K the same entry's attention over one chunk of n tokens from position 0 as
                        the runtime runs it (paged_attention: causal SDPA over the chunk's own
                        keys; GQA's heads, or MLA's absorbed form), at each n: the cost model's
                        FLOPs for it (4 x heads x head_dim x n x n / 2) / peak / seconds
    attention_prefill_context@K  the same after n tokens of context: the 2n keys gathered from a
                        paged cache, the runtime's mask over the [n, 2n] rectangle:
                        4 x heads x head_dim x n x 2n FLOPs / peak / seconds
    attention_decode@K  the same entry's decode attention of 16 sequences as the runtime runs it
                        for that model's cache (GQA: the C kernel in place; MLA: gather, expand,
                        SDPA) at several contexts: the cache's bytes per token and layer over the
                        time per context token (the slope) / bandwidth
    dequant_cpu_packed@K the same entry's dequantization of one expert (both matrices, RTN records
                        of the static engines' group size for its widths) at each bit width, as
                        the torch reference runs it, its torch calls included: full-width bytes /
                        seconds / bandwidth

The FLOP peak is the best float32 GEMM rate measured in the session (`best_flops`): the 1024^3
matmul, the square curve's row counts and the model shapes' (one core's rate moves 10-30% between
shapes and minutes; a peak below a measured rate would clip that curve at 1 and price the GEMM
slower than it ran). Every curve is a fraction of that one peak, so a module's time is its
measured rate either way. A ratio above 1 (a cache-resident kernel beating the copy bandwidth)
is clipped to 1 and the curve's source says so; a measurement that is absent leaves its curve out (the cost model then
states its default). `copy_overlap` is not fitted: on one processor copies never overlap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from statistics import median
from typing import Any

# Sizes harness/hw.py's measure() uses for the single-size measurements.
DECODE_ATTENTION_CONTEXT = 64
PREFILL_ATTENTION_CHUNK = 128
ARGMAX_ROWS = 256
ELEMENTWISE_TOKENS = 256


def _rate(m: Mapping[str, Any], key: str) -> float:
    value = m.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and value != float("inf")
    if not ok:
        raise ValueError(f"pwbench hw measurements: {key!r} is {value!r}, not a positive number; "
                         "rerun `pwbench hw --device cpu`")
    return float(value)


def _model_rates(entry: Mapping[str, Any]) -> list[float]:
    """FLOP/s of every (part, rows) one model's shape measurement timed."""
    out = []
    for part, per_row in (entry.get("seconds") or {}).items():
        params = float((entry.get("params") or {}).get(part, 0))
        for rows, seconds in per_row.items():
            if params > 0 and isinstance(seconds, (int, float)) and seconds > 0:
                out.append(2 * int(rows) * params / seconds)
    return out


def best_flops(m: Mapping[str, Any]) -> tuple[float, str]:
    """The FLOP peak the curves are fractions of: the best float32 GEMM rate measured (the
    1024^3 matmul, matmul_flops_at_rows, every model shape's); (rate, where it was measured)."""
    peak, where = _rate(m, "matmul_flops_per_s"), "matmul_flops_per_s (1024^3 float32 matmul)"
    for rows, value in (m.get("matmul_flops_at_rows") or {}).items():
        if isinstance(value, (int, float)) and value > peak:
            peak, where = float(value), f"matmul_flops_at_rows[{rows}] ([{rows}, 1024] x [1024, 1024])"
    for key, entry in sorted((m.get("model_gemm") or {}).items()):
        for rate in _model_rates(entry):
            if rate > peak:
                peak, where = rate, f"model_gemm[{key}] (a GEMM of that model's shapes)"
    return peak, where


def cpu_rates(measurements: Mapping[str, Any]) -> dict[str, Any]:
    """The peaks `fit_cpu_curves`' efficiencies are fractions of, as profile fields."""
    bw = _rate(measurements, "memory_bandwidth_bytes_per_s")
    out: dict[str, Any] = {"memory_bytes_per_s": bw,
                           "flops_per_s": {"float32": best_flops(measurements)[0]},
                           "link_pinned_bytes_per_s": bw / 2}
    if measurements.get("op_overhead_s") is not None:
        out["op_overhead_s"] = _rate(measurements, "op_overhead_s")
    return out


def _curve(points: list[tuple[float, float]], source: str) -> dict[str, Any]:
    clipped = [f"{size:g}: {eff:.3g}" for size, eff in points if eff > 1]
    if clipped:
        source += f" (clipped to 1 from {', '.join(clipped)})"
    return {"points": [[size, min(1.0, eff)] for size, eff in sorted(points)], "source": source}


def fit_cpu_curves(measurements: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """`pwbench hw`'s measurement dict (harness/hw.py `measure`, one device's entry of its cache)
    -> {curve key: {"points": [[size, efficiency], ...], "source": str}}, the form a profile's
    `efficiency` table takes (engines/sim/hardware.py `Curve(points, source)`). ValueError with
    one line when a rate is missing or not positive."""
    m = measurements
    bw, peak = _rate(m, "memory_bandwidth_bytes_per_s"), best_flops(m)[0]
    src = f"pwbench hw --device cpu, measured at {m.get('measured_at', '?')}"
    out: dict[str, dict[str, Any]] = {}
    rows = m.get("matmul_flops_at_rows") or {}
    if rows:
        at = {int(r): _rate(rows, r) for r in rows}
        n = max(at)
        pts = []
        for r, flops in at.items():
            bound = min(peak, 2 * r * n * n / (4 * (n * n + 2 * r * n)) * bw)
            pts.append((float(r), flops / bound))
        out["gemm"] = _curve(pts, f"{src}: matmul_flops_at_rows / the roofline bound of a [rows, {n}] x [{n}, {n}] "
                                  "float32 matmul")
        out["grouped_gemm"] = _curve(pts, f"{src}: as gemm (the runtime runs each expert as its own matmul)")
    if m.get("decode_attention_bytes_per_s") is not None:
        out["attention_decode"] = _curve(
            [(DECODE_ATTENTION_CONTEXT, _rate(m, "decode_attention_bytes_per_s") / bw)],
            f"{src}: decode_attention_bytes_per_s / memory_bandwidth_bytes_per_s ({DECODE_ATTENTION_CONTEXT} "
            "context)")
    if m.get("prefill_attention_flops_per_s") is not None:
        out["attention_prefill"] = _curve(
            [(PREFILL_ATTENTION_CHUNK, _rate(m, "prefill_attention_flops_per_s") / peak)],
            f"{src}: prefill_attention_flops_per_s / matmul_flops_per_s ({PREFILL_ATTENTION_CHUNK}-token chunk)")
    ew = m.get("elementwise_bytes_per_s_at_tokens") or {}
    if ew:
        out["elementwise"] = _curve([(float(t), _rate(ew, t) / bw) for t in ew],
                                    f"{src}: elementwise_bytes_per_s_at_tokens / memory_bandwidth_bytes_per_s")
    elif m.get("elementwise_bytes_per_s") is not None:
        out["elementwise"] = _curve([(ELEMENTWISE_TOKENS, _rate(m, "elementwise_bytes_per_s") / bw)],
                                    f"{src}: elementwise_bytes_per_s / memory_bandwidth_bytes_per_s")
    for scheme, rates in sorted((m.get("dequant_full_bytes_per_s_by_bits") or {}).items()):
        if rates:
            out[f"dequant_cpu_{scheme}"] = _curve(
                [(float(b), _rate(rates, b) / bw) for b in rates],
                f"{src}: dequant_full_bytes_per_s_by_bits[{scheme}] (the torch reference dequantizing an expert's "
                "matrices, full-width float32 bytes written per second, by bit width) / memory_bandwidth_bytes_per_s")
    for scheme, by_bits in sorted((m.get("dequant_group_bytes_per_s") or {}).items()):
        for bits, rates in sorted(by_bits.items(), key=lambda kv: int(kv[0])):
            if rates:
                out[f"dequant_group_{scheme}_{int(bits)}"] = _curve(
                    [(float(g), _rate(rates, g) / bw) for g in rates],
                    f"{src}: dequant_group_bytes_per_s[{scheme}][{bits}] (a layer's experts of one width dequantized "
                    "in one stacked call, by the group's full-width bytes; full-width float32 bytes written per "
                    "second) / memory_bandwidth_bytes_per_s")
    if m.get("argmax_bytes_per_s") is not None:
        out["sample"] = _curve([(ARGMAX_ROWS, _rate(m, "argmax_bytes_per_s") / bw)],
                               f"{src}: argmax_bytes_per_s / memory_bandwidth_bytes_per_s ({ARGMAX_ROWS} rows)")
    for key, entry in sorted((m.get("model_gemm") or {}).items()):
        out.update(fit_model_curves(key, entry, bw, peak))
    out["copy"] = {"points": [[1.0, 1.0]], "source": "one processor: a copy is a memcpy at "
                   "link_pinned_bytes_per_s = memory_bandwidth_bytes_per_s / 2 (read + write)"}
    return out


def _one_term_fit(x: list[tuple[float, float]], y: list[float]) -> tuple[float, float]:
    """The better of y = a x0 and y = b x1 by squared error, each coefficient clipped to >= 0."""
    s00, s11 = sum(u * u for u, _ in x), sum(v * v for _, v in x)
    s0y, s1y = sum(u * r for (u, _), r in zip(x, y)), sum(v * r for (_, v), r in zip(x, y))
    alone = [(max(0.0, s0y / s00) if s00 else 0.0, 0.0), (0.0, max(0.0, s1y / s11) if s11 else 0.0)]
    return min(alone, key=lambda ab: _squared_error(x, y, *ab))


def _squared_error(x: list[tuple[float, ...]], y: list[float], *k: float) -> float:
    """The squared error of y = sum(k_i x_i) over the rows."""
    return sum((r - sum(c * u for c, u in zip(k, row))) ** 2 for row, r in zip(x, y))


def fit_call_and_sequence_overhead(rows: list[tuple[int, int, float]],
                                   layers: int) -> tuple[float, float, dict[str, Any]]:
    """The runtime's time per counted torch call and per decode sequence and layer beyond the priced
    modules, from decode steps of several batch sizes: `rows` are (sequences, counted calls, measured
    minus predicted seconds) per step. For each batch size the medians of its steps' calls and
    residuals, then least squares over those medians of residual = a x calls + b x layers x
    sequences, with a, b >= 0 (a coefficient the fit makes negative is 0 and the other refitted
    alone). A call alone prices small batches too high and large ones too low: the small kernels
    around the priced modules take longer as their rows grow. Returns (a, b, details: batch sizes,
    their medians, rms of the fit's error). ValueError (one line) for fewer than two batch sizes."""
    by_size: dict[int, list[tuple[int, float]]] = {}
    for seqs, calls, residual in rows:
        if seqs > 0 and calls > 0:
            by_size.setdefault(seqs, []).append((calls, residual))
    if len(by_size) < 2 or layers < 1:
        raise ValueError(f"call and sequence overhead: decode steps of {len(by_size)} batch size(s); "
                         "need at least two (e.g. 1 and 6 sequences)")
    points = [(n, median(c for c, _ in v), median(r for _, r in v)) for n, v in sorted(by_size.items())]
    x = [(c, layers * n) for n, c, _ in points]
    y = [r for *_, r in points]
    a, b = nonnegative_least_squares(x, y) or _one_term_fit(x, y)
    return a, b, {"sizes": [n for n, *_ in points], "median_calls": [c for _, c, _ in points],
                  "median_residual_s": y, "rms_s": math.sqrt(_squared_error(x, y, a, b) / len(y))}


def fit_prefill_overhead(rows: list[tuple[int, int, float]], layers: int,
                         hidden: int = 1) -> tuple[float, float, float, dict[str, Any]]:
    """The model code's prefill time beyond what the cost model prices, per layer: `rows` are
    (prefill tokens, prefill segments, measured minus predicted seconds) of prefill-only steps of
    one model with `layers` layers of `hidden` width; least squares residual = layers x (a x tokens
    x hidden + b x segments + c) with a, b, c >= 0 (`nonnegative_least_squares`): c is the time every
    prefill step takes whatever its size. Returns (a, b, c, details: steps, rms of the fit's error).
    ValueError (one line) for fewer than three rows or rows that cannot tell the terms apart."""
    if len(rows) < 3 or layers < 1:
        raise ValueError(f"prefill overhead: {len(rows)} steps of {layers} layers; need at least 3 steps")
    x = [(layers * t * hidden, layers * g, layers) for t, g, _ in rows]
    y = [r for *_, r in rows]
    fit = nonnegative_least_squares(x, y)
    if fit is None:
        raise ValueError("prefill overhead: the steps' token and segment counts are proportional; vary them")
    a, b, c = fit
    return a, b, c, {"steps": len(rows), "rms_s": math.sqrt(_squared_error(x, y, a, b, c) / len(y))}


def nonnegative_least_squares(x: list[tuple[float, ...]], y: list[float]) -> tuple[float, ...] | None:
    """Least squares y = sum(k_i x_i) with every k_i >= 0, for a few terms: the best by squared error
    of the unconstrained fits over each subset of the terms (the others 0) whose coefficients are all
    >= 0 (the active-set solution, found by trying every set). None where the full set's columns are
    linearly dependent (the fit cannot tell the terms apart)."""
    n = len(x[0])
    cols = [[row[i] for row in x] for i in range(n)]
    scale = [max(map(abs, c)) or 1.0 for c in cols]  # columns of seconds and of millions of elements

    def solve(idx: tuple[int, ...]) -> list[float] | None:
        a = [[sum(cols[i][r] * cols[j][r] / (scale[i] * scale[j]) for r in range(len(y))) for j in idx] for i in idx]
        b = [sum(cols[i][r] * y[r] / scale[i] for r in range(len(y))) for i in idx]
        m = len(idx)
        for p in range(m):  # Gaussian elimination with partial pivoting on the normal equations
            q = max(range(p, m), key=lambda r: abs(a[r][p]))
            if abs(a[q][p]) <= 1e-12 * max(1.0, max(abs(v) for row in a for v in row)):
                return None
            a[p], a[q], b[p], b[q] = a[q], a[p], b[q], b[p]
            for r in range(p + 1, m):
                f = a[r][p] / a[p][p]
                a[r] = [u - f * v for u, v in zip(a[r], a[p])]
                b[r] -= f * b[p]
        k = [0.0] * m
        for p in reversed(range(m)):
            k[p] = (b[p] - sum(a[p][j] * k[j] for j in range(p + 1, m))) / a[p][p]
        return [v / scale[i] for v, i in zip(k, idx)]

    if solve(tuple(range(n))) is None:
        return None
    best, best_err = tuple([0.0] * n), sum(v * v for v in y)
    for mask in range(1, 1 << n):
        idx = tuple(i for i in range(n) if mask >> i & 1)
        k = solve(idx)
        if k is None or min(k) < 0:
            continue
        full = [0.0] * n
        for i, v in zip(idx, k):
            full[i] = v
        err = _squared_error(x, y, *full)
        if err < best_err:
            best, best_err = tuple(full), err
    return best


# A model shape measurement's parts -> (the curve each fits (engines/sim/cost.py SHAPED), whether its
# weights come from memory: its time a fraction of the roofline bound, else of the FLOPs at the peak).
# "expert_dequantized": the expert's GEMMs right after the CPU reference dequantized it, weights in the caches.
MODEL_PARTS = {"dense": ("gemm", True), "expert": ("grouped_gemm", True), "head": ("head", True),
               "expert_dequantized": ("grouped_gemm_dequantized", False)}


# A model's dequant_cpu_packed@KEY curve is its expert's timing as it is: the static engines' CPU path
# indexes each RTN matrix (`QuantizedWeight.expert`, 10 torch calls) and dequantizes it (`dequantize`,
# 32), which is what `model_dequant_seconds` times, and those 84 calls are all a packed expert run makes
# beyond a full-width one's 2 (engines/sim/cost.py OPS_PER_QUANTIZED_EXPERT_CPU, counted in
# tests/unit/test_sim_cost.py), so the cost model prices no call of it again. The timing is 0.92x (the
# bundled model), 0.98x (Mixtral-shaped) and 0.99x (DeepSeek-V3-shaped) of what a running engine takes for
# the same indexing (`python -m harness.bench.simulate --dequant-ab`; docs/simulation-validation.md, the
# thirty-eighth run); cost model 12 took 64 calls out at the tight loop's price and priced 82 at the
# runtime's, ~0.08 ms more than the timing per expert run (9% of a DeepSeek-V3-shaped expert's ~0.85 ms).


def fit_model_curves(key: str, entry: Mapping[str, Any], bw: float, peak: float) -> dict[str, dict[str, Any]]:
    """One model's shape measurement (measurements["model_gemm"][key]: `params` and `seconds`
    by part and row count, `matrices`, `model`, `measured_at`) -> {"gemm@key", "grouped_gemm@key",
    "head@key": curve}: at each row count r, the roofline bound of the part's matrices (4-byte
    weights: max(4 x params / bw, 2 x r x params / peak)) over the seconds measured; and
    "dequant_cpu_packed@key" from one expert's dequantization by bits, its torch calls included."""
    out: dict[str, dict[str, Any]] = {}
    params, seconds = entry.get("params") or {}, entry.get("seconds") or {}
    width = float(entry.get("dtype_bytes", 4))
    for part, (curve, from_memory) in MODEL_PARTS.items():
        n, per_row = float(params.get(part, 0)), seconds.get(part) or {}
        if n <= 0 or not per_row:
            continue
        memory_s = width * n / bw if from_memory else 0.0
        pts = [(float(r), max(memory_s, 2 * int(r) * n / peak) / _rate(per_row, r)) for r in per_row]
        shapes = " + ".join(f"[{a}, {b}]" for a, b in (entry.get("matrices") or {}).get(part, ()))
        out[f"{curve}@{key}"] = _curve(pts, f"`pwbench hw calibrate --model {entry.get('model', '?')}` at "
                                            f"{entry.get('measured_at', '?')}: {part} ({shapes}) timed at each row "
                                            "count as the runtime calls it, against its "
                                            + ("roofline bound" if from_memory else "FLOPs at the peak"))
    dequant = seconds.get("dequant_packed") or {}
    if dequant and params.get("expert"):
        full = width * float(params["expert"])
        shapes = " + ".join(f"[{a}, {b}]" for a, b in (entry.get("matrices") or {}).get("expert", ()))
        out[f"dequant_cpu_packed@{key}"] = _curve(
            [(float(b), full / _rate(dequant, b) / bw) for b in dequant],
            f"`pwbench hw calibrate --model {entry.get('model', '?')}` at {entry.get('measured_at', '?')}: one "
            f"expert ({shapes}) indexed and dequantized from RTN records of group "
            f"{entry.get('dequant_group_size', '?')} by the torch reference, its torch calls included (all a "
            "packed expert run makes beyond a full-width one's: the cost model prices none again): full-width "
            "bytes per second by bit width / memory_bandwidth_bytes_per_s")
    per_ctx, kv_bytes = seconds.get("decode_attention") or {}, float(entry.get("decode_kv_bytes_per_token") or 0)
    if len(per_ctx) >= 2 and kv_bytes > 0:  # the time per context token: least squares slope over the contexts
        c = [float(k) for k in per_ctx]
        t = [_rate(per_ctx, k) for k in per_ctx]
        cm, tm = sum(c) / len(c), sum(t) / len(t)
        slope = sum((x - cm) * (y - tm) for x, y in zip(c, t)) / sum((x - cm) ** 2 for x in c)
        if slope > 0:
            out[f"attention_decode@{key}"] = _curve(
                [(cm, kv_bytes / slope / bw)],
                f"`pwbench hw calibrate --model {entry.get('model', '?')}` at {entry.get('measured_at', '?')}: "
                f"decode attention of one layer as the runtime runs it for this model (paged_attention over its "
                f"cache layout), per sequence, at {', '.join(per_ctx)} tokens of context: the cache's "
                f"{kv_bytes:g} bytes per token over the time per context token (least squares slope, "
                f"{slope * 1e9:.1f} ns) / memory_bandwidth_bytes_per_s (the calls' fixed time is priced by count)")
    att = entry.get("attention") or {}
    # (curve, seconds key, query-key pairs of a chunk of n as the cost model counts them, what was timed)
    for curve, part, pairs, what in (
            ("attention_prefill", "attention", 0.5, "the runtime's paged_attention over one chunk from position 0 "
             "(causal SDPA over its own keys)"),
            ("attention_prefill_context", "attention_context", 2.0,
             "the runtime's paged_attention over one chunk after as many tokens of context (its keys gathered from "
             "a paged cache, its mask over the whole rectangle)")):
        per_chunk = seconds.get(part) or {}
        if not att or not per_chunk:
            continue
        per_key = 4 * int(att["heads"]) * int(att["head_dim"])
        pts = [(float(n), per_key * pairs * int(n) * int(n) / peak / _rate(per_chunk, n)) for n in per_chunk]
        timed = att.get("sdpa") or f"{att['heads']} heads, {att['kv_heads']} KV heads of {att['head_dim']}"
        out[f"{curve}@{key}"] = _curve(
            pts, f"`pwbench hw calibrate --model {entry.get('model', '?')}` at {entry.get('measured_at', '?')}: {what} "
                 f"({timed}) at each chunk size, 4 x heads ({att['heads']}) x head_dim ({att['head_dim']}) x "
                 f"chunk^2 x {pairs:g} FLOPs / flops_per_s / seconds")
    return out

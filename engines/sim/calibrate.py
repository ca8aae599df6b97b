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

A ratio above 1 (a cache-resident kernel beating the copy bandwidth) is clipped to 1 and the
curve's source says so; a measurement that is absent leaves its curve out (the cost model then
states its default). `copy_overlap` is not fitted: on one processor copies never overlap.
"""

from __future__ import annotations

from collections.abc import Mapping
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


def cpu_rates(measurements: Mapping[str, Any]) -> dict[str, Any]:
    """The peaks `fit_cpu_curves`' efficiencies are fractions of, as profile fields."""
    bw = _rate(measurements, "memory_bandwidth_bytes_per_s")
    out: dict[str, Any] = {"memory_bytes_per_s": bw,
                           "flops_per_s": {"float32": _rate(measurements, "matmul_flops_per_s")},
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
    bw, peak = _rate(m, "memory_bandwidth_bytes_per_s"), _rate(m, "matmul_flops_per_s")
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
    if m.get("argmax_bytes_per_s") is not None:
        out["sample"] = _curve([(ARGMAX_ROWS, _rate(m, "argmax_bytes_per_s") / bw)],
                               f"{src}: argmax_bytes_per_s / memory_bandwidth_bytes_per_s ({ARGMAX_ROWS} rows)")
    out["copy"] = {"points": [[1.0, 1.0]], "source": "one processor: a copy is a memcpy at "
                   "link_pinned_bytes_per_s = memory_bandwidth_bytes_per_s / 2 (read + write)"}
    return out


def fit_step_overhead(measured_s: list[float], predicted_s: list[float], skip: int = 2) -> tuple[float, dict[str, Any]]:
    """The runtime's per-step time outside what the cost model prices (the scheduler's and the
    run loop's Python per step): the median over aligned steps of measured wall time minus the
    cost model's time for the same step (priced with step_overhead_s = 0), the first `skip`
    steps left out (warm-up). Negative medians are clipped to 0. Returns (seconds, details).
    ValueError (one line) when the two lists do not align or leave no step."""
    if len(measured_s) != len(predicted_s):
        raise ValueError(f"step overhead: {len(measured_s)} measured steps against {len(predicted_s)} simulated; "
                         "the simulated run must replay the measured one's routing")
    pairs = list(zip(measured_s, predicted_s))[skip:]
    if not pairs:
        raise ValueError(f"step overhead: no step after the first {skip}; run more steps")
    residual = sorted(m - p for m, p in pairs)
    mid = len(residual) // 2
    median = residual[mid] if len(residual) % 2 else (residual[mid - 1] + residual[mid]) / 2
    details = {"steps": len(pairs), "median_measured_s": sorted(m for m, _ in pairs)[mid],
               "median_predicted_s": sorted(p for _, p in pairs)[mid], "median_residual_s": median,
               "clipped": median < 0}
    return max(0.0, median), details

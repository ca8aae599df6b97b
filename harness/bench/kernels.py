"""GPU check: time dequant_matmul and fused_moe against bf16 and report achieved bandwidth.

    python -m harness.bench.kernels [--bits 4] [--group-size 128] [--tokens 1,16,128,1024]

Shapes are one Mixtral-8x7B MoE layer (D 4096, I 14336, 8 experts, top-2). Each row prints
the median time, the bytes the op must move (the weights it reads, for fused_moe only the
experts hit, plus its input and output), that over the time, and the share of the device's
peak memory bandwidth. Without CUDA it says so and exits 2.
"""

from __future__ import annotations

import argparse
import sys

import torch

from engines.quant.ops import dequant_matmul, fused_moe, kernel_impl
from engines.quant.qweight import quantize_experts, quantize_rtn
from engines.runtime.experts import dispatch, grouped_swiglu, route
from engines.runtime.weights import DenseExperts

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 4096, 14336, 8, 2


def time_ms(fn, repeats: int = 20) -> float:
    """Median of CUDA-event timings after two warm-up calls (the first compiles the kernel)."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def row(name: str, tokens: int, ms: float, nbytes: int, peak: float | None) -> str:
    gbps = nbytes / (ms * 1e-3) / 1e9
    share = f"{100 * gbps * 1e9 / peak:5.1f}%" if peak else "    ?"
    return f"{name:<28} {tokens:>6} {ms * 1e3:>10.1f} {nbytes / 1e6:>10.1f} {gbps:>9.0f} {share:>8}"


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.bench.kernels", description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--tokens", default="1,16,128,1024")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("harness.bench.kernels needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    from harness.hw import peaks_for

    dev, dt = torch.device("cuda"), torch.bfloat16
    name = torch.cuda.get_device_name(dev)
    peaks = peaks_for(name)
    peak = peaks.get("memory_bandwidth_bytes_per_s")
    peak_text = f"{peak / 1e12:.2f} TB/s" if peak else "unknown"
    print(f"{name}; kernels: {kernel_impl()}; peak memory bandwidth {peak_text} ({peaks['source']}); "
          f"bits={args.bits} group_size={args.group_size}")
    print(f"{'op':<28} {'tokens':>6} {'time us':>10} {'MB moved':>10} {'GB/s':>9} {'of peak':>8}")
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(INTERMEDIATE, HIDDEN, device=dev, dtype=dt, generator=gen) * 0.02
    qw = quantize_rtn(w, args.bits, args.group_size)
    dense = DenseExperts(torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, device=dev, dtype=dt, generator=gen) * 0.02,
                         torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, device=dev, dtype=dt, generator=gen) * 0.02)
    qe = quantize_experts(dense, args.bits, args.group_size)
    router = torch.randn(EXPERTS, HIDDEN, device=dev, dtype=dt, generator=gen)
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, device=dev, dtype=dt, generator=gen)
        io = _bytes(x) + tokens * INTERMEDIATE * 2
        print(row("bf16 matmul", tokens, time_ms(lambda: x @ w.T), _bytes(w) + io, peak))
        print(row(f"dequant_matmul {args.bits}-bit", tokens, time_ms(lambda: dequant_matmul(x, qw)), qw.nbytes() + io,
                  peak))
        ids, weights = route(x, router, TOP_K, normalize=True)
        counts = torch.bincount(ids.flatten(), minlength=EXPERTS).tolist()
        d = dispatch(ids, weights, counts)
        hit = sum(1 for c in counts if c)
        act = 2 * _bytes(x)  # x read, the [T, D] output written; intermediates are the kernel's business
        dense_bytes = hit * (_bytes(dense.gate_up[0]) + _bytes(dense.down[0])) + act
        print(row("bf16 grouped_swiglu", tokens, time_ms(lambda: grouped_swiglu(x, d, dense)), dense_bytes, peak))
        q_bytes = hit * (qe.gate_up.expert(0).nbytes() + qe.down.expert(0).nbytes()) + act
        print(row(f"fused_moe {args.bits}-bit", tokens, time_ms(lambda: fused_moe(x, d, qe)), q_bytes, peak))
    return 0


if __name__ == "__main__":
    sys.exit(main())

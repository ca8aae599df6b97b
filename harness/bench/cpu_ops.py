"""CPU: F.linear against a weight packed once for MKL (engines/runtime/gemm.py), the decode KV
gather along the pool's block dim against the flattened-rows gather (kv_cache.gather_blocks),
and decode attention as gather + SDPA against the in-place C kernel (runtime/cpu_attention.py).

    python -m harness.bench.cpu_ops [--rounds 5]

Shapes are the Mixtral-shaped benchmark model's decode step at 256 sequences (hidden 512,
expert intermediate 768, vocab 32000, 2 KV heads of 64, 16-token blocks, ~110 keys each):
an expert's gate_up and down at 64 rows, the LM head at 256, a q projection at 256. Weights
rotate through copies larger than the L3 cache, as in a step, where each weight is read once.
Each round times the ways back to back (this machine's speed drifts within seconds), and
the table prints the median over rounds of each and of their per-round ratio. The packed
outputs are checked equal to F.linear's to the bit.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from engines.runtime import cpu_attention, gemm
from engines.runtime.attention import AttentionBatch, DecodeGroup, paged_attention
from engines.runtime.kv_cache import PagedKVCache, block_rows, gather_blocks
from harness.hw import _timeit

COLD_BYTES = 192 << 20  # more than the 105 MiB L3 here: every call reads its weight from memory


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(2, COLD_BYTES // (n * k * 4))
    return [torch.randn(n, k) for _ in range(copies)]


def gemm_rows(rounds: int) -> list[tuple[str, float, float, float]]:
    shapes = [("expert gate_up", 64, 1536, 512), ("expert down", 64, 512, 768),
              ("LM head", 256, 32000, 512), ("q projection", 256, 512, 512)]
    rows = []
    for name, m, n, k in shapes:
        ws = _weights(n, k)
        packed = [gemm.pack(w) for w in ws]
        x = torch.randn(m, k)
        for w, p in zip(ws[:2], packed[:2]):
            if not torch.equal(gemm.linear(x, p), F.linear(x, w)):
                raise SystemExit(f"{name}: the packed output differs from F.linear's")
        plain_it, packed_it = itertools.cycle(ws), itertools.cycle(packed)
        flops = 2 * m * n * k
        plain, fast, ratio = [], [], []
        for _ in range(rounds):
            a = _timeit(lambda x=x, it=plain_it: F.linear(x, next(it)))
            b = _timeit(lambda x=x, it=packed_it: gemm.linear(x, next(it)))
            plain.append(flops / a / 1e9)
            fast.append(flops / b / 1e9)
            ratio.append(a / b)
        rows.append((f"{name} [{m}x{k}] x [{k}x{n}]", _median(plain), _median(fast), _median(ratio)))
    return rows


def gather_rows(rounds: int) -> tuple[float, float, float, float]:
    """ms per K (or V) gather of one layer: dim-1 index_select, flattened rows, rows into a reused buffer."""
    heads, blocks, size, dim, seqs, per_seq = 2, 8192, 16, 64, 256, 7
    pools = [torch.randn(heads, blocks, size, dim)
             for _ in range(max(2, COLD_BYTES // (heads * blocks * size * dim * 4)))]
    ids = torch.randint(0, blocks, (seqs * per_seq,))
    rows = block_rows(pools[0], ids)
    buf = torch.empty(rows.numel() * size * dim)
    it = itertools.cycle(pools)
    if not torch.equal(gather_blocks(pools[0], rows), torch.index_select(pools[0], 1, ids)):
        raise SystemExit("gather_blocks differs from index_select along the block dim")
    old, new, reused, ratio = [], [], [], []
    for _ in range(rounds):
        a = _timeit(lambda: torch.index_select(next(it), 1, ids))
        b = _timeit(lambda: gather_blocks(next(it), rows))
        c = _timeit(lambda: gather_blocks(next(it), rows, buf))
        old.append(a * 1e3)
        new.append(b * 1e3)
        reused.append(c * 1e3)
        ratio.append(a / c)
    return _median(old), _median(new), _median(reused), _median(ratio)


def attention_rows(rounds: int) -> tuple[float, float, float] | None:
    """ms of one layer's decode attention (256 sequences x 7 blocks, 2 KV heads x 4 query heads
    of 64) through paged_attention: gather + SDPA, the C kernel, and their ratio; None without
    the kernel."""
    if not cpu_attention.available():
        return None
    heads, blocks, size, dim, seqs, per_seq = 2, 8192, 16, 64, 256, 7
    caches = [PagedKVCache(1, blocks, size, heads, dim, torch.float32, torch.device("cpu"))
              for _ in range(max(2, COLD_BYTES // (2 * heads * blocks * size * dim * 4)))]
    for cache in caches:
        for pool in cache.k + cache.v:
            pool.normal_()
    tables = torch.randperm(blocks)[: seqs * per_seq].view(seqs, per_seq)
    ctx = torch.randint(per_seq * size - 20, per_seq * size + 1, (seqs,))
    batch = AttentionBatch(torch.zeros(seqs, dtype=torch.long), seqs, [DecodeGroup(0, tables, ctx, size)])
    q, kv = torch.randn(seqs, 4 * heads, dim), torch.randn(seqs, heads, dim)
    it = itertools.cycle(caches)
    torch_path, kernel, ratio = [], [], []
    for _ in range(rounds):
        with cpu_attention.turned_off():
            a = _timeit(lambda: paged_attention(q, kv, kv, next(it), 0, batch, None))
        b = _timeit(lambda: paged_attention(q, kv, kv, next(it), 0, batch, None))
        torch_path.append(a * 1e3)
        kernel.append(b * 1e3)
        ratio.append(a / b)
    return _median(torch_path), _median(kernel), _median(ratio)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.bench.cpu_ops", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="back-to-back timings of both ways (default 5)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if not gemm.can_pack(torch.zeros(2, 2)):
        print("harness.bench.cpu_ops: this torch has no MKL; there is nothing to pack")
        return 2
    print(f"torch threads: {torch.get_num_threads()}; {args.rounds} rounds, medians")
    print(f"{'matmul':<38} {'F.linear GFLOP/s':>17} {'packed GFLOP/s':>15} {'speed-up':>9}")
    for name, plain, fast, ratio in gemm_rows(args.rounds):
        print(f"{name:<38} {plain:>17.0f} {fast:>15.0f} {ratio:>8.2f}x")
    old, new, reused, ratio = gather_rows(args.rounds)
    print(f"\nKV gather of one layer's K (256 sequences x 7 blocks, 14.7 MB): index_select along the block dim "
          f"{old:.2f} ms, flattened rows {new:.2f} ms, into a reused buffer {reused:.2f} ms ({ratio:.2f}x)")
    att = attention_rows(args.rounds)
    if att is None:
        print(f"decode attention: the C kernel did not build ({cpu_attention.unavailable_reason()})")
    else:
        print(f"decode attention of one layer (256 sequences, ~100 keys, 2 KV x 4 query heads of 64): gather + SDPA "
              f"{att[0]:.2f} ms, in-place C kernel {att[1]:.2f} ms ({att[2]:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

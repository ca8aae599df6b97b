"""CPU: F.linear against a weight packed once for MKL (engines/runtime/gemm.py), the decode KV
gather along the pool's block dim against the flattened-rows gather (kv_cache.gather_blocks),
and decode attention as gather + SDPA against the in-place C kernel (runtime/cpu_attention.py).

    python -m harness.bench.cpu_ops [--rounds 5]
    python -m harness.bench.cpu_ops --host-malloc [--seeds 4]
    python -m harness.bench.cpu_ops --dequant [--models DIR,...] [--rounds 5]
    python -m harness.bench.cpu_ops --rows [--models DIR,...] [--rounds 5]

Shapes are the Mixtral-shaped benchmark model's decode step at 256 sequences (hidden 512,
expert intermediate 768, vocab 32000, 2 KV heads of 64, 16-token blocks, ~110 keys each):
an expert's gate_up and down at 64 rows, the LM head at 256, a q projection at 256. Weights
rotate through copies larger than the L3 cache, as in a step, where each weight is read once.
Each round times the ways back to back (this machine's speed drifts within seconds), and
the table prints the median over rounds of each and of their per-round ratio. The packed
outputs are checked equal to F.linear's to the bit.

`--host-malloc`: the bundled model on engine moe, ten batches of six new prompts (64-256 tokens,
8 output tokens each) in one process, once with the engines' host-memory setting
(engines/runtime/memory.py `keep_freed_host_memory`) and once with glibc's defaults
(PWBENCH_HOST_MALLOC=glibc), a fresh process each, paired by seed: the minor page faults of
batches 2-10 and their prefill time per token and decode step (medians; this thread's CPU time).

`--dequant`: `model_dequant_seconds` (below) of the bundled model and the benchmark models (or
`--models`), with the engines' host-memory setting and with glibc's defaults, a fresh process each.

`--rows`: `model_gemm_seconds` (below) of the Mixtral-shaped benchmark model (or `--models`): each part's
time by row count, 1-16 and 32, as `pwbench hw calibrate --model` times it for the cost model's curves.

`model_gemm_seconds` / `model_gemm_entry`: one model's own GEMM shapes at 1-1024 rows, for
`pwbench hw calibrate --model DIR` (the cost model's shape-keyed curves, engines/sim/calibrate.py).
"""

from __future__ import annotations

import argparse
import itertools
import time

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


ATTENTION_CHUNKS = (16, 32, 64, 128, 256, 512, 1024)
# Every row count up to the packed kernel's (engines/runtime/gemm.py MIN_ROWS), then doubling: below it
# F.linear's float32 kernel on this CPU runs the rows in blocks of three, each block reading the whole
# weight again, so the time is a staircase in the rows (the 62 MiB LM head [32000, 512]: ~5.5 ms for 1-3
# rows, ~11.5 for 4-6, ~17 for 7-9, ~22 for 10-12, then ~9 ms packed at 16: `--rows`). Timed at powers of
# two only, the curve priced 6 rows between 4's and 8's times (~15% high) and 12 rows between 8's and
# packed 16's (about half): a twelve-sequence decode step came out 14-17% fast at 32-128 tokens of
# context (docs/simulation.md).
_SMALL_ROWS = tuple(range(1, gemm.MIN_ROWS + 1))
MODEL_ROWS = {"dense": (*_SMALL_ROWS, 32, 64, 128, 256, 512, 1024),
              "expert": (*_SMALL_ROWS, 32, 64, 128, 256, 512),
              "head": (*_SMALL_ROWS, 32, 64, 128, 256)}


def model_matrices(shape, mla=None) -> dict[str, list[tuple[int, int]]]:
    """The [N, K] weights a step of a model of `shape` (engines/runtime/shape.py ModelShape) runs
    per part: one layer's attention projections (q, k, v, o; for MLA, given its `mla` config
    (engines/runtime/config.py MLAConfig), its own chain: q_a and q_b (or q), kv_a, o, where the
    shape's absorbed sizes would time larger, faster matrices than it runs), one routed expert
    (gate_up, down) and the LM head."""
    d, q, kv, i = shape.hidden, shape.q_size, shape.kv_size, shape.intermediate
    dense = [(q, d), (kv, d), (kv, d), (d, q)]
    if mla is not None:
        h, qk = shape.heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
        ql = mla.q_lora_rank
        dense = ([(ql, d), (h * qk, ql)] if ql else [(h * qk, d)]) + [
            (mla.kv_lora_rank + mla.qk_rope_head_dim, d), (d, h * mla.v_head_dim)]
    return {"dense": dense, "expert": [(2 * i, d), (d, i)], "head": [(shape.vocab, d)]}


def model_gemm_seconds(shape, rounds: int = 5, min_call_s: float = 0.004, mla=None) -> dict[str, dict[str, float]]:
    """Seconds of each part of `model_matrices(shape)` at each row count of MODEL_ROWS, float32 on
    this CPU with torch's current threads, as the runtime calls them: the projections through
    F.linear (engines/runtime/model.py), an expert's gate_up then down and the LM head through
    engines/runtime/gemm.py's `linear` on packed weights (MKL's packed kernel from 16 rows,
    F.linear below, as for the resident experts and head). Weights rotate through copies as
    large together as the model's weights (at most COLD_BYTES, more than the caches: a step
    reads each weight once, from memory unless the whole model fits the caches). Rounds time every
    (part, rows) once each, back to back, so a neighbour's burst falls on all of them alike; the
    median over `rounds`. {part: {rows: seconds}}."""
    mats = model_matrices(shape, mla)
    prepared = {}
    # A step reads the model's weights once each: from memory when they are more than the caches
    # hold, from the caches when the whole model fits (the bundled demo model's 1.6 MB: its GEMMs
    # run ~3x faster hot than rotated through cold copies).
    working_set = min(COLD_BYTES, shape.dense_bytes + shape.total_experts * shape.expert_bytes)
    for part, shapes in mats.items():
        per_copy = sum(n * k for n, k in shapes) * 4
        copies = max(2, -(-working_set // per_copy))
        ws = [[torch.randn(n, k) for n, k in shapes] for _ in range(copies)]
        if part != "dense":
            ws = [[gemm.pack(w) for w in group] for group in ws]
        prepared[part] = itertools.cycle(ws)

    other = {(r, k): torch.randn(r, k) for r in MODEL_ROWS["dense"] for _, k in mats["dense"]}

    def call(part: str, x: torch.Tensor) -> None:
        group = next(prepared[part])
        if part == "dense":
            for w in group:
                F.linear(x if w.shape[1] == x.shape[1] else other[(x.shape[0], w.shape[1])], w)
        elif part == "expert":
            h = gemm.linear(x, group[0])
            gemm.linear(h[:, : h.shape[1] // 2].contiguous(), group[1])
        else:
            gemm.linear(x, group[0])

    inputs = {(part, r): torch.randn(r, mats[part][0][1]) for part, rows in MODEL_ROWS.items() for r in rows}
    calls = {}
    for (part, r), x in inputs.items():  # warm up; calls per timing so that each lasts min_call_s
        for _ in range(2):
            call(part, x)
        t = time.perf_counter()
        call(part, x)
        calls[(part, r)] = max(1, int(min_call_s / max(time.perf_counter() - t, 1e-7)))
    times: dict[tuple[str, int], list[float]] = {k: [] for k in inputs}
    for _ in range(rounds):
        for (part, r), x in inputs.items():
            n = calls[(part, r)]
            t = time.perf_counter()
            for _ in range(n):
                call(part, x)
            times[(part, r)].append((time.perf_counter() - t) / n)
    out: dict[str, dict[str, float]] = {part: {} for part in MODEL_ROWS}
    for (part, r), ts in times.items():
        out[part][str(r)] = _median(ts)
    for part, context in (("attention", False), ("attention_context", True)):
        if (timed := prefill_attention_seconds(shape, mla, rounds, context=context)) is not None:
            out[part] = timed
    return out


# Experts of each matrix stacked for the dequantization timing (`model_dequant_seconds`), cycled
# through as a step's expert runs go through a layer's experts: at most DEQUANT_EXPERTS, and no more
# than DEQUANT_BYTES of full-width weights. A larger expert (Mixtral-8x7B's: 705 MB in float32, and
# quantized at four widths) is timed on a slice of its rows of that size, its time scaled by its
# elements: an approximation (a whole matrix's temporaries are larger and may fault in at another rate).
DEQUANT_EXPERTS, DEQUANT_BYTES = 8, 64 << 20


def static_group_size(shape) -> int:
    """The group size the static engines quantize experts of `shape` with: their default, fitted to
    the expert widths (engines/static_quant.py `fit_group_size`)."""
    from engines.static_quant import StaticQuantConfig, fit_group_size

    return fit_group_size(StaticQuantConfig.group_size, (shape.hidden, shape.intermediate))[0]


def model_dequant_seconds(shape, group_size: int, rounds: int = 5,
                          bits: tuple[int, ...] | None = None) -> dict[str, float]:
    """Seconds the CPU torch reference takes to dequantize one routed expert of `shape` (gate_up
    [2I, D] and down [D, I], RTN records of `group_size` at each width of harness/hw.py DEQUANT_BITS)
    as the static engines' CPU path does it (engines/quant/ops.py `QuantizedExperts`:
    `dequantize(stack.expert(e), float32)` per matrix), with the engines' host allocator setting
    (engines/runtime/memory.py `keep_freed_host_memory`), as a CPU engine runs (`--dequant` prints
    it against glibc's defaults). The median over `rounds` timings of DEQUANT_EXPERTS experts (fewer
    where they would pass DEQUANT_BYTES; an expert larger than that: a slice of both matrices' rows,
    its time scaled by the elements), per expert; at `bits` (default DEQUANT_BITS). {bits: seconds}."""
    from engines.quant.qweight import dequantize, quantize_rtn
    from engines.runtime.memory import keep_freed_host_memory
    from harness.hw import DEQUANT_BITS

    keep_freed_host_memory()
    gen = torch.Generator().manual_seed(0)
    d, i = shape.hidden, shape.intermediate
    full = 3 * d * i * 4  # one expert's float32 bytes
    n = max(1, min(DEQUANT_EXPERTS, DEQUANT_BYTES // max(1, full)))
    share = min(1.0, DEQUANT_BYTES / full)  # of each matrix's rows timed
    rows_gu, rows_dn = max(1, round(2 * i * share)), max(1, round(d * share))
    scale = 3 * d * i / (rows_gu * d + rows_dn * i)
    out = {}
    for b in bits or DEQUANT_BITS:
        gate_up = quantize_rtn(torch.randn(n, rows_gu, d, generator=gen), b, group_size)
        down = quantize_rtn(torch.randn(n, rows_dn, i, generator=gen), b, group_size)

        def run(gate_up=gate_up, down=down) -> None:
            for e in range(n):
                dequantize(gate_up.expert(e), torch.float32)
                dequantize(down.expert(e), torch.float32)

        out[str(b)] = _timeit(run, repeats=rounds, min_s=0.2, warmup=1) / n * scale
    return out


def dequantized_gemm_seconds(shape, group_size: int, rounds: int = 5, min_call_s: float = 0.004) -> dict[str, float]:
    """Seconds of one routed expert's GEMMs (gate_up, then down) right after the static engines' CPU
    path dequantized it (engines/quant/ops.py `fused_moe_reference`: `grouped_swiglu` indexes the
    expert's two 4-bit RTN matrices, each dequantized to float32 then, and runs its SwiGLU on them),
    at each row count of MODEL_ROWS["expert"]: the weights just written, in the caches, where the
    resident experts' GEMMs (`model_gemm_seconds`) read theirs from memory (Mixtral-shaped, one row:
    ~0.25 ms against ~0.4). Only the GEMMs are timed, each call's dequantization outside the clock;
    the experts cycle as `model_dequant_seconds`'s do. Rounds time every row count once each; the
    median over `rounds`. {rows: seconds}; {} for an expert over DEQUANT_BYTES in float32 (Mixtral-8x7B's
    705 MB: no cache holds it, so its GEMMs read memory as a resident expert's do)."""
    from engines.quant.qweight import dequantize, quantize_rtn
    from engines.runtime.memory import keep_freed_host_memory

    d, i = shape.hidden, shape.intermediate
    if 3 * d * i * 4 > DEQUANT_BYTES:
        return {}
    keep_freed_host_memory()
    gen = torch.Generator().manual_seed(1)
    n = max(1, min(DEQUANT_EXPERTS, DEQUANT_BYTES // (3 * d * i * 4)))
    gate_up = quantize_rtn(torch.randn(n, 2 * i, d, generator=gen), 4, group_size)
    down = quantize_rtn(torch.randn(n, d, i, generator=gen), 4, group_size)
    experts = itertools.cycle(range(n))

    def call(x: torch.Tensor) -> float:
        e = next(experts)
        w1, w2 = dequantize(gate_up.expert(e), torch.float32), dequantize(down.expert(e), torch.float32)
        t = time.perf_counter()
        h = F.linear(x, w1)
        F.linear(h[:, :i].contiguous(), w2)
        return time.perf_counter() - t

    rows = MODEL_ROWS["expert"]
    inputs = {r: torch.randn(r, d, generator=gen) for r in rows}
    calls = {}
    for r, x in inputs.items():  # warm up; calls per timing so that each lasts min_call_s (dequantizations included)
        call(x)
        t = time.perf_counter()
        call(x)
        calls[r] = max(2, int(min_call_s / max(time.perf_counter() - t, 1e-7)))
    times: dict[int, list[float]] = {r: [] for r in rows}
    for _ in range(rounds):
        for r, x in inputs.items():
            times[r].append(sum(call(x) for _ in range(calls[r])) / calls[r])
    return {str(r): _median(ts) for r, ts in times.items()}


def attention_heads(shape, mla=None) -> tuple[int, int, int, int] | None:
    """(query heads, KV heads, key dim, value dim) of the model's prefill SDPA as the runtime calls
    it: GQA's heads; MLA's absorbed form (`mla`, its ModelConfig.mla: one shared head of keys
    [latent, rope key] and values [latent], engines/runtime/mla.py); None for a shape without whole
    heads."""
    if mla is not None:
        return shape.heads, 1, mla.kv_lora_rank + mla.qk_rope_head_dim, mla.kv_lora_rank
    if not shape.head_dim or shape.kv_size % shape.head_dim or shape.q_size != shape.heads * shape.head_dim:
        return None
    return shape.heads, shape.kv_size // shape.head_dim, shape.head_dim, shape.head_dim


def prefill_attention_seconds(shape, mla=None, rounds: int = 5, context: bool = False) -> dict[str, float] | None:
    """Seconds of one layer's attention over a prefill chunk of n tokens as the runtime runs it
    (engines/runtime/attention.py `paged_attention` on one PrefillSegment, its queries and keys laid
    out as the runtime passes them: [n, heads, dim] rows, transposed per chunk): causal over the
    chunk's own keys, or with `context`, after n tokens of context: the sequence's 2n keys gathered
    from a paged cache (blocks scattered over its pool; MLA's latent expanded), attended with the
    runtime's `context_mask` over the whole [n, 2n] rectangle, as a prefix-cache hit's chunk is.
    At each n of ATTENTION_CHUNKS; the median over `rounds` rounds of every n. {n: seconds}; None for
    a shape without whole heads (`attention_heads`)."""
    from engines.runtime.attention import PrefillSegment
    from engines.runtime.memory import keep_freed_host_memory

    heads = attention_heads(shape, mla)
    if heads is None:
        return None
    keep_freed_host_memory()  # as the engines run (the gather and MLA's expansion allocate per call)
    h, kv_heads, k_dim, v_dim, q_dim, expand = paged_layout(shape.heads, heads[1], shape.head_dim, mla)
    blocks = -(-2 * max(ATTENTION_CHUNKS) // DECODE_BLOCK)
    cache = PagedKVCache(1, 2 * blocks, DECODE_BLOCK, kv_heads, k_dim, torch.float32, torch.device("cpu"),
                         value_dim=v_dim)
    for pool in cache.k + cache.v:
        pool.normal_()
    order = torch.randperm(2 * blocks)
    args = {}
    for n in ATTENTION_CHUNKS:
        k, v = torch.randn(n, kv_heads, k_dim), torch.randn(n, kv_heads, v_dim)
        if expand is not None:  # this step's K/V as the runtime passes them (`attend_cached`)
            k, v = expand(k, v)
        start = n if context else 0
        segment = PrefillSegment(0, n, start, order[: -(-(start + n) // DECODE_BLOCK)])
        args[n] = (torch.randn(n, h, q_dim), k, v, AttentionBatch(torch.zeros(n, dtype=torch.long), 0, [], [segment]))

    def call(n: int) -> None:
        q, k, v, batch = args[n]
        paged_attention(q, k, v, cache, 0, batch, None, expand=expand)

    reps = {}
    for n in ATTENTION_CHUNKS:
        call(n)
        t = time.perf_counter()
        call(n)
        reps[n] = max(1, int(0.004 / max(time.perf_counter() - t, 1e-7)))
    times: dict[int, list[float]] = {n: [] for n in ATTENTION_CHUNKS}
    for _ in range(rounds):
        for n in ATTENTION_CHUNKS:
            t = time.perf_counter()
            for _ in range(reps[n]):
                call(n)
            times[n].append((time.perf_counter() - t) / reps[n])
    return {str(n): _median(ts) for n, ts in times.items()}


def paged_layout(heads: int, kv_heads: int, head_dim: int, mla=None) -> tuple:
    """One layer as the runtime's paged cache holds it: (query heads, the cache's KV heads, K pool
    dim, V pool dim, query dim, `expand`): GQA's heads, or MLA's latent in the K pool and its rope key
    in the V pool (one "head" each), expanded into keys and values by `mla_keys_values`."""
    if mla is not None:
        from engines.runtime.mla import mla_keys_values

        latent, rope = mla.kv_lora_rank, mla.qk_rope_head_dim
        return heads, 1, latent, rope, latent + rope, mla_keys_values
    return heads, kv_heads, head_dim, head_dim, head_dim, None


# `decode_attention_seconds`: DECODE_SEQUENCES sequences' decode attention at these contexts (tokens
# attended each), blocks of DECODE_BLOCK tokens scattered over a pool of DECODE_POOL_BLOCKS. 16
# sequences of 1,536 tokens are 12-25 MB of cache per layer for the benchmark's models, far more than a
# core's L2 (2 MB here), as a step's KV is once the experts' weights have passed through the caches
# (one sequence's fits in L2: the bundled model's then read at 1.25x the copy bandwidth).
DECODE_SEQUENCES, DECODE_CONTEXTS, DECODE_BLOCK, DECODE_POOL_BLOCKS = 16, (128, 512, 1536), 16, 4096


def decode_attention_seconds(config, rounds: int = 5) -> tuple[dict[str, float], int]:
    """One layer's decode attention of DECODE_SEQUENCES sequences as the runtime runs it for a model of `config`
    (engines/runtime/attention.py `paged_attention` over a paged cache of the model's layout: GQA
    heads read in place by the C kernel where it builds; MLA's latent and rope key gathered and
    expanded by `mla_keys_values`, then SDPA), at each context of DECODE_CONTEXTS, the median over
    `rounds` rounds, per sequence: ({context: seconds}, the cache's bytes per token and layer)."""
    from engines.runtime.memory import keep_freed_host_memory

    keep_freed_host_memory()  # as the engines run (MLA's expansion allocates a copy of the context each call)
    heads, kv_heads, k_dim, v_dim, q_dim, expand = paged_layout(config.num_heads, config.num_kv_heads,
                                                                config.head_dim, config.mla)
    cache = PagedKVCache(1, DECODE_POOL_BLOCKS, DECODE_BLOCK, kv_heads, k_dim, torch.float32, torch.device("cpu"),
                         value_dim=v_dim)
    for pool in cache.k + cache.v:
        pool.normal_()
    order = torch.randperm(DECODE_POOL_BLOCKS)
    n = DECODE_SEQUENCES
    q, k_new, v_new = torch.randn(n, heads, q_dim), torch.randn(n, kv_heads, k_dim), torch.randn(n, kv_heads, v_dim)
    if expand is not None:  # this step's K/V as the runtime passes them (engines/runtime/attention.py `attend_cached`)
        k_new, v_new = expand(k_new, v_new)
    batches = {}
    for ctx in DECODE_CONTEXTS:
        tables = order[: n * -(-ctx // DECODE_BLOCK)].view(n, -1)
        batches[ctx] = AttentionBatch(torch.zeros(n, dtype=torch.long), n,
                                      [DecodeGroup(0, tables, torch.full((n,), ctx), DECODE_BLOCK)])

    def call(ctx: int) -> None:
        paged_attention(q, k_new, v_new, cache, 0, batches[ctx], None, expand=expand)

    times: dict[int, list[float]] = {c: [] for c in DECODE_CONTEXTS}
    for c in DECODE_CONTEXTS:
        call(c)
    for _ in range(rounds):
        for c in DECODE_CONTEXTS:
            times[c].append(_timeit(lambda c=c: call(c), repeats=1, min_s=0.02, warmup=0))
    return {str(c): _median(ts) / n for c, ts in times.items()}, (kv_heads * (k_dim + v_dim)) * 4


def model_gemm_entry(model: str, rounds: int = 5) -> tuple[str, dict]:
    """`pwbench hw calibrate --model`'s measurement of the model folder `model` (its config only):
    (engines/sim/cost.py `shape_key` of its float32 shape, the entry engines/sim/calibrate.py
    `fit_model_curves` reads). ModelLoadError (one line) for a folder that is not a model."""
    from engines.runtime.checkpoint import open_checkpoint
    from engines.runtime.shape import model_shape
    from engines.sim.cost import shape_key

    config = open_checkpoint(model, config_only=True).config
    shape = model_shape(config, 4)  # the CPU runs float32
    mats = model_matrices(shape, config.mla)
    group = static_group_size(shape)
    # The static engines' CPU steps are mostly one expert's dequantization, timed for ~0.2 s per width,
    # and one such window can fall in a slow quarter-second of this host (the Mixtral-shaped expert at 4
    # bits: 3.60, 4.53, 6.45 and 3.59 ms in one validation run's four calibrations): three windows spread
    # over the measurement (before the GEMMs, after them, after the decode attention), the median per width.
    windows = [model_dequant_seconds(shape, group, rounds)]
    seconds = model_gemm_seconds(shape, rounds, mla=config.mla)
    seconds["expert_dequantized"] = dequantized_gemm_seconds(shape, group, rounds)
    windows.append(model_dequant_seconds(shape, group, rounds))
    parts = {**mats, "expert_dequantized": mats["expert"]}  # the same matrices, timed after dequantization
    seconds["decode_attention"], kv_bytes = decode_attention_seconds(config, rounds)
    windows.append(model_dequant_seconds(shape, group, rounds))
    seconds["dequant_packed"] = {b: _median([w[b] for w in windows]) for b in windows[0]}
    heads = attention_heads(shape, config.mla)
    # the FLOPs a prefill curve's time is a fraction of are the cost model's count, 4 x heads x head_dim
    # a pair (MLA: its query head dim); "sdpa" is what was timed
    attention = {"heads": shape.heads, "kv_heads": heads[1], "head_dim": shape.head_dim,
                 "sdpa": "{} query heads over {} KV heads, keys of {}, values of {}".format(*heads)} if heads else None
    return shape_key(shape), {"model": str(model), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "dtype_bytes": 4, "threads": torch.get_num_threads(), "dequant_group_size": group,
                              "dequant_packed_windows": windows,
                              "attention": attention,
                              "decode_kv_bytes_per_token": kv_bytes,
                              "matrices": {k: [list(m) for m in v] for k, v in parts.items()},
                              "params": {k: sum(n * k_ for n, k_ in v) for k, v in parts.items()},
                              "seconds": seconds}


MALLOC_PROBE = """
import random, resource, statistics, sys, time
from engines.base import EngineRequest
from engines.registry import create_engine
rng = random.Random(int(sys.argv[1]))
engine = create_engine("moe", {"model": "engines/demo_model", "device": "cpu"})
engine.start()
faults, prefill, decode = [], [], []
def step():
    f, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time()
    engine.step()
    return time.thread_time() - t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
for k in range(10):
    lengths = [rng.randint(64, 256) for _ in range(6)]
    for i, n in enumerate(lengths):
        engine.add_request(EngineRequest(f"p{k}-{i}", tuple(rng.randrange(3, 1000) for _ in range(n)), 8,
                                         ignore_eos=True))
    took, f = step()
    prefill.append(1e6 * took / sum(lengths))
    while engine.has_unfinished():
        d, g = step()
        decode.append(1e3 * d)
        f += g
    faults.append(f)
engine.stop()
print(sum(faults[1:]), statistics.median(prefill[1:]), statistics.median(decode))
"""


def host_malloc_rows(seeds: int) -> list[tuple[int, str, int, float, float]]:
    """(seed, setting, page faults, prefill us per token, decode ms) of MALLOC_PROBE per seed, the
    engines' setting ("kept") and glibc's defaults ("glibc") back to back, each in a fresh process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    rows = []
    for seed in range(1, seeds + 1):
        for setting in ("kept", "glibc"):
            env = {k: v for k, v in os.environ.items() if k != "PWBENCH_HOST_MALLOC"} | {"OMP_NUM_THREADS": "1"}
            if setting == "glibc":
                env["PWBENCH_HOST_MALLOC"] = "glibc"
            out = subprocess.run([sys.executable, "-c", MALLOC_PROBE, str(seed)], capture_output=True, text=True,
                                 cwd=root, env=env, check=True)
            faults, prefill, decode = out.stdout.split()
            rows.append((seed, setting, int(faults), float(prefill), float(decode)))
    return rows


DEQUANT_PROBE = """
import json, sys
import torch
torch.set_num_threads(1)
from engines.runtime.checkpoint import open_checkpoint
from engines.runtime.memory import keep_freed_host_memory
from engines.runtime.shape import model_shape
from harness.bench.cpu_ops import model_dequant_seconds, static_group_size
kept = keep_freed_host_memory()
for folder in sys.argv[1:]:
    shape = model_shape(open_checkpoint(folder, config_only=True).config, 4)
    group = static_group_size(shape)
    print(json.dumps([folder, kept, group, shape.expert_bytes, model_dequant_seconds(shape, group)]))
"""


def dequant_rows(folders: list[str], rounds: int) -> list[tuple[str, str, int, int, dict[str, float]]]:
    """(model, setting, group size, full-width expert bytes, {bits: seconds}) of `model_dequant_seconds`
    per model folder, `rounds` times in turn with the engines' host-memory setting ("kept") and
    glibc's defaults ("glibc"), a fresh process (one torch thread) each."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    rows = []
    for _ in range(rounds):
        for setting in ("kept", "glibc"):
            env = {k: v for k, v in os.environ.items() if k != "PWBENCH_HOST_MALLOC"} | {"OMP_NUM_THREADS": "1"}
            if setting == "glibc":
                env["PWBENCH_HOST_MALLOC"] = "glibc"
            out = subprocess.run([sys.executable, "-c", DEQUANT_PROBE, *folders], capture_output=True, text=True,
                                 cwd=root, env=env, check=True)
            for line in out.stdout.splitlines():
                folder, kept, group, nbytes, seconds = json.loads(line)
                rows.append((Path(folder).name, "kept" if kept else "glibc", group, nbytes, seconds))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.bench.cpu_ops", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="back-to-back timings of both ways (default 5)")
    p.add_argument("--host-malloc", action="store_true",
                   help="instead: the engines' host-memory setting against glibc's defaults on the bundled model "
                        "(page faults, prefill and decode times), a fresh process each")
    p.add_argument("--seeds", type=int, default=4, help="--host-malloc: prompt seeds, each run both ways (default 4)")
    p.add_argument("--dequant", action="store_true",
                   help="instead: the CPU reference's RTN dequantization of one expert of each model (as `pwbench hw "
                        "calibrate --model` times it), with the engines' host-memory setting and with glibc's "
                        "defaults, a fresh process each, --rounds times")
    p.add_argument("--rows", action="store_true",
                   help="instead: each model's dense projections, one expert (gate_up then down) and LM head by "
                        "row count (1-16, 32; ms, the median over --rounds), as `pwbench hw calibrate --model` "
                        "times them")
    p.add_argument("--models", default=None, metavar="DIR,...",
                   help="--dequant, --rows: model folders (config.json is enough; default: --dequant the bundled "
                        "model and the Mixtral- and DeepSeek-V3-shaped benchmark models' configs, --rows the "
                        "Mixtral-shaped one's)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.seeds < 1:
        p.error("--rounds and --seeds must be at least 1")
    if args.dequant:
        return dequant_table(args.models, args.rounds)
    if args.rows:
        return rows_table(args.models, args.rounds)
    if args.host_malloc:
        print(f"{'seed':>4} {'setting':<7} {'faults, batches 2-10':>21} {'prefill us/token':>17} {'decode ms':>10}")
        for seed, setting, faults, prefill, decode in host_malloc_rows(args.seeds):
            print(f"{seed:>4} {setting:<7} {faults:>21,} {prefill:>17.2f} {decode:>10.3f}")
        return 0
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


def model_folders(models: str | None, tmp: str, default: tuple[str, ...]) -> list[str] | None:
    """`--models`' folders (None, after one line, where one has no config.json), or the `default`
    ones: "demo" (the bundled model) and benchmark architectures, built config-only under `tmp`."""
    from pathlib import Path

    from engines.common.demo import demo_model_path
    from harness.bench.engines import build_model

    if models:
        folders = [m for m in models.split(",") if m]
        missing = [m for m in folders if not (Path(m) / "config.json").is_file()]
        if missing:
            print(f"harness.bench.cpu_ops: --models {missing[0]}: no config.json there; give a model folder")
            return None
        return folders
    folders = []
    for arch in default:
        if arch == "demo":
            folders.append(str(demo_model_path()))
        else:
            folders.append(str(Path(tmp) / f"{arch}-shaped"))
            build_model(Path(folders[-1]), arch, config_only=True)
    return folders


def rows_table(models: str | None, rounds: int) -> int:
    import tempfile
    from pathlib import Path

    from engines.runtime.checkpoint import open_checkpoint
    from engines.runtime.shape import model_shape

    shown = (*_SMALL_ROWS, 2 * gemm.MIN_ROWS)
    with tempfile.TemporaryDirectory(prefix="pwbench-rows-") as tmp:
        folders = model_folders(models, tmp, ("mixtral",))
        if folders is None:
            return 2
        print(f"torch threads: {torch.get_num_threads()}; ms per call by rows, the median over {rounds} rounds; "
              f"packed MKL kernel from {gemm.MIN_ROWS} rows")
        for folder in folders:
            config = open_checkpoint(folder, config_only=True).config
            shape = model_shape(config, 4)
            mats = model_matrices(shape, config.mla)
            seconds = model_gemm_seconds(shape, rounds, mla=config.mla)
            seconds["dequantized"] = dequantized_gemm_seconds(shape, static_group_size(shape), rounds)
            parts = (*MODEL_ROWS, "dequantized")
            print(f"\n{Path(folder).name}: " + "; ".join(
                f"{part} " + " + ".join(f"[{n}, {k}]" for n, k in mats[part]) for part in MODEL_ROWS)
                + " (dequantized: the expert's GEMMs right after dequantizing it, as static-* on the CPU)")
            print(f"{'rows':>5} " + " ".join(f"{part:>11}" for part in parts))
            for r in shown:
                print(f"{r:>5} " + " ".join(f"{seconds[part][str(r)] * 1e3:>11.3f}" if seconds[part] else f"{'-':>11}"
                                            for part in parts))
    return 0


def dequant_table(models: str | None, rounds: int) -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pwbench-dequant-") as tmp:
        folders = model_folders(models, tmp, ("demo", "mixtral", "deepseek_v3"))
        if folders is None:
            return 2
        rows = dequant_rows(folders, rounds)
    bits = sorted({b for *_, sec in rows for b in sec}, key=int)
    print(f"one expert dequantized (both matrices, float32), ms and GB/s of full-width bytes; {rounds} round(s), "
          "one fresh process per setting and round")
    print(f"{'model':<20} {'setting':<7} {'group':>5} {'MB':>6} " + " ".join(f"{b + ' bits':>17}" for b in bits))
    for name, setting, group, nbytes, sec in sorted(rows, key=lambda r: (r[0], r[1])):
        cells = " ".join(f"{sec[b] * 1e3:>7.3f} ({nbytes / sec[b] / 1e9:>4.2f}) " for b in bits)
        print(f"{name:<20} {setting:<7} {group:>5} {nbytes / 1e6:>6.2f} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

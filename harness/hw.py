"""`pwbench hw`: measure this machine's peaks, cache them, and know the datasheet ones.

Measured: device memory bandwidth (a large copy counts read + write), matmul FLOP/s per
dtype, and on CUDA host->device / device->host bandwidth with pinned memory; on CPU the
memory bandwidth and float32 matmul rate. Efficiency metrics (MBU, MFU, link use) take
measured peaks when this machine has them cached, datasheet ones otherwise, and say which.
"""

from __future__ import annotations

import itertools
import json
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

# Where measurements are cached and how they are read live beside the engines' cost model,
# which reads them too (engines import no harness).
from engines.common.peaks import cache_path, cpu_model, names_device
from engines.common.peaks import cached_peaks as load_cached

# NVIDIA datasheets (dense tensor-core rates, no sparsity); PCIe per direction, theoretical.
# H200/H100/PCIe Gen5 figures as in the pwbench brief; an H200 measures ~790 TFLOP/s bf16.
DATASHEET: dict[str, dict[str, float]] = {
    "H200": {"memory_bandwidth_bytes_per_s": 4.8e12, "matmul_flops_per_s": 989e12, "h2d_bytes_per_s": 63e9},
    "H100": {"memory_bandwidth_bytes_per_s": 3.35e12, "matmul_flops_per_s": 989e12, "h2d_bytes_per_s": 63e9},
    "A100": {"memory_bandwidth_bytes_per_s": 2.039e12, "matmul_flops_per_s": 312e12, "h2d_bytes_per_s": 31.5e9},
    "L4": {"memory_bandwidth_bytes_per_s": 300e9, "matmul_flops_per_s": 121e12, "h2d_bytes_per_s": 31.5e9},
    "A10G": {"memory_bandwidth_bytes_per_s": 600e9, "matmul_flops_per_s": 125e12, "h2d_bytes_per_s": 31.5e9},
    "RTX 6000 Ada": {"memory_bandwidth_bytes_per_s": 960e9, "matmul_flops_per_s": 364e12, "h2d_bytes_per_s": 31.5e9},
}


def datasheet_for(device_name: str | None) -> tuple[str, dict[str, float]] | None:
    if not device_name:
        return None
    # A key matches as a whole word ("NVIDIA L4", "NVIDIA A100-SXM4-80GB"); longest key first.
    key = next((k for k in sorted(DATASHEET, key=len, reverse=True) if names_device(k, device_name)), None)
    return (key, DATASHEET[key]) if key else None


def _timeit(fn, repeats: int = 5, min_s: float = 0.1, warmup: int = 3) -> float:
    """Median time of `fn` over at least `repeats` calls and `min_s` seconds (these machines
    are noisy: a median of a few milliseconds' calls follows a neighbour's burst), after
    `warmup` calls (the first calls of a large gather fault its pages in: ~3x slower)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    while len(times) < repeats or sum(times) < min_s:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


# The host's speed: this host (a VM sharing its cores) runs the same CPU work 1.5-1.7x slower in some
# seconds than in others (a fixed pure-Python loop: 15 ms in some seconds, 23-25 ms in others;
# docs/simulation-validation.md). `host_speed` times a reference loop against the fastest this CPU ever
# ran it (kept in the cache folder beside hw.json), so a benchmark can say at what speed a run ran.
SPEED_FILE, SPEED_LOOP = "cpu-speed.json", 40_000


def _reference_loop_s() -> float:
    """This thread's CPU time for a fixed pure-Python loop (~2-4 ms here): the host's speed now."""
    t = time.thread_time()
    acc = 0
    for i in range(SPEED_LOOP):
        acc += i * i % 7
    return time.thread_time() - t


def host_speed(record: bool = True) -> float:
    """The host's speed now against the fastest seen on this CPU (1.0: as fast; 0.6: the same work
    takes 1/0.6 as long), the faster of two timings of the reference loop; with `record` a faster time
    than any before is kept."""
    from engines.common.folders import cache_dir  # noqa: PLC0415

    path = cache_dir() / SPEED_FILE
    try:
        best_all = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        best_all = {}
    if not isinstance(best_all, dict):
        best_all = {}
    now = min(_reference_loop_s() for _ in range(2))
    key = cpu_model()
    best = best_all.get(key)
    if not isinstance(best, (int, float)) or best <= 0 or now < best:
        best = now
        if record:
            best_all[key] = now
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(best_all))
            tmp.replace(path)
    return best / now


class PeakProbe:
    """The roofline's two peaks on this CPU in a few tens of milliseconds (a 64 MiB copy and
    a 1024^3 float32 matmul, each the median of three), so a benchmark can pair every step
    with the machine's speed right after it: a shared machine's speed drifts by a fifth
    within seconds, more than any one measurement taken at a run's start can stand for."""

    def __init__(self) -> None:
        import torch  # noqa: PLC0415

        self.src = torch.ones((64 << 20) // 4)
        self.dst = torch.empty_like(self.src)
        self.a, self.b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        self()  # first touch of the buffers, outside any measurement

    def __call__(self) -> dict[str, float]:
        import torch  # noqa: PLC0415

        def median(fn) -> float:  # warm already: the constructor touched the buffers
            return _timeit(fn, repeats=3, min_s=0.0, warmup=0)

        return {"memory_bandwidth_bytes_per_s": 2 * self.src.numel() * 4 / median(lambda: self.dst.copy_(self.src)),
                "matmul_flops_per_s": 2 * 1024**3 / median(lambda: torch.mm(self.a, self.b))}


def measure(device: str = "cpu") -> dict[str, Any]:
    import torch  # noqa: PLC0415

    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    out: dict[str, Any] = {"device": device, "cpu_model": cpu_model(),
                           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    n = (256 << 20) // 4 if dev.type == "cpu" else (1 << 30) // 4
    src = torch.empty(n, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        sync()

    out["memory_bandwidth_bytes_per_s"] = 2 * src.numel() * 4 / _timeit(copy)
    dtypes = [torch.float32] if dev.type == "cpu" else [torch.bfloat16, torch.float16, torch.float32]
    size = 1024 if dev.type == "cpu" else 8192
    for dtype in dtypes:
        a = torch.randn(size, size, device=dev).to(dtype)
        b = torch.randn(size, size, device=dev).to(dtype)

        def mm() -> None:
            torch.mm(a, b)
            sync()

        out[f"matmul_{str(dtype).removeprefix('torch.')}_flops_per_s"] = 2 * size**3 / _timeit(mm)
    out["matmul_flops_per_s"] = out[f"matmul_{str(dtypes[0]).removeprefix('torch.')}_flops_per_s"]
    # The same matmul with few rows (a decode batch, an expert's share of it): below the peak.
    # A step reads each weight once, from memory, not from a cache that the previous call
    # filled: the calls rotate through copies of the weight larger together than the caches
    # (96 MiB; on these CPUs the cached rate is 10-25% higher).
    elem = torch.empty((), dtype=dtypes[0]).element_size()
    copies = max(2, -(-(96 << 20) // (size * size * elem)))
    weights = [torch.randn(size, size, device=dev).to(dtypes[0]) for _ in range(copies)]
    at_rows = {}
    for rows in (1, 2, 4, 8, 32, 128, 512):  # 1-4: a small decode batch's rows per expert
        a = torch.randn(rows, size, device=dev).to(dtypes[0])
        turn = itertools.cycle(weights)

        def few() -> None:
            torch.mm(a, next(turn))
            sync()

        at_rows[str(rows)] = 2 * rows * size * size / _timeit(few)
    out["matmul_flops_at_rows"] = {**at_rows, str(size): out["matmul_flops_per_s"]}
    del weights
    # Greedy sampling as the runtime does it: a row-wise argmax over a decode batch's logits
    # (256 rows x 32,000).
    from engines.runtime.sampling import greedy  # noqa: PLC0415

    logits = torch.randn(256, 32000, device=dev)

    def argmax() -> None:
        greedy(logits)
        sync()

    out["argmax_bytes_per_s"] = logits.numel() * 4 / _timeit(argmax)
    # The elementwise kernels of an expert layer as the runtime runs them, at a decode batch's
    # size (256 tokens: their activations stay in cache) and a prefill step's (8192 tokens:
    # they stream through memory, ~2.5x slower here): gather 2 assignment rows per token, the
    # activation and the product over the [2T, 768] halves, the weighted scatter-add back
    # (bytes read + written, summed).
    at_tokens = {}
    for tokens in (256, 8192):
        hid = torch.randn(tokens, 512, device=dev)
        rows = torch.randint(0, tokens, (2 * tokens,), device=dev)
        gate, up = torch.randn(2 * tokens, 768, device=dev), torch.randn(2 * tokens, 768, device=dev)
        down_out, acc = torch.randn(2 * tokens, 512, device=dev), torch.zeros(tokens, 512, device=dev)
        reps = max(1, 2560 // tokens)

        def elementwise() -> None:
            for _ in range(reps):
                hid[rows]
                torch.nn.functional.silu(gate) * up
                acc.index_add_(0, rows, down_out)
            sync()

        moved = 2 * tokens * (2 * 512 + 2 * 768 + 3 * 768 + 3 * 512)  # elements: gather, silu, product, scatter
        at_tokens[str(tokens)] = reps * moved * 4 / _timeit(elementwise)
    out["elementwise_bytes_per_s"] = at_tokens["256"]
    out["elementwise_bytes_per_s_at_tokens"] = at_tokens
    # Decode attention as the runtime runs it: engines/runtime/attention.py's paged_attention
    # over a paged cache (on CPU the in-place C kernel where it builds, else the gather and
    # SDPA); 256 sequences of 64 keys, 4 KV heads of 64 with 4 query heads each, blocks of 16.
    # The rate: K and V bytes attended (each once) per second.
    from engines.runtime.attention import AttentionBatch, DecodeGroup, paged_attention  # noqa: PLC0415
    from engines.runtime.kv_cache import PagedKVCache  # noqa: PLC0415

    seqs, ctx, kvh, hd, bs = 256, 64, 4, 64, 16
    cache = PagedKVCache(1, 4096, bs, kvh, hd, torch.float32, torch.device(dev))
    for pool in cache.k + cache.v:
        pool.normal_()
    tables = torch.randperm(4096, device=dev)[: seqs * ctx // bs].view(seqs, ctx // bs)
    lengths = torch.full((seqs,), ctx, device=dev)
    batch = AttentionBatch(torch.zeros(seqs, dtype=torch.long, device=dev), seqs, [DecodeGroup(0, tables, lengths, bs)])
    q, kv_new = torch.randn(seqs, 4 * kvh, hd, device=dev), torch.randn(seqs, kvh, hd, device=dev)

    def decode_attention() -> None:
        paged_attention(q, kv_new, kv_new, cache, 0, batch, None)
        sync()

    out["decode_attention_bytes_per_s"] = 2 * kvh * seqs * ctx * hd * 4 / _timeit(decode_attention)
    # Prefill attention: causal SDPA over one 128-token chunk (16 query heads over 4 KV heads of
    # 64), as the runtime calls it per chunk; FLOPs 4 x heads x head_dim per key-query pair.
    n = 128
    qp = torch.randn(1, 16, n, hd, device=dev)
    kp, vp = torch.randn(1, 4, n, hd, device=dev), torch.randn(1, 4, n, hd, device=dev)

    def prefill_attention() -> None:
        for _ in range(10):
            torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        sync()

    out["prefill_attention_flops_per_s"] = 10 * 4 * 16 * hd * n * (n + 1) / 2 / _timeit(prefill_attention)
    # Decode-shaped matmuls: a few rows against many distinct weight matrices (each read once,
    # not cached), as experts run in a decode step; the rate weights stream through them.
    rows, w = 8, torch.randn(64, 1536, 512, device=dev)
    xs = torch.randn(rows, 512, device=dev)

    def skinny() -> None:
        for e in range(w.shape[0]):
            torch.mm(xs, w[e].t())
        sync()

    out["skinny_matmul_bytes_per_s"] = w.numel() * 4 / _timeit(skinny)
    # What one small torch call costs to dispatch (the cost model's per-call overhead).
    tiny = torch.ones(8, device=dev)

    def calls() -> None:
        for _ in range(1000):
            torch.mul(tiny, tiny)
        sync()

    out["op_overhead_s"] = _timeit(calls) / 1000
    if dev.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(dev)
        host = torch.empty((256 << 20) // 4, dtype=torch.float32).pin_memory()
        on_dev = torch.empty(host.numel(), dtype=torch.float32, device=dev)

        def h2d() -> None:
            on_dev.copy_(host, non_blocking=True)
            sync()

        def d2h() -> None:
            host.copy_(on_dev, non_blocking=True)
            sync()

        out["h2d_bytes_per_s"] = host.numel() * 4 / _timeit(h2d)
        out["d2h_bytes_per_s"] = host.numel() * 4 / _timeit(d2h)
    else:
        out["device_name"] = cpu_model()
        # With the engines' host allocator setting, as a CPU engine runs (its dequantizations' temporaries
        # reused, not returned to the kernel and faulted in again).
        from engines.runtime.memory import keep_freed_host_memory  # noqa: PLC0415

        keep_freed_host_memory()
        expert = reference_expert()  # built once (quantized at every width) for both measurements
        out["dequant_full_bytes_per_s_by_bits"] = measure_cpu_dequant(expert)
        out["dequant_group_bytes_per_s"] = measure_cpu_group_dequant(expert)
    return out


DEQUANT_BITS = (2, 3, 4, 8)
# Experts of one width in one layer that pagedweight's CPU path dequantizes in one stacked call.
DEQUANT_GROUPS = (1, 2, 4, 8, 16)


def reference_expert() -> tuple[Any, Any, Any]:
    """The expert the CPU dequantization is timed on: gate_up [1536, 512] and down [512, 768]
    (seed 0), and pagedweight's bit-plane store of it at 16 bits and DEQUANT_BITS (group 32)."""
    import torch  # noqa: PLC0415

    from engines.pagedweight.formats import make_store  # noqa: PLC0415  (heavy: only when measuring)

    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(1536, 512, generator=gen), torch.randn(512, 768, generator=gen)
    return gate_up, down, make_store("bitplanes", gate_up, down, (16, *DEQUANT_BITS), 32)


def measure_cpu_dequant(expert: tuple[Any, Any, Any] | None = None) -> dict[str, dict[str, float]]:
    """The CPU reference's dequantization, as the runtime runs it for a quantized expert on this
    machine: an expert's [1536, 512] gate_up matrix at each width of DEQUANT_BITS (group 32), RTN
    records through engines/quant's `dequantize` (static-* and pagedweight's re-quantize) and
    pagedweight's bit planes through its version's `weights`; the full-width float32 bytes
    written per second. {scheme: {bits: bytes/s}}; the cost model prices a quantized expert's
    dequantization on a shared processor by it (engines/sim/calibrate.py, dequant_cpu_*)."""
    import torch  # noqa: PLC0415

    from engines.quant.qweight import dequantize, quantize_rtn  # noqa: PLC0415

    gate_up, _, planes = expert or reference_expert()
    full = gate_up.numel() * 4
    out: dict[str, dict[str, float]] = {"packed": {}, "bitplanes": {}}
    for bits in DEQUANT_BITS:
        record = quantize_rtn(gate_up, bits, 32)
        out["packed"][str(bits)] = full / _timeit(lambda r=record: dequantize(r, torch.float32), min_s=0.05)
        version = planes.version(bits)
        # both matrices (gate_up + down = 2 x the bytes of gate_up's [1536, 512])
        out["bitplanes"][str(bits)] = 2 * full / _timeit(lambda v=version: v.weights(torch.float32), min_s=0.05)
    return out


def measure_cpu_group_dequant(expert: tuple[Any, Any, Any] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """pagedweight's bit planes dequantized as its backend runs a layer's experts of one width:
    G experts' planes stacked and dequantized in one call (`BitPlaneStore.group_weights`), the
    same [1536, 512] + [512, 768] expert as `measure_cpu_dequant`, at each G of DEQUANT_GROUPS and
    each width of DEQUANT_BITS; full-width float32 bytes written per second, by the group's
    full-width bytes (G x 4.7 MB: what decides whether its temporaries stay in the caches, for any
    expert shape). On this CPU they leave the caches as the group grows: per expert, G = 16 took
    ~1.9x G = 1's time at 8 bits. {"bitplanes": {bits: {group full-width bytes: bytes/s}}}."""
    import torch  # noqa: PLC0415

    gate_up, down, store = expert or reference_expert()
    full = (gate_up.numel() + down.numel()) * 4
    out: dict[str, dict[str, float]] = {}
    for bits in DEQUANT_BITS:
        parts = store.parts(bits)
        out[str(bits)] = {}
        for g in DEQUANT_GROUPS:
            seconds = _timeit(lambda p=[parts] * g, b=bits: store.group_weights(p, b, torch.float32),
                              repeats=5, min_s=0.05, warmup=1)
            out[str(bits)][str(g * full)] = g * full / seconds
    return {"bitplanes": out}


def fresh_process(fn: Any, *args: Any) -> Any:
    """`fn(*args)` in a fresh interpreter (spawned: nothing inherited but the environment and the CPU
    affinity): what a run leaves in a process (engines not yet collected, allocator and torch caches)
    slows the next run there (the bundled model's repeats in one process took 0.27 -> 0.36 s, 0.57 ->
    0.95 s of step CPU time one after another), and one process's timings differ from the next's."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def save_cached(entry: dict[str, Any]) -> None:
    data = load_cached()
    data[entry["device_name"]] = entry
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def peaks_for(device_name: str | None) -> dict[str, Any]:
    """Measured peaks for this device if cached, else the datasheet's, with `source` saying which."""
    cached = load_cached().get(device_name or "")
    if cached:
        return {**cached, "source": f"measured by pwbench hw at {cached.get('measured_at')}"}
    sheet = datasheet_for(device_name)
    if sheet:
        return {**sheet[1], "source": f"datasheet ({sheet[0]})"}
    return {"source": "none: run `pwbench hw` on this machine to measure peaks"}

"""Decode attention on CPU that reads the paged KV pool in place: a small C kernel.

The torch path (engines/runtime/attention.py) gathers each sequence's blocks into a padded
[K, N, L, hd] copy and runs SDPA over it. For decode on CPU that is three passes over the KV
through memory (gather read, gather write, SDPA read), and SDPA's CPU kernel is slow at this
shape (4 query rows per problem, ~100 keys): at 256 sequences the two took ~60 ms of a
~240 ms decode step of the benchmark model, most of the gap to the roofline left after the
matmuls. This kernel walks each (sequence, KV head)'s blocks through its table and computes
scores, softmax and the weighted sum of values in one pass over the keys and one over the
values, the G query heads sharing a KV head together (each key row loaded once for all of
them). `python -m harness.bench.cpu_ops` times it against the torch path.

It is plain C (no torch headers), compiled once per machine with the system C compiler into
the user cache (`~/.cache/pwbench/kernels`, or $PWBENCH_CACHE/kernels) and called through
ctypes with the tensors' pointers; ctypes releases the GIL and OpenMP spreads the (sequence,
head) pairs over torch's thread count. Where there is no compiler, or the build fails, the
torch path runs (`available()` is False, and says why in `unavailable_reason()`).

Results equal the torch path's to float32 rounding, not bitwise (the sums run in another
order); tests/unit/test_cpu_attention.py checks it against SDPA over gathered blocks.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* glibc's libmvec has vector expf variants; <math.h> declares them only under -ffast-math,
   which would also set flush-to-zero for the whole process (crtfastmath), so say it here. */
#pragma omp declare simd notinbranch
float expf(float);

/* One (sequence, KV head) pair: G query rows q [G, D] against the keys lo <= t < hi listed
   block by block in `table`; s: G * (hi - lo) floats of scratch; o [G, DV]. Inlined with D
   and DV constant for the common head sizes, so the inner loops compile to straight vector code. */
static inline __attribute__((always_inline)) void pair(
        const float *restrict qi, const float *restrict k_pool, const float *restrict v_pool,
        const int64_t *restrict table, int64_t start, int64_t stop, int64_t h, float *restrict o,
        float *restrict s, const int64_t G, const int64_t D, const int64_t DV, int64_t NB, int64_t B,
        float scale) {
    const int64_t L = stop - start;
    memset(o, 0, sizeof(float) * G * DV);
    if (L <= 0) return;
    for (int64_t b = start / B; b * B < stop; ++b) {  /* scores: each key row read once for all G */
        const int64_t t0 = b * B > start ? b * B : start, t1 = (b + 1) * B < stop ? (b + 1) * B : stop;
        const float *restrict kb = k_pool + (h * NB + table[b]) * B * D;
        for (int64_t t = t0; t < t1; ++t) {
            const float *restrict kr = kb + (t - b * B) * D;
            for (int64_t g = 0; g < G; ++g) {
                const float *restrict qg = qi + g * D;
                float acc = 0.0f;
                #pragma omp simd reduction(+:acc)
                for (int64_t d = 0; d < D; ++d) acc += qg[d] * kr[d];
                s[g * L + (t - start)] = acc * scale;
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) {  /* softmax per query row */
        float *restrict sg = s + g * L;
        float m = sg[0], sum = 0.0f;
        for (int64_t j = 1; j < L; ++j) m = sg[j] > m ? sg[j] : m;
        #pragma omp simd reduction(+:sum)
        for (int64_t j = 0; j < L; ++j) { sg[j] = expf(sg[j] - m); sum += sg[j]; }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < L; ++j) sg[j] *= inv;
    }
    for (int64_t b = start / B; b * B < stop; ++b) {  /* the weighted sum of values */
        const int64_t t0 = b * B > start ? b * B : start, t1 = (b + 1) * B < stop ? (b + 1) * B : stop;
        const float *restrict vb = v_pool + (h * NB + table[b]) * B * DV;
        for (int64_t t = t0; t < t1; ++t) {
            const float *restrict vr = vb + (t - b * B) * DV;
            for (int64_t g = 0; g < G; ++g) {
                const float p = s[g * L + (t - start)];
                float *restrict og = o + g * DV;
                #pragma omp simd
                for (int64_t d = 0; d < DV; ++d) og[d] += p * vr[d];
            }
        }
    }
}

/* q [N, K, G, D]; k_pool [K, NB, B, D]; v_pool [K, NB, B, DV]; tables [N, T] (block ids);
   keys lo[n] <= t < hi[n] of sequence n attend; out [N, K, G, DV]. All contiguous. */
void paged_decode_attention(const float *restrict q, const float *restrict k_pool,
                            const float *restrict v_pool, const int64_t *restrict tables,
                            const int64_t *restrict lo, const int64_t *restrict hi, float *restrict out,
                            int64_t N, int64_t K, int64_t G, int64_t D, int64_t DV, int64_t NB,
                            int64_t B, int64_t T, float scale, int threads) {
    int64_t longest = 0;
    for (int64_t n = 0; n < N; ++n) longest = hi[n] - lo[n] > longest ? hi[n] - lo[n] : longest;
    #pragma omp parallel num_threads(threads)
    {
        float *s = (float *)malloc(sizeof(float) * (G * longest + 1));
        #pragma omp for schedule(dynamic, 8)
        for (int64_t i = 0; i < N * K; ++i) {
            const int64_t n = i / K, h = i % K;
            const float *qi = q + i * G * D;
            float *o = out + i * G * DV;
            const int64_t *table = tables + n * T;
            if (G == 4 && D == 64 && DV == 64)
                pair(qi, k_pool, v_pool, table, lo[n], hi[n], h, o, s, 4, 64, 64, NB, B, scale);
            else if (D == 64 && DV == 64)
                pair(qi, k_pool, v_pool, table, lo[n], hi[n], h, o, s, G, 64, 64, NB, B, scale);
            else if (D == 128 && DV == 128)
                pair(qi, k_pool, v_pool, table, lo[n], hi[n], h, o, s, G, 128, 128, NB, B, scale);
            else
                pair(qi, k_pool, v_pool, table, lo[n], hi[n], h, o, s, G, D, DV, NB, B, scale);
        }
        free(s);
    }
}
"""

_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno",
          "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros", "-ffinite-math-only", "-freciprocal-math"]
_LIBS = ["-lmvec", "-lm"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why the kernel is unavailable, once tried


def _cache_dir() -> Path:
    root = os.environ.get("PWBENCH_CACHE")
    return Path(root) / "kernels" if root else Path.home() / ".cache" / "pwbench" / "kernels"


def _cpu() -> str:
    """What -march=native compiled for: the CPU's model and flags (a cached build is per CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    key = hashlib.sha256("\0".join([_SOURCE, cc, *_FLAGS, platform.machine(), _cpu()]).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"paged_decode_attention-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            src, built = Path(tmp) / "kernel.c", Path(tmp) / "kernel.so"
            src.write_text(_SOURCE)
            done = subprocess.run([cc, *_FLAGS, str(src), "-o", str(built), *_LIBS], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
            os.replace(built, lib)  # whole or not at all: a concurrent build replaces it with the same bytes
    so = ctypes.CDLL(str(lib))
    fn = so.paged_decode_attention
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_int]
    return so


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    global _lib, _reason
    with _lock:
        if _lib is None and _reason is None:
            try:
                _lib = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                _reason = str(err)
    return _lib is not None


def unavailable_reason() -> str | None:
    return None if available() else _reason


_off = threading.local()


@contextlib.contextmanager
def turned_off():
    """Within it (this thread), decode attention takes the torch path: to time or check one against the other."""
    _off.on = True
    try:
        yield
    finally:
        _off.on = False


def applies(q: Tensor, k_pool: Tensor, v_pool: Tensor) -> bool:
    """This kernel covers float32 CPU tensors with contiguous pools."""
    return (q.device.type == "cpu" and q.dtype == k_pool.dtype == v_pool.dtype == torch.float32
            and k_pool.is_contiguous() and v_pool.is_contiguous() and not getattr(_off, "on", False) and available())


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, lo: Tensor, hi: Tensor,
                           scale: float) -> Tensor:
    """q [N, K, G, D] (the G query heads of each KV head together) against the pools [K, NB, B, D]
    / [K, NB, B, DV] through block tables [N, T]: sequence n attends keys lo[n] <= t < hi[n]
    -> [N, K, G, DV]."""
    N, K, G, D = q.shape
    _, NB, B, DV = v_pool.shape
    q = q.contiguous()
    tables = tables.to(torch.int64).contiguous()
    lo, hi = lo.to(torch.int64).contiguous(), hi.to(torch.int64).contiguous()
    if _lib is None:
        raise RuntimeError("cpu_attention: the kernel is not loaded; check applies() first")
    if N and (int(hi.max()) > tables.shape[1] * B or int(lo.min()) < 0):
        raise ValueError(f"cpu_attention: keys up to {int(hi.max())} for tables of {tables.shape[1]} blocks of {B}")
    out = q.new_empty(N, K, G, DV)
    _lib.paged_decode_attention(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(), lo.data_ptr(),
                                hi.data_ptr(), out.data_ptr(), N, K, G, D, DV, NB, B, tables.shape[1], scale,
                                torch.get_num_threads())
    return out

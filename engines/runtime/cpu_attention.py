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

# The kernel's C source, shipped beside this module as package data.
_SOURCE = (Path(__file__).parent / "cpu_attention.c").read_text()

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
            done = subprocess.run([cc, *_FLAGS, str(src), "-o", str(built), *_LIBS], capture_output=True, text=True,
                                  check=False)
            if done.returncode != 0:
                raise RuntimeError(
                    f"{cc} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
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

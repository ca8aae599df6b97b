"""Device memory of the runtime: how many KV blocks an engine gets, decided in one place.

`kv_cache_blocks` is the sizing step that runs after the weights are loaded (vLLM's
"profile, then size the KV cache"): an explicit block count, an explicit KV budget, on CUDA
what `gpu_memory_utilization` leaves free, on CPU a fixed 1 GiB; never more than
`max_num_seqs` full-length sequences can use. The allocator's capacity can then be lowered and
raised between steps (BlockAllocator.set_capacity) when another tenant needs the memory.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from engines.base import EngineError

CPU_KV_BYTES = 1 << 30

# glibc's malloc for a CPU engine's host memory (`keep_freed_host_memory`): mallopt parameters
# (malloc.h) and the values set. By default glibc maps every block above a threshold (128 KiB at
# first) with mmap and unmaps it on free, raising the threshold to the largest block freed so far,
# and gives the heap's free top back to the kernel above twice that: until a process has seen its
# largest activations, a step can map fresh pages and fault every one of them in again. Growing
# tensors of 1-30 MiB: 119,115 page faults with the defaults, ~16,000-17,000 with these
# (tests/unit/test_host_memory.py). On the bundled model's prefill the effect is smaller and
# irregular: `python -m harness.bench.cpu_ops --host-malloc` saw 781-1,532 faults over nine
# batches with these against 1,125-8,171 with the defaults, and per-token prefill times within
# the host's noise except where the defaults faulted most (docs/moe.md).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
HOST_MALLOC = {_M_MMAP_THRESHOLD: 32 << 20,  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit): blocks below come
               _M_TRIM_THRESHOLD: 1 << 30,   # from the heap, and up to 1 GiB of its free top is kept for reuse;
               _M_TOP_PAD: 64 << 20}         # the heap grows 64 MiB beyond a request at a time
_HOST_MALLOC_SET: bool | None = None


def keep_freed_host_memory() -> bool:
    """Set glibc's malloc (HOST_MALLOC) so that freed host memory is reused rather than returned to
    the kernel and faulted in again: process-wide, once; the memory a step needed stays with the
    process, as a GPU caching allocator keeps device memory. A measured CPU engine calls it at start.
    False (nothing changed) where the C library is not glibc, or the user chose the allocator's
    settings (MALLOC_* variables, glibc.malloc tunables, or LD_PRELOAD of another allocator: jemalloc, tcmalloc),
    or asked for glibc's defaults (PWBENCH_HOST_MALLOC=glibc)."""
    global _HOST_MALLOC_SET
    if _HOST_MALLOC_SET is None:
        chosen = (any(k.startswith("MALLOC_") for k in os.environ) or "malloc" in os.environ.get("GLIBC_TUNABLES", "")
                  or os.environ.get("LD_PRELOAD") or os.environ.get("PWBENCH_HOST_MALLOC") == "glibc")
        try:  # the process's own symbols (dlopen(NULL)): libc's where it is loaded, with no ldconfig run
            mallopt = None if chosen else ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):  # not glibc (macOS's libc has no mallopt)
            mallopt = None
        _HOST_MALLOC_SET = bool(mallopt) and all(mallopt(k, v) == 1 for k, v in HOST_MALLOC.items())
    return _HOST_MALLOC_SET


@dataclass(frozen=True)
class KVSizing:
    """The engine options that size the KV cache (fields of MoEEngineConfig)."""

    block_size: int
    kv_cache_gb: float | None
    kv_blocks: int | None
    gpu_memory_utilization: float
    max_num_seqs: int
    max_model_len: int  # the model's positions, capped by the engine's max_model_len option


def kv_blocks_in_budget(sizing: KVSizing, block_bytes: int, kv_bytes: int) -> int:
    """Blocks for the KV cache when a device budget leaves it `kv_bytes` (the caller checked
    that one block fits); never more than max_num_seqs full-length sequences can use."""
    most = sizing.max_num_seqs * -(-sizing.max_model_len // sizing.block_size)
    return max(1, min(kv_bytes // block_bytes, most))


def kv_cache_blocks(sizing: KVSizing, block_bytes: int, device: torch.device) -> int:
    """Blocks of `block_bytes` the KV cache gets on `device` (raises when not even one fits)."""
    if sizing.kv_cache_gb is not None:
        budget = int(sizing.kv_cache_gb * (1 << 30))
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - (1 - sizing.gpu_memory_utilization) * total)
    else:
        budget = CPU_KV_BYTES
    # No point holding more blocks than max_num_seqs full-length sequences can use.
    most = sizing.max_num_seqs * -(-sizing.max_model_len // sizing.block_size)
    num_blocks = sizing.kv_blocks if sizing.kv_blocks is not None else min(budget // block_bytes, most)
    if num_blocks < 1:
        raise EngineError(
            f"KV cache budget of {budget / 2**20:.1f} MiB cannot hold one block of {block_bytes} bytes; "
            "raise kv_cache_gb or gpu_memory_utilization"
        )
    return num_blocks

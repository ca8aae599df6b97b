"""Device memory of the runtime: how many KV blocks an engine gets, decided in one place.

`kv_cache_blocks` is the sizing step that runs after the weights are loaded (vLLM's
"profile, then size the KV cache"): an explicit block count, an explicit KV budget, on CUDA
what `gpu_memory_utilization` leaves free, on CPU a fixed 1 GiB; never more than
`max_num_seqs` full-length sequences can use. The allocator's capacity can then be lowered and
raised between steps (BlockAllocator.set_capacity) when another tenant needs the memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.base import EngineError

CPU_KV_BYTES = 1 << 30


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

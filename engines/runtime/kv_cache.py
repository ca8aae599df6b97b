"""Paged KV cache: fixed-size blocks in one pool per layer, a block table per sequence.

Token t of a sequence lives in slot `table[t // B] * B + t % B` of every layer's pool. Pools
are head-major, [K, num_blocks, B, hd], so a gather of block tables is already in the
[K, N, L, hd] layout attention consumes (no transpose copy). Blocks
are taken from a free list as a sequence grows and returned when it ends or is preempted,
so memory follows live tokens, not the longest possible request. The allocator is pure
Python (no torch), which lets the scheduler plan without touching the device.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class KVCache(Protocol):
    """What attention needs from a KV cache: write this step's K/V at flat slots, read K/V back
    for block tables. The paged device cache below is one; a host-side cache can be another."""

    block_size: int

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None: ...

    def gather(self, layer: int, tables: Tensor) -> tuple[Tensor, Tensor]: ...


class BlockAllocator:
    """Free-list allocator of block ids with per-sequence block tables.

    `capacity` (at most the pool's `num_blocks`) is how many blocks may be in use; it can be
    lowered and raised between steps (`set_capacity`), so memory can move between the KV cache
    and other tenants of a device budget. Lowered below what is in use, nothing is taken
    away here: the scheduler preempts until `over_capacity` is 0.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.capacity = num_blocks
        # Pop from the end: recently freed blocks are reused first (warm in cache).
        self._free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}

    def set_capacity(self, blocks: int) -> None:
        if not 0 <= blocks <= self.num_blocks:
            raise ValueError(f"KV capacity must be within [0, {self.num_blocks}] blocks, got {blocks}")
        self.capacity = blocks

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def over_capacity(self) -> int:
        """Blocks in use beyond the capacity (after it was lowered)."""
        return max(0, self.num_used - self.capacity)

    @property
    def num_free(self) -> int:
        """Blocks that may still be taken: within the capacity, not in use."""
        return max(0, self.capacity - self.num_used)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq_id: str, num_tokens: int) -> int:
        """Blocks to add so that `seq_id` covers positions [0, num_tokens)."""
        return max(0, self.blocks_for(num_tokens) - len(self.tables.get(seq_id, ())))

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        return self.extra_blocks(seq_id, num_tokens) <= self.num_free

    def grow(self, seq_id: str, num_tokens: int) -> None:
        need = self.extra_blocks(seq_id, num_tokens)
        if need > self.num_free:
            raise MemoryError(f"KV cache full: {seq_id} needs {need} blocks, {self.num_free} free")
        table = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            table.append(self._free.pop())

    def free(self, seq_id: str) -> None:
        self._free.extend(reversed(self.tables.pop(seq_id, [])))

    def tokens_fitting(self, seq_id: str, start: int) -> int:
        """How many tokens from position `start` on fit with the blocks held plus all free ones."""
        held = len(self.tables.get(seq_id, ()))
        return max(0, (held + self.num_free) * self.block_size - start)

    def slots(self, seq_id: str, start: int, length: int) -> list[int]:
        table, B = self.tables[seq_id], self.block_size
        return [table[p // B] * B + p % B for p in range(start, start + length)]


class PagedKVCache:
    """Device memory for K and V: per layer a pool [K, num_blocks, B, hd] each."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        # Zeros, not empty: attention reads unwritten slots of a sequence's last block and padded
        # table entries under a mask, and a masked NaN still poisons the output (0 * NaN = NaN).
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store new keys/values [T, K, hd] at flat slot indices [T]."""
        K, hd = k.shape[1], k.shape[2]
        self.k[layer].view(K, -1, hd)[:, slots] = k.transpose(0, 1)
        self.v[layer].view(K, -1, hd)[:, slots] = v.transpose(0, 1)

    def gather(self, layer: int, tables: Tensor) -> tuple[Tensor, Tensor]:
        """K and V for block tables [N, nb] as [K, N, nb*B, hd] (padded tables read block 0).
        index_select copies whole blocks; advanced indexing (pool[:, tables]) was ~1.2x slower."""
        n, nb = tables.shape
        flat = tables.reshape(-1)
        kp, vp = self.k[layer], self.v[layer]
        k = torch.index_select(kp, 1, flat).view(kp.shape[0], n, nb * self.block_size, kp.shape[-1])
        v = torch.index_select(vp, 1, flat).view(vp.shape[0], n, nb * self.block_size, vp.shape[-1])
        return k, v

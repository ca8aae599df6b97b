"""Paged KV cache: fixed-size blocks in one pool per layer, a block table per sequence.

Token t of a sequence lives in slot `table[t // B] * B + t % B` of every layer's pool. Pools
are head-major, [K, num_blocks, B, hd], so a gather of block tables is already in the
[K, N, L, hd] layout attention consumes (no transpose copy); what K and hd are per
architecture is ModelConfig.kv_cache_dims (MLA: one latent "head" plus the rope key). Blocks
are taken from a free list as a sequence grows and returned when it ends or is preempted,
so memory follows live tokens, not the longest possible request. The allocator is pure
Python (no torch), which lets the scheduler plan without touching the device.

Prefix cache (vLLM's automatic prefix caching): a full, computed block is registered under a
hash of its tokens chained to the hash of the block before it, so a later sequence with the
same leading tokens shares it (reference counted) instead of recomputing it. A registered
block nobody holds stays cached until its slot is needed, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from engines.runtime.config import ModelConfig


class KVCache(Protocol):
    """What attention needs from a KV cache: write this step's K/V at flat slots, read K/V back
    for block tables. The paged device cache below is one; a host-side cache can be another."""

    block_size: int

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None: ...

    def gather(self, layer: int, tables: Tensor) -> tuple[Tensor, Tensor]: ...

    def pools(self, layer: int) -> tuple[Tensor, Tensor]:
        """The K and V pools [K, num_blocks, B, hd] themselves, for attention that reads blocks in place."""
        ...


class BlockAllocator:
    """Block ids for per-sequence block tables, with reference counts and a prefix cache.

    A block is free (holds nothing), in use (in one or more tables: a block registered under
    its hash can be attached to another table), or cached (registered, in no table: its K/V
    kept for a later sequence with the same prefix).
    `capacity` (at most the pool's `num_blocks`) bounds the blocks held, in use + cached; it
    can be lowered and raised between steps (`set_capacity`), so memory can move between the
    KV cache and other tenants of a device budget. Lowered, cached blocks are dropped first;
    in-use blocks are never taken away here: the scheduler preempts until `over_capacity` is 0.
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
        self._refs = [0] * num_blocks  # tables holding each block
        self._hash_of: dict[int, int] = {}  # registered block -> its hash
        self._by_hash: dict[int, int] = {}  # hash -> the one block registered under it
        # Cached blocks (registered, in no table), least recently used first: taken, in that
        # order, once the free list is spent or the capacity reached.
        self._evictable: OrderedDict[int, None] = OrderedDict()

    def set_capacity(self, blocks: int) -> None:
        if not 0 <= blocks <= self.num_blocks:
            raise ValueError(f"KV capacity must be within [0, {self.num_blocks}] blocks, got {blocks}")
        self.capacity = blocks
        self._evict_over_capacity()

    @property
    def num_used(self) -> int:
        """Blocks in at least one table."""
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_held(self) -> int:
        """Blocks holding K/V now, in use or cached (what device_kv_bytes counts)."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Cached blocks: registered, in no table, evicted least recently used first."""
        return len(self._evictable)

    @property
    def over_capacity(self) -> int:
        """Blocks in use beyond the capacity (after it was lowered)."""
        return max(0, self.num_used - self.capacity)

    @property
    def num_free(self) -> int:
        """Blocks that may still be taken, free or cached, within the capacity."""
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
            table.append(self._take())

    def free(self, seq_id: str) -> None:
        """Drop `seq_id`'s table. A block no other table holds is cached if registered (the
        table's last block first in eviction order: a chain is useless without its head),
        else free again."""
        for block in reversed(self.tables.pop(seq_id, [])):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        self._evict_over_capacity()

    def tokens_fitting(self, seq_id: str, start: int) -> int:
        """How many tokens from position `start` on fit with the blocks held plus all free ones."""
        held = len(self.tables.get(seq_id, ()))
        return max(0, (held + self.num_free) * self.block_size - start)

    def slots(self, seq_id: str, start: int, length: int) -> list[int]:
        table, B = self.tables[seq_id], self.block_size
        return [table[p // B] * B + p % B for p in range(start, start + length)]

    # -- the prefix cache ------------------------------------------------------------------
    def lookup(self, hashes: Iterable[int]) -> list[int]:
        """The registered blocks of the longest leading run of `hashes` (up to the first miss)."""
        blocks = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_evictable(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` are cached in no table (attaching them lowers num_free by this)."""
        return sum(b in self._evictable for b in blocks)

    def attach(self, seq_id: str, blocks: list[int]) -> None:
        """Start `seq_id`'s table with registered `blocks` (from lookup), shared, not copied."""
        if seq_id in self.tables:
            raise ValueError(f"{seq_id} already has blocks; a cached prefix starts a table")
        unregistered = [b for b in blocks if b not in self._hash_of]
        if unregistered:
            raise ValueError(f"blocks {unregistered} are not in the prefix cache")
        if self.num_evictable(blocks) > self.num_free:
            raise MemoryError(f"KV cache full: {seq_id} cannot take back {len(blocks)} cached blocks")
        for block in blocks:
            self._evictable.pop(block, None)
            self._refs[block] += 1
        self.tables[seq_id] = list(blocks)

    def register(self, seq_id: str, index: int, block_hash: int) -> None:
        """Register block `index` of `seq_id`'s table (full, every position computed) under
        `block_hash`. A hash already registered keeps its block; this one stays private."""
        block = self.tables[seq_id][index]
        if block not in self._hash_of and block_hash not in self._by_hash:
            self._hash_of[block] = block_hash
            self._by_hash[block_hash] = block

    def drop_cached(self) -> int:
        """Empty the prefix cache: every cached block (registered, in no table) is free again and
        every registration is forgotten, so no later sequence finds a prefix computed before.
        Blocks in use stay, unregistered. Returns the cached blocks dropped."""
        dropped = len(self._evictable)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._by_hash.clear()
        return dropped

    def ref_count(self, block: int) -> int:
        """Tables holding `block`."""
        return self._refs[block]

    def registered_hash(self, block: int) -> int | None:
        """The hash `block` is registered under; None when it is not in the prefix cache."""
        return self._hash_of.get(block)

    def _take(self) -> int:
        if self.num_held < self.capacity:  # then the free list is not empty (capacity <= num_blocks)
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def _evict_over_capacity(self) -> None:
        while self.num_held > self.capacity and self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
            self._free.append(block)


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """The prefix-cache key of a full block: its tokens and the key of the block before it
    (None for a sequence's first), so equal keys mean equal prefixes up to the block's end.
    Python's hash of a tuple of ints is the same in every process (only str/bytes hashes are
    salted); -1 stands for "no parent" because hash() never returns -1."""
    return hash((-1 if parent is None else parent, tuple(token_ids)))


class PagedKVCache:
    """Device memory for K and V: per layer a pool [K, num_blocks, B, hd] each (V's last dim
    `value_dim` when it differs; MLA keeps its latent in the K pool and its rope key in V)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        value_dim: int | None = None,
    ) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        # Zeros, not empty: attention reads unwritten slots of a sequence's last block and padded
        # table entries under a mask, and a masked NaN still poisons the output (0 * NaN = NaN).
        self.k = [torch.zeros((num_kv_heads, num_blocks, block_size, head_dim), dtype=dtype, device=device)
                  for _ in range(num_layers)]
        self.v = [torch.zeros((num_kv_heads, num_blocks, block_size, value_dim), dtype=dtype, device=device)
                  for _ in range(num_layers)]
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.block_bytes = self.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype, value_dim)
        self._gathered: list[Tensor | None] = [None, None]  # gather's CPU buffers for K and V

    @classmethod
    def for_model(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> PagedKVCache:
        """The cache of `config`'s layers, in the layout its attention stores (config.kv_cache_dims)."""
        heads, key_dim, value_dim = config.kv_cache_dims
        return cls(config.num_layers, num_blocks, block_size, heads, key_dim, dtype, device, value_dim)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        value_dim: int | None = None) -> int:
        value_dim = head_dim if value_dim is None else value_dim
        return (num_layers * block_size * num_kv_heads * (head_dim + value_dim)
                * torch.empty((), dtype=dtype).element_size())

    @staticmethod
    def model_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block of `config`'s cache (block_size 1: KV bytes per token)."""
        heads, key_dim, value_dim = config.kv_cache_dims
        return PagedKVCache.bytes_per_block(config.num_layers, block_size, heads, key_dim, dtype, value_dim)

    def _scratch(self, which: int, numel: int) -> Tensor | None:
        """A reused buffer for gathered K (0) or V (1) on CPU, where a fresh one per call
        faults its pages in every time (~30% of a decode gather here); on CUDA the caching
        allocator already reuses memory (None: allocate)."""
        if self.k[0].device.type != "cpu":
            return None
        buf = self._gathered[which]
        if buf is None or buf.numel() < numel:
            with torch.inference_mode(False):  # written inside and outside inference mode
                buf = self._gathered[which] = torch.empty(numel, dtype=self.k[0].dtype)
        return buf[:numel]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store new keys/values [T, K, hd] at flat slot indices [T]."""
        K = k.shape[1]
        self.k[layer].view(K, -1, k.shape[2])[:, slots] = k.transpose(0, 1)
        self.v[layer].view(K, -1, v.shape[2])[:, slots] = v.transpose(0, 1)

    def pools(self, layer: int) -> tuple[Tensor, Tensor]:
        """Layer `layer`'s K and V pools, [K, num_blocks, B, hd] (what an in-place kernel reads)."""
        return self.k[layer], self.v[layer]

    def gather(self, layer: int, tables: Tensor) -> tuple[Tensor, Tensor]:
        """K and V for block tables [N, nb] as [K, N, nb*B, hd] (padded tables read block 0).
        On CPU they are views of buffers the next gather overwrites: use them before it."""
        kp, vp = self.pools(layer)
        blocks = tables.numel()
        return gather_tables(kp, vp, tables, self._scratch(0, blocks * kp[:, 0].numel()),
                             self._scratch(1, blocks * vp[:, 0].numel()))


def gather_tables(k_pool: Tensor, v_pool: Tensor, tables: Tensor, k_out: Tensor | None = None,
                  v_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """K and V of pools [K, num_blocks, B, d] for block tables [N, nb] as [K, N, nb*B, d] each
    (into `k_out` / `v_out` when given)."""
    n, nb = tables.shape
    rows = block_rows(k_pool, tables.reshape(-1))  # the V pool has the same heads and blocks
    k, v = gather_blocks(k_pool, rows, k_out), gather_blocks(v_pool, rows, v_out)
    return (k.view(k.shape[0], n, nb * k_pool.shape[2], k.shape[-1]),
            v.view(v.shape[0], n, nb * v_pool.shape[2], v.shape[-1]))


def block_rows(pool: Tensor, ids: Tensor) -> Tensor:
    """Where blocks `ids` [n] of every head lie in `pool` [K, num_blocks, ...] flattened to
    [K * num_blocks, ...]: [K * n] row indices, head-major, for gather_blocks."""
    K, num_blocks = pool.shape[:2]
    return (torch.arange(K, device=ids.device)[:, None] * num_blocks + ids[None, :]).reshape(-1)


def gather_blocks(pool: Tensor, rows: Tensor, out: Tensor | None = None) -> Tensor:
    """Blocks of `pool` [K, num_blocks, B, d] at `rows` (block_rows) as [K, n, B, d], into
    `out` when given. One index_select along the flattened first dim copies whole contiguous
    blocks; along dim 1 index_select takes its generic strided path, ~3x slower here (and
    advanced indexing, pool[:, ids], was slower still)."""
    flat = pool.view(-1, *pool.shape[2:])
    got = torch.index_select(flat, 0, rows, out=None if out is None else out.view(-1, *pool.shape[2:]))
    return got.view(pool.shape[0], -1, *pool.shape[2:])

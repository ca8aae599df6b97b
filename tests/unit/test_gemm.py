"""Packed GEMM weights (engines/runtime/gemm.py) and the KV block gather, against F.linear and
a loop over blocks as oracles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.runtime import gemm
from engines.runtime.kv_cache import PagedKVCache, block_rows, gather_blocks

needs_mkl = pytest.mark.skipif(not gemm.can_pack(torch.zeros(2, 2)), reason="torch without MKL")


@needs_mkl
@pytest.mark.parametrize("shape", [(1536, 512), (512, 768), (4000, 512), (64, 32), (96, 48)])
def test_packed_linear_is_f_linear_bitwise(shape):
    """One pack serves every row count; the output is F.linear's to the bit, so greedy tokens
    cannot depend on packing (below MIN_ROWS the call is F.linear itself)."""
    torch.manual_seed(0)
    w = torch.randn(shape)
    p = gemm.pack(w)
    assert isinstance(p, gemm.PackedWeight) and p.nbytes == w.numel() * 4
    for rows in (1, 2, 7, 15, 16, 17, 33, 64, 100, 256, 1000):
        x = torch.randn(rows, shape[1])
        assert torch.equal(gemm.linear(x, p), F.linear(x, w)), rows
    x = torch.randn(3, 20, shape[1])  # leading dims fold into rows
    assert torch.equal(gemm.linear(x, p), F.linear(x, w))
    with torch.inference_mode():  # the runtime's mode
        x = torch.randn(64, shape[1])
        assert torch.equal(gemm.linear(x, p), F.linear(x, w))


def test_what_is_not_packed_stays_plain():
    w = torch.randn(8, 4)
    for other in (w.double(), w.half(), w[None]):  # not float32, not 2-D: the tensor itself
        assert gemm.pack(other) is other
    assert gemm.packed_bytes([w, gemm.pack(w)]) == (32 * 4 if gemm.can_pack(w) else 0)
    x, b = torch.randn(20, 4), torch.randn(8)
    assert torch.equal(gemm.linear(x, gemm.pack(w), b), F.linear(x, w, b))  # a bias: F.linear
    assert torch.equal(gemm.linear(x, w), F.linear(x, w))


def test_gather_blocks_matches_a_loop():
    torch.manual_seed(0)
    K, nb, B, d = 3, 11, 4, 5
    pool = torch.randn(K, nb, B, d)
    ids = torch.tensor([7, 0, 7, 10, 3])
    want = torch.stack([torch.stack([pool[h, i] for i in ids.tolist()]) for h in range(K)])  # [K, n, B, d]
    rows = block_rows(pool, ids)
    assert rows.tolist() == [h * nb + i for h in range(K) for i in ids.tolist()]
    assert torch.equal(gather_blocks(pool, rows), want)
    out = torch.full((K * len(ids) * B * d,), float("nan"))
    got = gather_blocks(pool, rows, out)
    assert torch.equal(got, want) and got.data_ptr() == out.data_ptr()


def test_cache_gather_layout_and_reused_buffers():
    """[K, N, nb*B, hd] per table row, padded entries read block 0; on CPU the same buffers
    serve every call (sized to the largest)."""
    torch.manual_seed(0)
    cache = PagedKVCache(2, num_blocks=6, block_size=2, num_kv_heads=2, head_dim=3, dtype=torch.float32,
                         device=torch.device("cpu"), value_dim=4)
    for pool in cache.k + cache.v:
        pool.copy_(torch.randn(pool.shape))
    tables = torch.tensor([[5, 1], [2, 0]])
    k, v = cache.gather(1, tables)
    assert k.shape == (2, 2, 4, 3) and v.shape == (2, 2, 4, 4)
    for h in range(2):
        for s in range(2):
            assert torch.equal(k[h, s], torch.cat([cache.k[1][h, b] for b in tables[s].tolist()]))
            assert torch.equal(v[h, s], torch.cat([cache.v[1][h, b] for b in tables[s].tolist()]))
    ptr = k.data_ptr()
    k2, _ = cache.gather(0, tables[:1])
    assert k2.data_ptr() == ptr and torch.equal(k2[0, 0], torch.cat([cache.k[0][0, 5], cache.k[0][0, 1]]))

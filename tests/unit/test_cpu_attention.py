"""The CPU decode-attention kernel (engines/runtime/cpu_attention.py) against the torch path:
SDPA over blocks gathered into a padded copy, under the same length and window masks, and a
plain softmax loop for one pair by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engines.runtime import cpu_attention
from engines.runtime.attention import AttentionBatch, DecodeGroup, paged_attention
from engines.runtime.kv_cache import PagedKVCache

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason=f"the C kernel did not build: {cpu_attention.unavailable_reason()}")


def filled_cache(heads: int, head_dim: int, value_dim: int, blocks: int = 40, block_size: int = 4) -> PagedKVCache:
    torch.manual_seed(0)
    cache = PagedKVCache(1, blocks, block_size, heads, head_dim, torch.float32, torch.device("cpu"), value_dim)
    for pool in cache.k + cache.v:
        pool.normal_()
    return cache


def torch_path(q, cache, tables, ctx, window, scale):
    """SDPA over gathered blocks, GQA folded as the runtime folds it."""
    n, H, _ = q.shape
    kc, vc = cache.gather(0, tables)
    K = kc.shape[0]
    group = DecodeGroup(0, tables, ctx, cache.block_size)
    qg = q.view(n, K, H // K, -1).transpose(0, 1)
    o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=group.mask(window), scale=scale)
    return o.transpose(0, 1).reshape(n, H, -1)


@pytest.mark.parametrize("heads,group,head_dim,value_dim", [(2, 4, 64, 64), (1, 3, 24, 24), (4, 1, 128, 128),
                                                             (2, 2, 16, 8)])
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_matches_sdpa_over_gathered_blocks(heads, group, head_dim, value_dim, window):
    cache = filled_cache(heads, head_dim, value_dim)
    n, per_seq = 6, 5
    tables = torch.randperm(40)[: n * per_seq].view(n, per_seq)
    tables[0, 3:] = 0  # a short sequence's padding entries read block 0 (masked)
    ctx = torch.tensor([9, 20, 17, 1, 13, 4])
    q = torch.randn(n, heads * group, head_dim)
    scale = head_dim ** -0.5
    lo = DecodeGroup(0, tables, ctx, cache.block_size).first_key(window)
    kp, vp = cache.pools(0)
    got = cpu_attention.paged_decode_attention(q.view(n, heads, group, head_dim), kp, vp, tables, lo, ctx, scale)
    want = torch_path(q, cache, tables, ctx, window, scale)
    torch.testing.assert_close(got.view(n, heads * group, value_dim), want, rtol=1e-5, atol=1e-5)


def test_one_pair_by_hand():
    """Sequence 0, KV head 1, keys 2..6 (a window of 5 on a context of 7) over blocks [3, 1]."""
    cache = filled_cache(2, 8, 8)
    tables, ctx = torch.tensor([[3, 1]]), torch.tensor([7])
    q = torch.randn(1, 2, 1, 8)
    kp, vp = cache.pools(0)
    got = cpu_attention.paged_decode_attention(q, kp, vp, tables, torch.tensor([2]), ctx, 0.5)
    keys = [kp[1, [3, 1][t // 4], t % 4] for t in range(2, 7)]
    values = [vp[1, [3, 1][t // 4], t % 4] for t in range(2, 7)]
    scores = [0.5 * float(q[0, 1, 0] @ k) for k in keys]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    want = sum(w * v for w, v in zip(weights, values)) / sum(weights)
    torch.testing.assert_close(got[0, 1, 0], want, rtol=1e-5, atol=1e-6)


def test_paged_attention_takes_the_kernel_on_cpu_and_matches_the_torch_path(monkeypatch):
    """The runtime's decode path: the same output with the kernel and with it switched off."""
    cache = filled_cache(2, 16, 16)
    tables = torch.randperm(40)[:12].view(4, 3)
    ctx = torch.tensor([12, 5, 9, 11])
    batch = AttentionBatch(torch.zeros(4, dtype=torch.long), 4, [DecodeGroup(0, tables, ctx, 4)])
    q, k, v = torch.randn(4, 6, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    calls = []
    real = cpu_attention.paged_decode_attention
    monkeypatch.setattr(cpu_attention, "paged_decode_attention", lambda *a: calls.append(1) or real(*a))
    fast = paged_attention(q, k, v, cache, 0, batch, None)
    assert calls == [1]
    with cpu_attention.turned_off():
        slow = paged_attention(q, k, v, cache, 0, batch, None)
    assert len(calls) == 1
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


def test_keys_beyond_the_table_are_refused_not_read():
    cache = filled_cache(1, 8, 8)
    kp, vp = cache.pools(0)
    q, tables = torch.randn(1, 1, 1, 8), torch.tensor([[2, 3]])
    with pytest.raises(ValueError, match="tables of 2 blocks of 4"):
        cpu_attention.paged_decode_attention(q, kp, vp, tables, torch.tensor([0]), torch.tensor([9]), 1.0)

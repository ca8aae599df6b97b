"""Sizes as users write them, the copy path's accounting, and the expert cache's policies
(hand-computed cases)."""

from __future__ import annotations

import time

import pytest
import torch

from engines.base import EngineError
from engines.common.sizes import format_size, parse_size
from engines.offload.cache import ExpertCache
from engines.runtime.copies import CopyEngine
from engines.runtime.transfer import TransferLedger


@pytest.mark.parametrize("text, expected", [
    ("6MiB", 6 * 2**20), ("40GB", 40 * 10**9), ("512KiB", 512 * 1024), ("1.5GiB", 3 * 2**29),
    ("4096", 4096), ("10 MB", 10**7), ("2k", 2048), ("3kb", 3000), (123, 123),
])
def test_sizes_parse_binary_and_decimal_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["6Mx", "", "MiB", "-1MiB", "0", "1.2.3GB"])
def test_a_bad_size_names_the_field_and_the_form(text):
    with pytest.raises(EngineError, match="budget"):
        parse_size(text, "budget")


def test_format_size():
    assert format_size(6 * 2**20) == "6.00 MiB"
    assert format_size(945 * 1024) == "945 KiB"
    assert format_size(100) == "100 B"


def tensors(n: int, size: int = 1000):
    src = [torch.full((size,), float(i)) for i in range(n)]
    dst = [torch.zeros(size) for _ in range(n)]
    return src, dst


def test_copies_are_counted_at_issue_and_land_exactly():
    ledger = TransferLedger(torch.device("cpu"))
    copies = CopyEngine(ledger, torch.device("cpu"))
    src, dst = tensors(3)
    handle = copies.h2d(list(zip(dst, src)), tag="experts")
    handle.wait()
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    moved = ledger.take_step()
    assert (moved.h2d_bytes, moved.h2d_transfers) == (3 * 4000, 3)  # counted though the device is the CPU
    assert ledger.total["h2d:experts"] == 12000


def test_the_link_model_runs_copies_in_order_at_its_bandwidth():
    """Three 4 kB copies at 40 kB/s: the link is busy 0.1 s each, one after another; waiting on
    the last one right away stalls for the three of them."""
    ledger = TransferLedger(torch.device("cpu"))
    copies = CopyEngine(ledger, torch.device("cpu"), link_gbps=40e3 / 1e9)
    src, dst = tensors(3)
    t0 = time.perf_counter()
    handles = [copies.h2d([(d, s)]) for d, s in zip(dst, src)]
    assert not handles[2].done
    handles[2].wait()
    waited = time.perf_counter() - t0
    assert all(h.done for h in handles)  # in order: the last done means all done
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    stats = copies.take_step()
    assert stats.busy_s == pytest.approx(0.3, rel=1e-9)  # the model's time, not the thread's
    assert waited >= 0.3 - 1e-3 and stats.stall_s == pytest.approx(waited, abs=0.02)
    assert stats.overlap_s == pytest.approx(0.0, abs=0.02)
    copies.close()


def test_compute_done_while_the_link_copies_counts_as_overlap():
    ledger = TransferLedger(torch.device("cpu"))
    copies = CopyEngine(ledger, torch.device("cpu"), link_gbps=40e3 / 1e9)
    src, dst = tensors(1)
    handle = copies.h2d([(dst[0], src[0])])
    time.sleep(0.15)  # "compute" longer than the 0.1 s copy
    handle.wait()
    stats = copies.take_step()
    assert stats.stall_s < 0.01 and stats.overlap_s == pytest.approx(0.1, abs=0.01)
    copies.close()


def test_lru_evicts_the_least_recent_outside_the_kept_set():
    cache = ExpertCache(2, "lru")
    assert cache.place(5, keep={5}) == (0, None)
    cache.touch(5, 1)
    assert cache.place(7, keep={7}) == (1, None)
    cache.touch(7, 2)
    cache.touch(5, 3)  # 7 is now the least recent
    assert cache.place(9, keep={9}) == (1, 7)
    cache.touch(9, 4)
    assert cache.place(1, keep={1, 5, 9}) is None  # everything resident is still needed


def test_lfu_evicts_the_least_used_ties_to_the_least_recent():
    cache = ExpertCache(2, "lfu")
    cache.place(0, {0})
    cache.place(1, {1})
    for tick, e in enumerate([0, 0, 1], start=1):
        cache.touch(e, tick)  # uses: 0 twice, 1 once (most recent)
    assert cache.place(2, {2}) == (1, 1)  # fewest uses goes, though most recent
    cache.touch(2, 4)  # uses: 0 -> 2, 2 -> 1
    cache.touch(2, 5)  # tie at 2 uses: 0 is less recent
    assert cache.place(3, {3}) == (0, 0)

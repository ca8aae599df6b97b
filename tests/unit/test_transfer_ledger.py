"""TransferLedger counts exactly the bytes that cross host<->device, per step and in total."""

from __future__ import annotations

import torch

from engines.runtime.transfer import TransferCounts, TransferLedger


def test_cpu_device_counts_nothing():
    ledger = TransferLedger(torch.device("cpu"))
    t = torch.ones(10)
    assert ledger.to_device(t) is t and ledger.to_host(t) is t
    assert ledger.take_step() == TransferCounts()


def test_counts_bytes_and_transfers_per_step():
    # The meta device stands in for an accelerator: copies to it cross a "bus" and allocate nothing.
    ledger = TransferLedger(torch.device("meta"))
    ledger.to_device(torch.ones(10, dtype=torch.float32))
    ledger.tensor([1, 2, 3], torch.long)
    ledger.record("d2h", 100, tag="tokens")
    assert ledger.take_step() == TransferCounts(h2d_bytes=40 + 24, d2h_bytes=100, h2d_transfers=2, d2h_transfers=1)
    assert ledger.take_step() == TransferCounts()
    assert ledger.total["h2d:bytes"] == 64 and ledger.total["d2h:tokens"] == 100

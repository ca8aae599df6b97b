"""PagedWeightBackend's byte ledger (device_bytes in O(1)) against a walk over every held and
in-flight part, through random promotions, demotions, drops, commits and cancels, for both
representations (bit planes share parts between widths; re-quantized versions do not)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from engines.pagedweight.backend import PagedWeightBackend
from engines.pagedweight.formats import make_store
from engines.pagedweight.importance import Importance
from engines.runtime.copies import CopyEngine
from engines.runtime.transfer import TransferLedger


@pytest.mark.parametrize("representation", ["bitplanes", "requantize"])
@pytest.mark.parametrize("link_gbps", [None, 1000.0])  # copies done at issue, or in flight until commit
def test_the_ledger_equals_a_walk_over_every_part(representation, link_gbps):
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    layers, experts, bits = 2, 3, (16, 8, 4, 2)
    stores = {(i, e): make_store(representation, torch.randn(64, 32), torch.randn(32, 32), bits)
              for i in range(layers) for e in range(experts)}
    copies = CopyEngine(TransferLedger(cpu), cpu, link_gbps=link_gbps)
    backend = PagedWeightBackend(stores, copies, cpu, Importance(dict.fromkeys(range(layers), experts)))
    rng = random.Random(1)
    keys = list(stores)
    checked = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.6:
            backend.start_move(rng.choice(keys), rng.choice((0, *bits)))
        elif op < 0.85:
            backend.commit()
        else:
            backend.cancel(rng.sample(keys, 2))
        assert backend.device_bytes() == backend.walked_bytes()
        walked = Counter(backend.bits(k) for k in keys)  # the width tally _observe reads
        assert backend.width_counts() == {b: n for b, n in walked.items() if n}
        counts = [rng.choice((0, 0, 1, 3)) for _ in range(experts)]  # the layer's count, as ExpertBackend's
        backend.step_stats()  # reset
        backend.count_experts(1, counts)
        assert backend.step_stats()["expert_bytes_read"] == sum(
            backend.expert_bytes(1, e) for e, n in enumerate(counts) if n)
        checked += backend.device_bytes() > 0
    backend.commit()
    assert backend.device_bytes() == backend.walked_bytes() == sum(h.nbytes for h in backend.held.values())
    assert checked > 100  # the walk saw parts held, not an empty device


@pytest.mark.parametrize(("representation", "scheme"), [("bitplanes", "bitplanes"), ("requantize", "packed")])
def test_the_backend_names_how_its_widths_are_stored_for_cpu_pricing(representation, scheme):
    # re-quantized widths are RTN records: engines/quant's packed dequantization on the CPU
    cpu = torch.device("cpu")
    stores = {(0, 0): make_store(representation, torch.randn(64, 32), torch.randn(32, 32), (16, 4))}
    backend = PagedWeightBackend(stores, CopyEngine(TransferLedger(cpu), cpu), cpu, Importance({0: 1}))
    assert backend.dequant_scheme == scheme

"""Quality against the float32 reference: KL and agreement against hand-computed values, and
end to end on real engines (identical engines -> KL 0; RTN 2-bit experts -> KL > 0)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.quality import compare, measure_quality


def test_compare_by_hand():
    # Two positions over a 2-token vocabulary; the last row of each prompt is dropped.
    ref = [torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.3, 0.7]]))]
    test = [torch.log(torch.tensor([[0.25, 0.75], [0.9, 0.1], [0.1, 0.9]]))]
    q = compare(test, ref, [[0, 1, 0]], "hand")
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert q.kl_mean == pytest.approx((kl0 + 0.0) / 2)
    # argmax: ref picks token 0 (tie -> first) at row 0, test picks 1; row 1 both 0.
    assert q.top1_agreement == pytest.approx(0.5)
    # targets: token 1 then 0 -> test NLL = -ln 0.75 - ln 0.9
    assert q.perplexity == pytest.approx(math.exp((-math.log(0.75) - math.log(0.9)) / 2))
    assert q.reference_perplexity == pytest.approx(math.exp((-math.log(0.5) - math.log(0.9)) / 2))


def test_engines_against_reference(checkpoints):
    from engines.hf import HFEngine, HFEngineConfig
    from engines.moe import MoEEngine, MoEEngineConfig

    folder = str(checkpoints("mixtral"))
    # float32 on the CPU, pinned: KL < 1e-6 against the reference means float32 against
    # float32, also on a CUDA host (where the engines would pick the GPU and bf16).
    cpu32 = {"device": "cpu", "dtype": "float32"}
    reference = MoEEngine(MoEEngineConfig(model=folder, **cpu32))
    with reference:
        same = MoEEngine(MoEEngineConfig(model=folder, block_size=4, **cpu32))
        with same:
            q = measure_quality(same, reference, count=4, length=48)
        assert q.kl_mean == pytest.approx(0.0, abs=1e-6) and q.top1_agreement == 1.0
        hf = HFEngine(HFEngineConfig(model=folder, **cpu32))
        with hf:
            assert measure_quality(hf, reference, count=4, length=48).kl_mean < 1e-6
        damaged = MoEEngine(MoEEngineConfig(model=folder, **cpu32, expert_bits=2, expert_group=32))
        with damaged:
            q2 = measure_quality(damaged, reference, count=4, length=48)
    assert q2.kl_mean > 1e-3 and q2.prompt_source == "seeded random token ids"

"""The `moe` engine's expert_bits/expert_group options (what `pwbench demo eval
--expert-bits/--expert-group` sets: a fake-quantization expert backend) against
a loop reference: asymmetric min-max RTN, each value replaced by the nearest of the
2**bits levels of its group (one group per row with group 0 / None)."""

from __future__ import annotations

import dataclasses

import pytest
import torch


def _loop_rtn(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """w [rows, inputs] -> the reference quantize-dequantize, one Python float at a time."""
    flat = w
    res = torch.empty_like(w)
    for r in range(flat.shape[0]):
        for g0 in range(0, flat.shape[1], group):
            vals = [float(v) for v in flat[r, g0 : g0 + group]]
            lo, hi = min(vals), max(vals)
            scale = max((hi - lo) / (2**bits - 1), 1e-10)
            zero = round(-lo / scale)
            levels = [(k - zero) * scale for k in range(2**bits)]
            for j, v in enumerate(vals):
                res[r, g0 + j] = min(levels, key=lambda x: (abs(x - v), x))
    return res


@pytest.mark.parametrize("group", [None, 8])
def test_quantize_experts_per_row_and_groups(checkpoints, group):
    from engines.base import EngineError
    from engines.moe import MoEEngine, MoEEngineConfig

    # float32 on the CPU, pinned: the loop reference and atol 1e-6 are float32 arithmetic.
    cfg = MoEEngineConfig(model=str(checkpoints("mixtral")), device="cpu", dtype="float32")
    with MoEEngine(cfg) as full:
        before = {i: (full.experts.weights(i).gate_up, full.experts.weights(i).down) for i in full.experts.layers()}
    engine = MoEEngine(dataclasses.replace(cfg, expert_bits=2, expert_group=group or 0))
    with engine:
        for i, weights in before.items():
            after = (engine.experts.weights(i).gate_up, engine.experts.weights(i).down)
            for w, q in zip(weights, after):
                per_row, rows = q.reshape(-1, w.shape[-1]), w.reshape(-1, w.shape[-1])
                picked = torch.arange(0, rows.shape[0], 7)  # every 7th row keeps the loop short
                ref = _loop_rtn(rows[picked], 2, min(group or w.shape[-1], w.shape[-1]))
                assert torch.allclose(per_row[picked], ref, atol=1e-6), (i, tuple(w.shape))
                if group is None:  # one group per row: at most 4 distinct values in a row
                    assert all(len(set(row.tolist())) <= 4 for row in per_row)
    with pytest.raises(EngineError, match="does not divide"):
        MoEEngine(dataclasses.replace(cfg, expert_bits=2, expert_group=7)).start()

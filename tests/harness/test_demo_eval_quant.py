"""`quantize_experts` (what `pwbench demo eval --expert-bits/--expert-group` applies) against
a loop reference: asymmetric min-max RTN, each value replaced by the nearest of the
2**bits levels of its group (one group per row with group 0 / None)."""

from __future__ import annotations

import pytest
import torch

from harness.results import HarnessError


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
    from engines.moe_engine import MoEEngine, MoEEngineConfig
    from harness.demo_eval import quantize_experts

    engine = MoEEngine(MoEEngineConfig(model=str(checkpoints("mixtral"))))
    with engine:
        before = {i: (engine.experts.layer(i).gate_up.clone(), engine.experts.layer(i).down.clone())
                  for i in engine.experts.indices()}
        quantize_experts(engine, 2, group)
        for i, weights in before.items():
            after = (engine.experts.layer(i).gate_up, engine.experts.layer(i).down)
            for w, q in zip(weights, after):
                per_row, rows = q.reshape(-1, w.shape[-1]), w.reshape(-1, w.shape[-1])
                picked = torch.arange(0, rows.shape[0], 7)  # every 7th row keeps the loop short
                ref = _loop_rtn(rows[picked], 2, min(group or w.shape[-1], w.shape[-1]))
                assert torch.allclose(per_row[picked], ref, atol=1e-6), (i, tuple(w.shape))
                if group is None:  # one group per row: at most 4 distinct values in a row
                    assert all(len(set(row.tolist())) <= 4 for row in per_row)
        with pytest.raises(HarnessError, match="does not divide"):
            quantize_experts(engine, 2, 7)

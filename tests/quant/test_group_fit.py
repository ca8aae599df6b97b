"""Group sizes that fit odd expert widths (DeepSeek-V3's 24, Qwen's 40, OLMoE's 48): the largest
supported size dividing both, else one group per row (GPTQ's group_size -1, compressed-tensors'
strategy "channel"), written and read back by both formats. Oracle: hand-computed group choices
and the per-row RTN definition (scale = (max - min) / (2^bits - 1) over the whole row)."""

from __future__ import annotations

import torch

from engines.quant.convert import from_compressed_tensors, from_gptq, to_compressed_tensors, to_gptq
from engines.quant.hf_format import FolderScheme, quantization_config, read_scheme
from engines.quant.qweight import PER_ROW, dequantize, quantize_rtn
from engines.static_quant import fit_group_size


def test_fit_group_size_picks_the_largest_that_divides_then_per_row():
    assert fit_group_size(128, (96, 64)) == (32, "group_size 128 does not divide the expert widths 96/64: "
                                                 "experts quantized with group_size 32")
    assert fit_group_size(32, (64, 32)) == (32, None)
    size, note = fit_group_size(128, (64, 24))
    assert size == PER_ROW and "one group per row (-1)" in note


def test_per_row_weights_round_trip_through_both_formats():
    w = torch.randn(10, 24, generator=torch.Generator().manual_seed(0))
    qw = quantize_rtn(w, 8, PER_ROW)
    assert qw.group_size == 24 and qw.scales.shape == (10, 1)
    lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
    assert torch.allclose(qw.scales[:, 0], (hi - lo) / 255)
    g = to_gptq(qw, checkpoint_format="gptq_v2", scale_dtype=torch.float32)
    back = from_gptq(g["qweight"], g["qzeros"], g["scales"], g["g_idx"], bits=8, group_size=PER_ROW, sym=False,
                     checkpoint_format="gptq_v2")
    assert torch.equal(dequantize(back, torch.float32), dequantize(qw, torch.float32))
    c = to_compressed_tensors(qw)
    back = from_compressed_tensors(c["weight_packed"], c["weight_scale"], c["weight_shape"], c["weight_zero_point"],
                                   bits=8, group_size=PER_ROW, symmetric=False)
    assert torch.equal(dequantize(back, torch.float32), dequantize(qw, torch.float32))


def test_per_row_schemes_read_back():
    for fmt in ("gptq", "compressed-tensors"):
        scheme = FolderScheme(fmt, 8, PER_ROW, False, checkpoint_format="gptq_v2")
        qc = quantization_config(scheme, ["mlp.experts.0.gate_proj"], {})
        assert read_scheme(qc, "test").group_size == PER_ROW

"""harness/bench/cpu_ops.py `--dequant`: the CPU reference's dequantization of one expert, as
`pwbench hw calibrate --model` times it, with the engines' host-memory setting and with glibc's."""

from __future__ import annotations

from engines.common.demo import demo_model_path
from harness.bench.cpu_ops import dequant_rows, main
from harness.hw import DEQUANT_BITS


def test_dequant_rows_run_each_setting_in_its_own_process():
    demo = str(demo_model_path())
    rows = dequant_rows([demo], 1)
    # The bundled model: hidden 128, expert intermediate 64 -> the static engines' group 128 does not
    # divide 64, 64 does; one expert is gate_up [128, 128] + down [128, 64] float32 = 98,304 bytes.
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("demo_model", "kept", 64, 98_304),
                                                        ("demo_model", "glibc", 64, 98_304)]
    for *_, seconds in rows:
        assert sorted(seconds, key=int) == [str(b) for b in DEQUANT_BITS]
        assert all(0 < s < 1 for s in seconds.values())


def test_dequant_table_refuses_a_folder_without_a_config(tmp_path, capsys):
    assert main(["--dequant", "--models", str(tmp_path)]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and str(tmp_path) in out[0] and "config.json" in out[0]


def test_an_expert_larger_than_the_cap_is_timed_on_a_slice_and_scaled(monkeypatch):
    """The bundled model's expert (gate_up [128, 128] + down [128, 64], 98,304 float32 bytes) with the
    cap at a quarter of it: one expert, a quarter of each matrix's rows ([32, 128] and [32, 64]), and
    the time scaled by 3 x 128 x 64 / (32 x 128 + 32 x 64) = 4."""
    import harness.bench.cpu_ops as cpu_ops
    from engines.quant import qweight
    from engines.runtime.checkpoint import open_checkpoint
    from engines.runtime.shape import model_shape

    shape = model_shape(open_checkpoint(str(demo_model_path()), config_only=True).config, 4)
    monkeypatch.setattr(cpu_ops, "DEQUANT_BYTES", 98_304 // 4)
    quantized, real = [], qweight.quantize_rtn
    monkeypatch.setattr(qweight, "quantize_rtn", lambda w, *a: quantized.append(tuple(w.shape)) or real(w, *a))
    monkeypatch.setattr(cpu_ops, "_timeit", lambda fn, **kw: fn() or 1.0)  # one pass, "1 s"
    seconds = cpu_ops.model_dequant_seconds(shape, 64)
    assert set(quantized) == {(1, 32, 128), (1, 32, 64)}
    assert seconds == {str(b): 4.0 for b in DEQUANT_BITS}


def test_attention_timed_as_the_runtime_calls_it_for_mla_and_gqa(tmp_path):
    """`pwbench hw calibrate --model` times prefill SDPA with the shapes the runtime gives it: MLA's
    absorbed queries [T, H, latent + rope] against one shared head of keys [latent + rope] and
    values [latent] (engines/runtime/mla.py, run here on a tiny DeepSeek-V3), GQA's heads as they are."""
    import torch

    from engines.runtime.checkpoint import open_checkpoint
    from engines.runtime.mla import mla_keys_values, mla_project
    from engines.runtime.shape import model_shape
    from engines.runtime.weights import MLAWeights
    from harness.bench.cpu_ops import attention_heads
    from tests.tiny_models import build_hf_model, save_checkpoint

    folder = save_checkpoint(build_hf_model("deepseek_v3"), tmp_path / "ds")
    cfg = open_checkpoint(str(folder), config_only=True).config
    m, H, D = cfg.mla, cfg.num_heads, cfg.hidden_size
    heads = attention_heads(model_shape(cfg, 4), m)
    qk, r = m.qk_nope_head_dim + m.qk_rope_head_dim, m.kv_lora_rank
    w = MLAWeights(kv_a=torch.randn(r + m.qk_rope_head_dim, D), kv_a_norm=torch.ones(r),
                   kv_b=torch.randn(H * (m.qk_nope_head_dim + m.v_head_dim), r), o=torch.randn(D, H * m.v_head_dim),
                   q=torch.randn(H * qk, D))
    half = m.qk_rope_head_dim // 2
    h, cos, sin = torch.randn(5, D), torch.ones(5, half), torch.zeros(5, half)
    q, latent, k_rot = mla_project(cfg, w, h, cos, sin)
    keys, values = mla_keys_values(latent, k_rot)
    assert heads == (q.shape[1], keys.shape[1], keys.shape[-1], values.shape[-1]) == (4, 1, 24, 16)
    assert q.shape[-1] == keys.shape[-1]
    demo = open_checkpoint(str(demo_model_path()), config_only=True).config
    assert attention_heads(model_shape(demo, 4)) == (4, 2, 32, 32)  # hidden 128 over 4 heads, 2 KV heads

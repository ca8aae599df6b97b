"""harness/bench/cpu_ops.py: the GEMM times `pwbench hw calibrate --model` fits the cost model's
shape-keyed curves on, by row count, and `--rows`, which prints them."""

from __future__ import annotations

from pathlib import Path

from engines.common.demo import demo_model_path
from engines.runtime import gemm
from harness.bench.cpu_ops import MODEL_ROWS, main

ROOT = Path(__file__).resolve().parents[2]


def test_every_row_count_below_the_packed_kernel_is_timed():
    """Below gemm.MIN_ROWS the runtime calls F.linear, whose float32 kernel here takes the rows in
    blocks (a staircase in the rows): a curve interpolated between powers of two misprices the rows
    between them, so each part is timed at every row count up to the packed kernel's."""
    for part, rows in MODEL_ROWS.items():
        assert set(range(1, gemm.MIN_ROWS + 1)) <= set(rows), part
        assert list(rows) == sorted(set(rows)), part


def test_rows_table_prints_each_part_by_rows(capsys):
    assert main(["--rows", "--rounds", "1", "--models", str(demo_model_path())]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.split()[:1] == ["rows"])
    # and an expert's GEMMs right after its dequantization (static-* on the CPU)
    assert out[header].split() == ["rows", *MODEL_ROWS, "dequantized"]
    table = [line.split() for line in out[header + 1:]]
    assert [int(r[0]) for r in table] == [*range(1, 17), 32]
    assert all(len(r) == 2 + len(MODEL_ROWS) and all(float(x) > 0 for x in r[1:]) for r in table)


def test_rows_table_refuses_a_folder_without_a_config(tmp_path, capsys):
    assert main(["--rows", "--models", str(tmp_path)]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and str(tmp_path) in out[0] and "config.json" in out[0]


def test_the_gemms_after_dequantization_are_timed_only_where_a_cache_could_hold_the_expert():
    """`dequantized_gemm_seconds` (the static engines' CPU path: an RTN expert dequantized, then its
    GEMMs on weights just written) times every expert row count; an expert over DEQUANT_BYTES in
    float32 (the Mixtral-8x7B preset's, 705 MB) is not timed: no cache holds it, the resident
    experts' curve prices it, and timing it would quantize 705 MB of weights."""
    from engines.runtime.checkpoint import open_checkpoint
    from engines.runtime.shape import model_shape
    from harness.bench.cpu_ops import DEQUANT_BYTES, dequantized_gemm_seconds

    preset = model_shape(open_checkpoint(str(ROOT / "engines/sim/presets/mixtral-8x7b"), config_only=True).config, 4)
    assert 3 * preset.hidden * preset.intermediate * 4 > DEQUANT_BYTES
    assert dequantized_gemm_seconds(preset, 128, rounds=1) == {}
    demo = model_shape(open_checkpoint(str(demo_model_path()), config_only=True).config, 4)
    timed = dequantized_gemm_seconds(demo, 32, rounds=1, min_call_s=1e-4)
    assert list(timed) == [str(r) for r in MODEL_ROWS["expert"]] and all(v > 0 for v in timed.values())


def test_dequant_ab_times_a_running_engines_dequantization_and_restores_its_path():
    """`python -m harness.bench.simulate --dequant-ab`'s alternation on the bundled model, one round:
    a (running engine, calibration) pair of positive seconds per expert, and the static engines' CPU
    path (engines/quant/ops.py `_DequantizedStack`) as it was after it (the timing wraps it for the
    engine's rounds only)."""
    from engines.quant import ops
    from harness.bench.simulate import dequant_alternation

    index = ops._DequantizedStack.__getitem__
    pairs = dequant_alternation(str(demo_model_path()), "demo", 2, rounds=1)
    assert len(pairs) == 1 and all(t > 0 for t in pairs[0])
    assert ops._DequantizedStack.__getitem__ is index


def test_the_dequantization_is_timed_in_three_windows_and_their_median_kept(monkeypatch):
    """`pwbench hw calibrate --model` times one expert's dequantization before the GEMMs, after them and
    after the decode attention (one ~0.2 s window can fall in a slow quarter-second of a shared host)
    and keeps the median per width, with the windows beside it. The timings here are stand-ins that
    return in order (the real ones are tested in test_cpu_ops_dequant.py); the oracle is the median by hand."""
    from harness.bench import cpu_ops

    windows = iter([{"2": 1.0, "4": 3.6}, {"2": 2.0, "4": 6.4}, {"2": 1.5, "4": 3.9}])
    order = []
    monkeypatch.setattr(cpu_ops, "model_dequant_seconds", lambda *a, **k: order.append("dequant") or next(windows))
    monkeypatch.setattr(cpu_ops, "model_gemm_seconds", lambda *a, **k: order.append("gemm") or {})
    monkeypatch.setattr(cpu_ops, "dequantized_gemm_seconds", lambda *a, **k: order.append("hot") or {})
    monkeypatch.setattr(cpu_ops, "decode_attention_seconds", lambda *a, **k: order.append("attention") or ({}, 0))
    _, entry = cpu_ops.model_gemm_entry(str(demo_model_path()))
    assert order == ["dequant", "gemm", "hot", "dequant", "attention", "dequant"]
    assert entry["seconds"]["dequant_packed"] == {"2": 1.5, "4": 3.9}
    assert [w["4"] for w in entry["dequant_packed_windows"]] == [3.6, 6.4, 3.9]


def test_prefill_attention_is_timed_through_the_runtimes_paged_attention(monkeypatch):
    """`prefill_attention_seconds` times the runtime's own `paged_attention` on one prefill chunk: from
    position 0, causal over the chunk's keys; after n tokens of context, over the 2n keys its block
    table holds in a paged cache (a prefix-cache hit's chunk: gather, mask, SDPA), GQA's heads or
    MLA's latent expanded. Oracle: each timed call's output against attention computed by hand over
    the keys read block by block from the cache's pools (the chunk's rows attend its context and
    itself up to their position)."""
    import torch

    from engines.runtime import attention
    from engines.runtime.checkpoint import open_checkpoint
    from engines.runtime.shape import model_shape
    from harness.bench import cpu_ops

    seen = []
    real = cpu_ops.paged_attention

    def checked(q, k, v, cache, layer, batch, window, expand=None):
        out = real(q, k, v, cache, layer, batch, window, expand=expand)
        seen.append((q.shape, batch.prefills[0].start_pos, batch.prefills[0].length, expand))
        if len(seen) > 2 * len(cpu_ops.ATTENTION_CHUNKS):
            return out  # the first calls of each size checked against the oracle
        (seg,) = batch.prefills
        ctx = seg.start_pos + seg.length
        kp, vp = cache.pools(layer)
        keys = torch.cat([kp[:, b] for b in seg.table.tolist()], dim=1)[:, :ctx]  # [K, ctx, d]
        vals = torch.cat([vp[:, b] for b in seg.table.tolist()], dim=1)[:, :ctx]
        if seg.start_pos == 0:  # the chunk's own keys, as passed
            keys, vals = k.transpose(0, 1), v.transpose(0, 1)
        elif expand is not None:
            keys, vals = expand(keys, vals)
        heads, kv = q.shape[1], keys.shape[0]
        keys, vals = keys.repeat_interleave(heads // kv, 0), vals.repeat_interleave(heads // kv, 0)
        scores = torch.einsum("nhd,hcd->hnc", q, keys) * q.shape[-1] ** -0.5
        allowed = torch.arange(ctx)[None, :] <= torch.arange(seg.start_pos, ctx)[:, None]
        want = torch.einsum("hnc,hcd->nhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vals)
        assert torch.allclose(out, want, atol=1e-4), (q.shape, seg.start_pos)
        return out

    monkeypatch.setattr(cpu_ops, "ATTENTION_CHUNKS", (16, 24))
    monkeypatch.setattr(cpu_ops, "paged_attention", checked)
    assert attention.paged_attention is real
    for folder in (demo_model_path(), ROOT / "engines/sim/presets/deepseek-v3"):
        config = open_checkpoint(str(folder), config_only=True).config
        shape = model_shape(config, 4)
        for context in (False, True):
            seen.clear()
            timed = cpu_ops.prefill_attention_seconds(shape, config.mla, rounds=1, context=context)
            assert list(timed) == ["16", "24"] and all(s > 0 for s in timed.values())
            q_dim = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim if config.mla else config.head_dim
            assert {s[0] for s in seen} == {(n, config.num_heads, q_dim) for n in (16, 24)}
            assert {(s[1], s[2]) for s in seen} == {(n if context else 0, n) for n in (16, 24)}
            assert all((s[3] is not None) == (config.mla is not None) for s in seen)

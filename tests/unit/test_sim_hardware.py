"""engines/sim/hardware.py: the built-in profiles load with every number positive and sourced,
curves interpolate in log size, a user's TOML inherits and overrides, bad fields are one line,
and `pwbench hw list` / `hw show` print them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engines.sim.hardware import (
    EFFICIENCY_KEYS,
    REQUIRED_CURVES,
    Curve,
    cpu_profile,
    curve_base,
    list_profiles,
    load_profile,
    profile_for_device,
)

REPO = Path(__file__).resolve().parents[2]
GPUS = ("h200", "h100-sxm", "h100-pcie", "a100-80gb", "l40s", "l4", "rtx-6000-ada", "a10g")


@pytest.fixture(autouse=True)
def _empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path / "cache"))  # no `pwbench hw` measurement unless a test writes one


def test_every_builtin_loads_positive_sourced_and_curves_in_range():
    names = {p.name for p in list_profiles()}
    assert names >= {*GPUS, "cpu"}
    for p in list_profiles():
        for field in ("memory_bytes", "memory_bytes_per_s", "link_bytes_per_s", "link_pinned_bytes_per_s",
                      "host_memory_bytes", "host_memory_bytes_per_s", "host_flops_per_s", "step_overhead_s"):
            assert getattr(p, field) > 0, (p.name, field)
            assert p.sources.get(field), (p.name, field)  # every number names where it comes from
        assert p.flops() > 0 and all(v > 0 for v in p.flops_per_s.values())
        assert p.link_pinned_bytes_per_s <= p.link_bytes_per_s  # measured never above the theory
        assert set(REQUIRED_CURVES) <= set(p.efficiency)
        assert {curve_base(k) for k in p.efficiency} <= set(EFFICIENCY_KEYS)
        for key, curve in p.efficiency.items():
            assert curve.source and curve.basis == EFFICIENCY_KEYS[curve_base(key)][1]
            assert all(0 < e <= 1 for _, e in curve.points), (p.name, key)
            for size in (0.5, 1, 7, 300, 5000, 1e9):
                assert 0 < curve.at(size) <= 1


def test_datasheet_numbers_as_the_brief_gives_them():
    # ../shared/BRIEF.md: H200 141 GB at 4.8 TB/s; H100 SXM 80 GB at 3.35 TB/s, ~989 TFLOP/s bf16;
    # A100 80 GB 2.0 TB/s, 312 TFLOP/s; L4 24 GB, 300 GB/s, ~121 TFLOP/s; pinned Gen5 ~55, Gen4 ~25 GB/s.
    h200, h100, a100, l4 = (load_profile(n) for n in ("h200", "h100-sxm", "a100-80gb", "l4"))
    assert (h200.memory_bytes, h200.memory_bytes_per_s, h200.flops("bfloat16")) == (141e9, 4.8e12, 989e12)
    assert (h100.memory_bytes, h100.memory_bytes_per_s, h100.flops()) == (80e9, 3.35e12, 989e12)
    assert a100.flops() == 312e12 and abs(a100.memory_bytes_per_s - 2.0e12) < 0.05e12
    assert (l4.memory_bytes, l4.memory_bytes_per_s, l4.flops()) == (24e9, 300e9, 121e12)
    assert h100.link_pinned_bytes_per_s == 55e9 and a100.link_pinned_bytes_per_s == 25e9


def test_profile_for_device_maps_cuda_names_to_builtins():
    # The names torch.cuda.get_device_name() reports on these GPUs (nvidia-smi's product names).
    names = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H100 PCIe": "h100-pcie",
             "NVIDIA A100-SXM4-80GB": "a100-80gb", "NVIDIA A100 80GB PCIe": "a100-80gb", "NVIDIA L40S": "l40s",
             "NVIDIA L4": "l4", "NVIDIA A10G": "a10g", "NVIDIA RTX 6000 Ada Generation": "rtx-6000-ada",
             "Tesla T4": "t4", "NVIDIA RTX A5000": "a5000", "NVIDIA GeForce RTX 4090": None, "NVIDIA A10": None}
    assert {n: profile_for_device(n) for n in names} == names
    assert all(load_profile(p).name == p for p in names.values() if p)


def test_curve_is_log_interpolated_and_flat_beyond():
    c = Curve(((1, 0.2), (100, 0.8)), "hand")
    assert c.at(0.01) == 0.2 and c.at(1e6) == 0.8
    assert math.isclose(c.at(10), 0.5)  # halfway in log10 between 1 and 100
    assert math.isclose(c.at(1000 ** 0.5), 0.2 + 0.6 * math.log(1000 ** 0.5) / math.log(100))


def test_user_toml_inherits_and_overrides(tmp_path):
    f = tmp_path / "my-h100.toml"
    f.write_text('inherit = "h100-sxm"\nname = "my-h100"\ndescription = "our H100, slower HBM"\n'
                 'memory_bytes_per_s = 3.0e12\n[sources]\nmemory_bytes_per_s = "our stream benchmark"\n'
                 '[efficiency.copy]\npoints = [[1e6, 0.5], [1e8, 0.9]]\nsource = "our nvbandwidth run"\n')
    base = load_profile("h100-sxm")
    p = load_profile(str(f))
    assert (p.name, p.memory_bytes_per_s) == ("my-h100", 3.0e12)
    assert p.sources["memory_bytes_per_s"] == "our stream benchmark"
    assert p.flops_per_s == base.flops_per_s and p.efficiency["gemm"] == base.efficiency["gemm"]  # inherited
    assert p.efficiency["copy"].points == ((1e6, 0.5), (1e8, 0.9))
    assert p.efficiency["copy"].at(1e7) == pytest.approx(0.7)
    o = load_profile(str(f), {"memory_bytes_per_s": 2.5e12, "efficiency.gemm": [[1, 0.3], [512, 0.8]],
                              "flops_per_s.bfloat16": 800e12})
    assert o.memory_bytes_per_s == 2.5e12 and o.flops() == 800e12
    assert o.efficiency["gemm"].points == ((1, 0.3), (512, 0.8)) and "override" in o.efficiency["gemm"].source
    assert "override" in o.sources["memory_bytes_per_s"]


@pytest.mark.parametrize("body, field", [
    ('inherit = "h100-sxm"\nmemory_bytes_per_s = -1\n', "memory_bytes_per_s"),
    ('inherit = "h100-sxm"\nhbm_bytes_per_s = 3e12\n', "hbm_bytes_per_s"),
    ('inherit = "h100-sxm"\n[efficiency.gemm]\npoints = [[1, 1.5]]\nsource = "x"\n', "efficiency.gemm.points"),
    ('inherit = "h100-sxm"\n[efficiency.gemmm]\npoints = [[1, 0.5]]\nsource = "x"\n', "efficiency.gemmm"),
    ('inherit = "h100-sxm"\n[efficiency.copy]\npoints = [[1, 0.5]]\n', "efficiency.copy.source"),
    ('inherit = "no-such-gpu"\n', "inherit"),
    ('name = "alone"\n', "description"),
])
def test_bad_field_is_one_line_naming_file_and_field(tmp_path, body, field):
    f = tmp_path / "bad.toml"
    f.write_text(body)
    with pytest.raises(ValueError) as err:
        load_profile(str(f))
    msg = str(err.value)
    assert "\n" not in msg and str(f) in msg and repr(field) in msg, msg


def test_bad_override_and_unknown_name():
    with pytest.raises(ValueError, match="'memory_bytes_per_sec'"):
        load_profile("h100-sxm", {"memory_bytes_per_sec": 1e12})
    with pytest.raises(ValueError, match="h100-sxm"):  # the message lists the built-ins
        load_profile("h100")


def test_cpu_profile_takes_pwbench_hw_measurements(tmp_path):
    from engines.common.peaks import cache_path, cpu_model

    assumed = cpu_profile()
    assert "assumed" in assumed.sources["memory_bytes_per_s"] and assumed.default_dtype == "float32"
    m = {"memory_bandwidth_bytes_per_s": 30e9, "matmul_flops_per_s": 200e9, "op_overhead_s": 4e-6,
         "matmul_flops_at_rows": {"1": 2e9, "512": 180e9, "1024": 200e9}, "decode_attention_bytes_per_s": 9e9,
         "prefill_attention_flops_per_s": 50e9, "measured_at": "2025-01-01T00:00:00"}
    cache_path().parent.mkdir(parents=True)
    cache_path().write_text(json.dumps({cpu_model(): m}))
    p = load_profile("cpu")
    assert (p.memory_bytes_per_s, p.flops("float32"), p.op_overhead_s) == (30e9, 200e9, 4e-6)
    assert "measured" in p.sources["memory_bytes_per_s"] and "2025-01-01" in p.sources["memory_bytes_per_s"]
    # 1 row of a 1024 x 1024 float32 matmul: 2 x 1024^2 FLOPs over 4 x (1024^2 + 2 x 1024) bytes at 30 GB/s
    bound = 2 * 1024 * 1024 / (4 * (1024 * 1024 + 2 * 1024)) * 30e9
    assert p.efficiency["gemm"].at(1) == pytest.approx(2e9 / bound, abs=1e-4)
    assert p.efficiency["attention_decode"].at(64) == pytest.approx(9e9 / 30e9, abs=1e-4)
    assert p.efficiency["attention_prefill"].at(128) == pytest.approx(50e9 / 200e9, abs=1e-4)
    assert p.shared_processor is True and p.link_pinned_bytes_per_s == 15e9  # a copy reads and writes: bw / 2
    # Every curve the measurements fit is engines/sim/calibrate.py's fit; the rest stays cpu.toml's.
    from engines.sim.calibrate import fit_cpu_curves

    fit = fit_cpu_curves(m)
    for key, c in fit.items():
        assert p.efficiency[key].points == tuple(map(tuple, c["points"])) and p.efficiency[key].source == c["source"]
    assert "elementwise" not in fit and p.efficiency["dequant_gemm_4"] == assumed.efficiency["dequant_gemm_4"]
    m2 = {**m, "argmax_bytes_per_s": 6e9, "elementwise_bytes_per_s_at_tokens": {"256": 12e9, "8192": 3e9},
          "step_overhead_s": 2.5e-4, "step_overhead_source": "hand"}
    cache_path().write_text(json.dumps({cpu_model(): m2}))
    p2 = load_profile("cpu")
    assert p2.efficiency["sample"].at(256) == pytest.approx(6e9 / 30e9)
    assert p2.efficiency["elementwise"].at(8192) == pytest.approx(3e9 / 30e9)
    assert p2.step_overhead_s == 2.5e-4 and "hand" in p2.sources["step_overhead_s"]
    # `hw calibrate`'s fits: the runtime's time per counted call replaces the tiny call's, the prefill rates
    # are read as they were fitted; a step overhead of 0 (folded into the call's) is 0, not cpu.toml's
    m_fit = {**m2, "step_overhead_s": 0.0, "runtime_op_overhead_s": 2.2e-6, "runtime_op_overhead_source": "fit A",
             "prefill_element_overhead_s": 7e-7, "prefill_segment_overhead_s": 3e-5, "prefill_step_overhead_s": 4e-4,
             "prefill_overhead_source": "fit B",
             "executor_overhead_s": {"pagedweight": 2e-4}, "executor_token_overhead_s": {"layer_major": 1e-6},
             "executor_overhead_source": "fit C"}
    cache_path().write_text(json.dumps({cpu_model(): m_fit}))
    pf = load_profile("cpu")
    assert (pf.op_overhead_s, pf.step_overhead_s) == (2.2e-6, 0.0) and "fit A" in pf.sources["op_overhead_s"]
    assert (pf.prefill_element_overhead_s, pf.prefill_segment_overhead_s, pf.prefill_step_overhead_s) == (
        7e-7, 3e-5, 4e-4)
    assert all("fit B" in pf.sources[f"prefill_{k}_overhead_s"] for k in ("element", "segment", "step"))
    assert pf.executor_overhead_s == {"pagedweight": 2e-4} and pf.executor_token_overhead_s == {"layer_major": 1e-6}
    assert "fit C" in pf.sources["executor_overhead_s"]
    from engines.sim.hardware import profile_toml

    back = tmp_path / "fitted.toml"
    back.write_text(profile_toml(pf))
    assert load_profile(str(back)).prefill_segment_overhead_s == 3e-5  # written and read back
    assert load_profile(str(back)).prefill_step_overhead_s == 4e-4
    # `hw calibrate --model`: curves keyed by the model's shape, read back from a TOML (keys quoted)
    entry = {"model": "x", "params": {"expert": 1 << 20}, "seconds": {"expert": {"1": 1e-3, "64": 2e-3}}}
    cache_path().write_text(json.dumps({cpu_model(): {**m2, "model_gemm": {"d4-q4-kv4-i8-v10-b2": entry}}}))
    p3 = load_profile("cpu")
    assert p3.efficiency["grouped_gemm@d4-q4-kv4-i8-v10-b2"].basis == "roofline"
    from engines.sim.hardware import profile_toml

    f = tmp_path / "shaped.toml"
    f.write_text(profile_toml(p3))
    assert load_profile(str(f)).efficiency == p3.efficiency
    bad = {**m, "memory_bandwidth_bytes_per_s": -1.0}  # a corrupt cache: one line naming the field and the fix
    cache_path().write_text(json.dumps({cpu_model(): bad}))
    with pytest.raises(ValueError, match="memory_bandwidth_bytes_per_s.*rerun `pwbench hw"):
        load_profile("cpu")


def test_pwbench_hw_list_and_show():
    from harness.cli import app

    runner = CliRunner()
    out = runner.invoke(app, ["hw", "list", "--json"])
    assert out.exit_code == 0, out.output
    rows = {r["name"]: r for r in json.loads(out.output.strip().splitlines()[-1])}
    assert set(rows) >= {*GPUS, "cpu"}
    assert rows["h100-sxm"]["memory_tb_per_s"] == 3.35 and rows["h100-sxm"]["tflops"] == 989
    table = runner.invoke(app, ["hw", "list"])
    assert table.exit_code == 0 and any(line.split()[:2] == ["h200", "141"] for line in table.output.splitlines())
    show = runner.invoke(app, ["hw", "show", "l4"])
    assert show.exit_code == 0 and "NVIDIA L4 datasheet" in show.output and "efficiency.copy" in show.output
    bad = runner.invoke(app, ["hw", "show", "h100"])
    assert bad.exit_code == 2 and "unknown hardware profile 'h100'" in bad.output


def test_profile_toml_reads_back_to_the_same_profile(tmp_path):
    from dataclasses import replace

    from engines.sim.hardware import profile_toml

    for name in ("h100-sxm", "cpu"):
        p = load_profile(name)
        f = tmp_path / f"{name}.toml"
        f.write_text(profile_toml(p, name=f"my-{name}", header="line one\nline two"))
        back = load_profile(str(f))
        assert replace(back, origin="") == replace(p, name=f"my-{name}", origin="")
        assert f.read_text().startswith("# line one\n# line two\n")
    assert load_profile(str(tmp_path / "cpu.toml")).shared_processor is True  # survives the rename
    assert load_profile(str(tmp_path / "h100-sxm.toml")).shared_processor is False


def test_executor_overhead_tables_read_override_round_trip_and_reject_bad_values(tmp_path):
    from dataclasses import replace

    from engines.sim.hardware import profile_toml

    f = tmp_path / "mine.toml"
    f.write_text('inherit = "cpu"\nname = "mine"\n[executor_overhead_s]\npagedweight = 2e-4\nlayer_major = 0\n'
                 '[executor_token_overhead_s]\nlayer_major = 1e-6\n')
    p = load_profile(str(f))
    assert p.executor_overhead_s == {"pagedweight": 2e-4, "layer_major": 0.0}
    assert p.executor_token_overhead_s == {"layer_major": 1e-6}
    assert load_profile("h100-sxm").executor_overhead_s == {}  # GPUs: none
    o = load_profile(str(f), {"executor_overhead_s.offload": 5e-5})
    assert o.executor_overhead_s == {"pagedweight": 2e-4, "layer_major": 0.0, "offload": 5e-5}
    back = tmp_path / "back.toml"
    back.write_text(profile_toml(o))
    assert replace(load_profile(str(back)), origin="") == replace(o, origin="")
    f.write_text('inherit = "cpu"\n[executor_overhead_s]\npagedweight = -1\n')
    with pytest.raises(ValueError) as err:
        load_profile(str(f))
    assert "\n" not in str(err.value) and "'executor_overhead_s.pagedweight'" in str(err.value)


def test_a_models_own_prefill_fit_reaches_the_cpu_profile_and_its_toml(tmp_path):
    """`hw calibrate --model`'s prefill fit on a model (measurements["model_gemm"][KEY]["prefill_overhead"])
    becomes the cpu profile's model_prefill_*_overhead_s tables at KEY, with its source, and survives
    the TOML round trip; an entry without one adds nothing."""
    from dataclasses import replace

    from engines.sim.hardware import PROFILES_DIR, _cpu_measured_table, _merged, profile_toml

    base, _ = _merged(PROFILES_DIR / "cpu.toml", "cpu.toml")
    m = {"memory_bandwidth_bytes_per_s": 2e10, "matmul_flops_per_s": 1e11,
         "model_gemm": {"d8-k": {"prefill_overhead": {"element_s": 1e-9, "segment_s": 0.0, "step_s": 3e-4,
                                                      "source": "probe on m8"}},
                        "d16-k": {"params": {}}}}
    table = _cpu_measured_table(base, m, "now")
    assert table["model_prefill_element_overhead_s"] == {"d8-k": 1e-9}
    assert table["model_prefill_step_overhead_s"] == {"d8-k": 3e-4}
    assert table["model_prefill_segment_overhead_s"] == {"d8-k": 0.0}
    assert "probe on m8" in table["sources"]["model_prefill_overhead.d8-k"]
    p = replace(load_profile("cpu"), model_prefill_element_overhead_s={"d8-k": 1e-9},
                model_prefill_segment_overhead_s={"d8-k": 0.0}, model_prefill_step_overhead_s={"d8-k": 3e-4})
    f = tmp_path / "own.toml"
    f.write_text(profile_toml(p))
    assert replace(load_profile(str(f)), origin="") == replace(p, origin="")


def test_the_models_own_prefill_probe_runs_where_the_weights_are(tmp_path, monkeypatch):
    """`hw calibrate --model` probes a folder's own prefill only where its weights are there and at
    most MODEL_PREFILL_MAX_BYTES: not a config-only folder (a preset's), not a larger checkpoint,
    not the bundled model (the profile's own rates are fitted on it)."""
    import harness.cli.hw as hw
    from engines.common.demo import demo_model_path

    small, bare, big = (tmp_path / n for n in ("small", "bare", "big"))
    for folder in (small, bare, big):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    (small / "model.safetensors").write_bytes(b"x" * 100)
    (big / "model-00001.safetensors").write_bytes(b"x" * 100)
    (big / "model-00002.safetensors").write_bytes(b"x" * 100)
    monkeypatch.setattr(hw, "MODEL_PREFILL_MAX_BYTES", 150)
    folders = [str(small), str(bare), str(big), str(demo_model_path())]
    assert hw.prefill_probe_models(folders) == [str(small)]


def test_a_model_too_short_for_the_prefill_probe_is_refused_before_it_loads(tmp_path):
    """A model whose positions hold fewer than 3 of the probe's shapes (with their decode tokens)
    gets a one-line ValueError, which `hw calibrate` turns into "the bundled model's rates apply"."""
    import transformers

    from harness.cli.hw import measure_prefill_overhead

    transformers.MixtralConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=4, vocab_size=300,
                               max_position_embeddings=40).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"0 of its shapes fit the model's 40 positions") as err:
        measure_prefill_overhead(str(tmp_path), repeats=1, decode=16)
    assert "\n" not in str(err.value)


def test_fit_call_and_sequence_overhead_recovers_hand_made_rates():
    from engines.sim.calibrate import fit_call_and_sequence_overhead

    # 2 layers; 2 us per call and 10 us per sequence and layer: 1 sequence 300 calls -> 620 us,
    # 6 sequences 400 calls -> 920 us, 2 sequences 320 calls -> 680 us; one outlier step per size
    # that the medians leave out
    rows = [(1, 300, 620e-6), (1, 300, 620e-6), (1, 302, 9e-3),
            (6, 400, 920e-6), (6, 400, 920e-6), (6, 390, 1e-6),
            (2, 320, 680e-6), (2, 320, 680e-6), (2, 320, 680e-6), (0, 999, 5.0)]  # (0: a prefill step, ignored)
    per_call, per_seq, d = fit_call_and_sequence_overhead(rows, layers=2)
    assert per_call == pytest.approx(2e-6) and per_seq == pytest.approx(10e-6)
    assert d["sizes"] == [1, 2, 6] and d["rms_s"] == pytest.approx(0, abs=1e-12)
    # residuals that fall with the batch: the sequence term would be negative, so the calls alone
    # (least squares through the origin: 1 ms over 500 calls, 0.5 ms over 250 -> 2 us)
    per_call, per_seq, _ = fit_call_and_sequence_overhead([(1, 500, 1e-3), (6, 250, 0.5e-3)], layers=2)
    assert per_seq == 0.0 and per_call == pytest.approx(2e-6)
    with pytest.raises(ValueError, match="two"):
        fit_call_and_sequence_overhead([(6, 400, 1e-3), (6, 401, 1e-3)], layers=2)


def test_fit_prefill_overhead_recovers_hand_made_rates():
    from engines.sim.calibrate import fit_prefill_overhead

    # per token x hidden element, per segment and per step, per layer
    a, b, c, layers, hidden = 1e-8, 2e-5, 3e-4, 2, 128
    steps = [(32, 1), (384, 1), (256, 4), (768, 24), (768, 6), (1024, 1)]
    rows = [(t, g, layers * (a * t * hidden + b * g + c)) for t, g in steps]
    got_a, got_b, got_c, d = fit_prefill_overhead(rows, layers, hidden)
    assert (got_a, got_b, got_c) == (pytest.approx(a), pytest.approx(b), pytest.approx(c))
    assert d["rms_s"] == pytest.approx(0, abs=1e-12)
    # negative per-segment and per-step costs are not costs: 0, and the per-element rate refitted alone
    # (residuals 2 x 1e-6 x tokens, less 1e-5 a segment beyond the first: the joint fit's segment term
    # is negative, and with it left out, so is the step's)
    rows = [(t, g, 2 * (1e-6 * t - 1e-5 * (g - 1))) for t, g in [(100, 1), (100, 10), (400, 1), (200, 1)]]
    got_a, got_b, got_c, _ = fit_prefill_overhead(rows, 2)
    assert (got_b, got_c) == (0.0, 0.0)
    assert got_a == pytest.approx(sum(2 * t * r for t, _, r in rows) / sum((2 * t) ** 2 for t, _, _ in rows))
    with pytest.raises(ValueError, match="proportional"):
        fit_prefill_overhead([(100, 1, 1e-3), (200, 2, 2e-3), (300, 3, 3e-3)], 2)
    with pytest.raises(ValueError, match="at least 3"):
        fit_prefill_overhead([(100, 1, 1e-3), (200, 1, 2e-3)], 2)


def test_nonnegative_least_squares_by_hand():
    from engines.sim.calibrate import nonnegative_least_squares

    # y = 2 x0 + 3 x1 exactly: both kept
    x = [(1.0, 0.0), (0.0, 1.0), (1.0, 1.0)]
    assert nonnegative_least_squares(x, [2.0, 3.0, 5.0]) == (pytest.approx(2.0), pytest.approx(3.0))
    # y = x0 - x1: the joint fit's x1 is negative; x0 alone (least squares 1 x 1 + 0 + 1 x 0 over 2) = 0.5
    assert nonnegative_least_squares(x, [1.0, -1.0, 0.0]) == (pytest.approx(0.5), 0.0)
    # all negative: nothing is a cost
    assert nonnegative_least_squares(x, [-1.0, -1.0, -2.0]) == (0.0, 0.0)
    assert nonnegative_least_squares([(1.0, 2.0), (2.0, 4.0)], [1.0, 2.0]) is None


def test_pwbench_hw_calibrate_caches_prints_and_writes_a_profile(tmp_path, monkeypatch):
    """`hw calibrate` with `pwbench hw`'s measurement replaced by a hand-made one (the real one
    takes ~10 s): the cpu profile's peaks and curves come from it, and --output reads back."""
    import harness.hw
    from engines.common.peaks import cached_peaks, cpu_model
    from harness.cli import app

    m = {"device": "cpu", "device_name": cpu_model(), "measured_at": "2025-02-03T04:05:06",
         "memory_bandwidth_bytes_per_s": 12e9, "matmul_flops_per_s": 90e9, "op_overhead_s": 2e-6,
         "matmul_flops_at_rows": {"1": 1e9, "1024": 90e9}, "argmax_bytes_per_s": 6e9}
    monkeypatch.setattr(harness.hw, "measure", lambda device="cpu": dict(m))
    out = tmp_path / "mine.toml"
    done = CliRunner().invoke(app, ["hw", "calibrate", "--no-step-overhead", "--output", str(out), "--json"])
    assert done.exit_code == 0, done.output
    got = json.loads(done.output.strip().splitlines()[-1])
    assert cached_peaks()[cpu_model()]["measured_at"] == "2025-02-03T04:05:06"  # cached as `pwbench hw` does
    assert got["memory_bytes_per_s"] == 12e9 and got["flops_per_s"]["float32"] == 90e9 and got["output"] == str(out)
    assert got["efficiency"]["sample"]["points"] == [[256, 0.5]]  # 6e9 / 12e9
    p = load_profile(str(out))
    assert p.memory_bytes_per_s == 12e9 and p.op_overhead_s == 2e-6 and p.shared_processor
    assert "2025-02-03" in p.sources["memory_bytes_per_s"]
    bad_model = CliRunner().invoke(app, ["hw", "calibrate", "--no-step-overhead", "--model", str(tmp_path / "none")])
    assert bad_model.exit_code != 0 and "--model" in bad_model.output and "does not exist" in bad_model.output
    assert "Traceback" not in bad_model.output and len(bad_model.output.strip().splitlines()) == 1
    import harness.bench.cpu_ops

    seen = []
    monkeypatch.setattr(harness.bench.cpu_ops, "model_gemm_entry",
                        lambda folder: seen.append(folder) or ("d1-q1-kv1-i1-v1-b4", {
                            "model": folder, "params": {"expert": 1000}, "seconds": {"expert": {"1": 1e-6}}}))
    demo = str(REPO / "engines" / "demo_model")
    done = CliRunner().invoke(app, ["hw", "calibrate", "--no-step-overhead", "--model", demo, "--json"])
    assert done.exit_code == 0, done.output
    assert seen == [demo]
    assert "grouped_gemm@d1-q1-kv1-i1-v1-b4" in json.loads(done.output.strip().splitlines()[-1])["efficiency"]
    again = CliRunner().invoke(app, ["hw", "calibrate", "--no-step-overhead", "--json"])  # kept for that model
    assert "grouped_gemm@d1-q1-kv1-i1-v1-b4" in json.loads(again.output.strip().splitlines()[-1])["efficiency"]
    nowhere = str(tmp_path / "no" / "x.toml")
    bad = CliRunner().invoke(app, ["hw", "calibrate", "--no-step-overhead", "--output", nowhere])
    assert bad.exit_code != 0 and "--output" in bad.output and "Traceback" not in bad.output

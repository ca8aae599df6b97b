"""The validation benchmark's calibrations with `--calibrate engine` (harness/bench/simulate.py
`Calibrations`): each engine's simulated twins wait for the calibration after its measured runs and
are priced on the median of the three calibrations nearest them. Oracles: the indices and medians
by hand, and the cpu profile (engines/sim/hardware.py `cpu_profile`) the twins read from the cache."""

from __future__ import annotations

import json

import pytest

from harness.bench.simulate import Calibrations, bracket, median_calibration


def test_bracket_takes_the_calibrations_before_and_after_an_engines_runs():
    # calibration c is taken right before the engine's runs, c + 1 right after them
    assert bracket(2, 4) == [1, 2, 3]
    assert bracket(3, 5) == [2, 3, 4]
    assert bracket(3, 4) == [2, 3]  # the one after not taken (yet)
    # the model's first engine: no calibration before its own, so the two after it
    assert bracket(0, 3) == [0, 1, 2]
    assert bracket(0, 2) == [0, 1]
    assert bracket(0, 1) == [0]


def test_median_calibration_by_hand():
    a = {"bw": 10.0, "calls": 2.0e-6, "rows": {"1": 0.5, "2": 0.9}, "curve": [1, 2, 3], "at": "12:00",
         "flag": True, "only_a": 1.0, "threads": 1, "shape": [4, 8]}
    b = {"bw": 13.0, "calls": 1.6e-6, "rows": {"1": 0.4, "2": 1.1}, "curve": [4, 5, 6], "at": "12:02",
         "flag": False, "threads": 1, "shape": [4, 8]}
    c = {"bw": 12.0, "calls": 1.5e-6, "rows": {"1": 0.6, "2": 1.0}, "curve": [7, 8], "at": "12:04",
         "flag": True, "threads": 1, "shape": [4, 8]}
    got = median_calibration([a, b, c], middle=1)
    assert got == {"bw": 12.0, "calls": 1.6e-6, "rows": {"1": 0.5, "2": 1.0},
                   "curve": [4, 5, 6],  # lists of other lengths: the middle one's
                   "at": "12:02", "flag": False,  # texts and booleans: the middle one's
                   "threads": 1, "shape": [4, 8]}  # equal numbers keep their type
    assert isinstance(got["threads"], int)
    # two calibrations: their mean; a key the middle one lacks is not added
    assert median_calibration([a, b], middle=0) == {
        "bw": 11.5, "calls": pytest.approx(1.8e-6), "rows": {"1": pytest.approx(0.45), "2": 1.0},
        "curve": [2.5, 3.5, 4.5], "at": "12:00", "flag": True, "only_a": 1.0, "threads": 1, "shape": [4, 8]}


def _snapshot(per_call_us: float, bandwidth_gb_s: float) -> dict:
    from engines.common.peaks import cpu_model

    return {cpu_model(): {"device_name": cpu_model(), "memory_bandwidth_bytes_per_s": bandwidth_gb_s * 1e9,
                          "matmul_flops_per_s": 1.5e11, "runtime_op_overhead_s": per_call_us * 1e-6}}


def test_each_engines_twins_are_priced_on_the_median_of_its_bracket(tmp_path, monkeypatch):
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    from engines.common.peaks import cache_path, cpu_model
    from engines.sim.hardware import cpu_profile

    cal = Calibrations("model")
    taken = [_snapshot(1.6, 13.0), _snapshot(2.2, 12.0), _snapshot(1.5, 13.4), _snapshot(1.7, 12.8)]

    def take(k: int) -> None:  # what `take` leaves: the calibration in the cache, this CPU's entry kept
        cache_path().write_text(json.dumps(taken[k]))
        cal.snapshots.append(taken[k][cpu_model()])

    seen: dict[str, tuple[float, float]] = {}

    def twin(engine: str):
        def run():
            p = cpu_profile()
            seen[engine] = (p.op_overhead_s * 1e6, p.memory_bytes_per_s / 1e9)
            return engine, "offline", {}, {}
        return run

    take(0)
    cal.wait("moe", [twin("moe")])  # runs after calibration #1
    take(1)
    assert cal.price() == [] and not seen  # the first engine waits for #3
    cal.wait("offload", [twin("offload")])
    take(2)
    rows = cal.price()  # moe on #1-#3, offload (#2 before its runs) on #1-#3 too
    assert [r[0] for r in rows] == ["moe", "offload"]
    assert seen["moe"] == pytest.approx((1.6, 13.0)) and seen["offload"] == pytest.approx((1.6, 13.0))
    cal.wait("pagedweight", [twin("pagedweight"), twin("pagedweight")])
    assert json.loads(cache_path().read_text()) == taken[2]  # the next engine's runs read the last one
    take(3)  # after the model's last engine
    rows = cal.price(final=True)
    assert [r[0] for r in rows] == ["pagedweight", "pagedweight"]
    assert seen["pagedweight"] == pytest.approx((1.7, 12.8))  # median of #2-#4: 2.2, 1.5, 1.7 us; 12, 13.4, 12.8
    assert json.loads(cache_path().read_text()) == taken[3] and not cal.waiting


def test_the_log_line_gives_the_models_own_expert_times(tmp_path, monkeypatch):
    """`describe_profile` with the model's shape measurement (`model_entry`): the times `pwbench hw
    calibrate --model` took for one expert, in ms, as measured (not fitted), so a static engine's miss
    can be read against the calibrations its twins were priced on."""
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    from engines.common.peaks import cache_path
    from engines.sim.hardware import cpu_profile
    from harness.bench.simulate import describe_profile, model_entry

    cache_path().write_text(json.dumps(_snapshot(1.6, 13.0)))
    ours = {"model": "/m/ours", "seconds": {"expert": {"1": 4.0e-4, "2": 5.0e-4}, "dequant_packed": {"4": 3.9e-3},
                                            "expert_dequantized": {"1": 2.5e-4}}}
    measurement = {"model_gemm": {"k1": {"model": "/m/other", "seconds": {"expert": {"1": 1.0}}}, "k2": ours}}
    assert model_entry(measurement, "/m/ours") is ours and model_entry(measurement, "/m/none") is None
    line = describe_profile(cpu_profile(), ours)
    assert line.endswith("; one expert (ms, one row): resident 0.400, dequantized 4-bit 3.900, its GEMMs after 0.250")
    # a model whose expert was not timed after dequantization (over DEQUANT_BYTES): the two it has
    del ours["seconds"]["expert_dequantized"]
    assert describe_profile(cpu_profile(), ours).endswith("resident 0.400, dequantized 4-bit 3.900")
    assert "one expert" not in describe_profile(cpu_profile())
    # the dequantization timed in several windows (harness/bench/cpu_ops.py model_gemm_entry): their 4-bit times
    ours["dequant_packed_windows"] = [{"4": 3.6e-3}, {"4": 6.4e-3}, {"4": 3.9e-3}]
    assert describe_profile(cpu_profile(), ours).endswith("dequantized 4-bit 3.900 (the median of 3.600, 6.400, 3.900)")

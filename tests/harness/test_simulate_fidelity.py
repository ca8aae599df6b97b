"""Time fidelity of `--simulate` on this machine (issue 31's "time fidelity" line), one small case.

The bundled model on engine `moe`, an offline batch (every request at t=0: no decision depends
on time), is run for real with its routing recorded, then simulated on the `cpu` profile
replaying that routing. The oracle is the measured run: the simulation must take exactly its
decisions, step by step, and its total time must be within a factor of 2 of the measured one.

Why a factor of 2 (the validation table in docs/simulation-validation.md holds the real
errors): this 2-core machine is shared, and its memory bandwidth and matmul rate move by tens
of percent within seconds; the profile is measured here in well under a second (the peaks of
`pwbench hw`'s PeakProbe and the per-call dispatch), not by the full `pwbench hw calibrate`, so
its curves and its per-step overhead are cpu.toml's stated estimates. The measured side is the
thread's CPU time per step (torch runs on this thread with one intra-op thread), so a
neighbour's burst that deschedules this process does not count; its remaining noise and the
estimates' error stay well inside 2x, while a cost model that lost a whole term (dispatch,
step overhead, attention) or doubled one would not.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from engines.base import EngineRequest
from engines.registry import create_engine

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "engines" / "demo_model")
DECISIONS = ("num_prefill_tokens", "num_decode_tokens", "num_running", "num_waiting", "num_preempted",
             "cached_prompt_tokens", "experts_hit", "context_tokens", "weight_bytes_read", "h2d_bytes",
             "device_kv_bytes")
BOUND = 2.0


def _batch(prefix: str, n: int = 8) -> list[EngineRequest]:
    """n requests at t=0: prompts of 32-95 distinct-ish tokens of the demo vocabulary, 24 tokens out."""
    return [EngineRequest(f"{prefix}{i}", tuple(3 + (53 * i + 17 * j) % 1000 for j in range(32 + 9 * i)), 24,
                          ignore_eos=True) for i in range(n)]


def _run(engine, clock) -> tuple[list[float], list[dict]]:
    """Each step's time on `clock` and its decisions."""
    for r in _batch("warm", 2):  # warm-up (first calls fault pages in); the simulated run takes it too
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    for r in _batch("r"):
        engine.add_request(r)
    times, rows = [], []
    while engine.has_unfinished():
        t = clock()
        out = engine.step()
        times.append(clock() - t)
        rows.append({k: getattr(out, k) for k in DECISIONS})
    return times, rows


@pytest.fixture
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the thread's CPU time is then the whole step's
    yield
    torch.set_num_threads(before)


def _machine_now(probe, torch) -> dict[str, float]:
    """The profile's inputs on this machine now: the roofline peaks and the per-call dispatch, the
    best of 5 rounds of 400 tiny calls (thread CPU time)."""
    peaks = probe()
    tiny, rounds = torch.ones(8), []
    for _ in range(5):
        t = time.thread_time()
        for _ in range(400):
            torch.mul(tiny, tiny)
        rounds.append((time.thread_time() - t) / 400)
    peaks["op_overhead_s"] = min(rounds)
    return peaks


def test_simulated_time_is_within_a_factor_of_2_of_measured(tmp_path, monkeypatch, one_thread):
    import torch

    from engines.common.peaks import cache_path, cpu_model
    from engines.sim.hardware import load_profile
    from harness.hw import PeakProbe

    # Both sides estimate the machine without its neighbours, by the same rule: the measured run is
    # repeated (the least CPU time of each step over the repeats) and the profile's inputs are measured
    # before and after each repeat (the best of each). One run of each once read 96 ms measured against
    # 42 ms simulated in CI (a factor 2.3), where this machine reads 36 / 31 ms.
    trace = tmp_path / "routing.parquet"
    probe, seen, runs = PeakProbe(), [], []
    for repeat in range(3):
        seen.append(_machine_now(probe, torch))
        options = {"model": DEMO, "device": "cpu", **({"record_routing": str(trace)} if repeat == 0 else {})}
        measured = create_engine("moe", options)
        measured.start()
        try:
            runs.append(_run(measured, time.thread_time))
        finally:
            measured.stop()
    seen.append(_machine_now(probe, torch))
    want = runs[0][1]
    assert all(rows == want for _, rows in runs)  # the repeats take the same decisions
    wall = [min(step) for step in zip(*(times for times, _ in runs))]

    # This machine's profile, cached as `pwbench hw` caches it (the cpu profile reads the cache).
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path / "cache"))
    peaks = {"memory_bandwidth_bytes_per_s": max(p["memory_bandwidth_bytes_per_s"] for p in seen),
             "matmul_flops_per_s": max(p["matmul_flops_per_s"] for p in seen),
             "op_overhead_s": min(p["op_overhead_s"] for p in seen),
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    cache_path().parent.mkdir(parents=True)
    cache_path().write_text(json.dumps({cpu_model(): peaks}))
    profile = load_profile("cpu")
    assert profile.memory_bytes_per_s == peaks["memory_bandwidth_bytes_per_s"]  # the profile is this machine's

    simulated = create_engine("moe", {"model": DEMO, "simulate": "cpu", "routing": f"replay:{trace}"})
    simulated.start()
    try:
        predicted, got = _run(simulated, simulated.virtual_clock.now)
        replay = simulated.simulation.routing.describe()
    finally:
        simulated.stop()
    assert replay["replay_misses"] == 0 and replay["replay_hits"] > 0
    assert got == want  # the same decisions, step by step
    assert sum(r["num_decode_tokens"] for r in want) == 8 * 23  # the case is what it says: 8 x 24 tokens out
    ratio = sum(predicted) / sum(wall)
    tokens = 8 * 24
    detail = (f"simulated {sum(predicted) * 1e3:.1f} ms ({tokens / sum(predicted):.0f} tok/s) vs measured "
              f"{sum(wall) * 1e3:.1f} ms CPU time ({tokens / sum(wall):.0f} tok/s) over {len(wall)} steps")
    print(detail)  # shown with -s
    assert 1 / BOUND <= ratio <= BOUND, detail


def test_bench_step_residuals_compare_the_same_batches(tmp_path):
    """harness/bench/simulate.py's step-by-step line: medians of prefill-bearing and decode-only
    steps, measured / simulated, only where both runs made the same batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from harness.bench.simulate import step_residuals

    def write(name: str, durations: list[float], prefill: list[int]) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        pq.write_table(pa.table({"duration_s": durations, "prefill_tokens": prefill,
                                 "decode_tokens": [0 if p else 4 for p in prefill]}), folder / "steps.parquet")
        return folder

    m = write("m", [0.300, 0.050, 0.060, 0.055], [400, 0, 0, 0])
    s = write("s", [0.270, 0.055, 0.066, 0.0605], [400, 0, 0, 0])
    assert step_residuals(m, s) == "prefill 1 steps: 300.0 / 270.0 ms (-10%); decode 3 steps: 55.0 / 60.5 ms (+10%)"
    assert step_residuals(m, write("other", [0.1, 0.1, 0.1, 0.1], [200, 200, 0, 0])) is None
    assert step_residuals(m, tmp_path / "absent") is None
    # batches that differ (an open-loop run's): prefill-only steps paired by (tokens, cached tokens) in
    # order, decode steps of one sequence by each run's median
    def table(name: str, rows: list[tuple[float, int, int, int]]) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        d, p, n, c = zip(*rows)
        pq.write_table(pa.table({"duration_s": d, "prefill_tokens": p, "decode_tokens": n,
                                 "cached_prompt_tokens": c}), folder / "steps.parquet")
        return folder

    # measured: prefills (300, 0) 10 ms and (200, 128) 8 ms, then (300, 0) 12 ms; decode 1.0, 1.2, 1.1 ms
    a = table("a", [(0.010, 300, 0, 0), (0.001, 0, 1, 0), (0.008, 200, 0, 128), (0.0012, 0, 1, 0),
                    (0.012, 300, 0, 0), (0.0011, 0, 1, 0), (0.002, 0, 2, 0)])
    # simulated: the same prefills 9, 8.8, 12.6 ms (-10%, +10%, +5%); one more decode step: 0.9, 1.0, 1.0, 0.95 ms
    b = table("b", [(0.009, 300, 0, 0), (0.0009, 0, 1, 0), (0.0010, 0, 1, 0), (0.0088, 200, 0, 128),
                    (0.0126, 300, 0, 0), (0.001, 0, 1, 0), (0.00095, 0, 1, 0)])
    assert step_residuals(a, b) == ("prefill 3 steps paired by their tokens: median error +5% (-10% to +10%); "
                                    "decode of one sequence (3 / 4 steps): 1.10 / 1.00 ms (-9%)")


def test_bench_counts_the_line_for_simulated_and_repeated_runs():
    """The benchmark's count of issue 31's time cells (tok/s and p50s within 15%, p99s within 25%):
    the simulated run against the compared measured run, and the pair's other measured runs against
    it (the measurement's own spread), by hand."""
    from harness.bench.simulate import line_counts, repeat_error

    m = {"output tok/s": 100.0, "TTFT p50 ms": 10.0, "TTFT p99 ms": 20.0, "TPOT p50 ms": 2.0, "TPOT p99 ms": 4.0,
         "repeats": [{"output tok/s": 90.0, "TTFT p50 ms": 12.0, "TTFT p99 ms": 26.0, "TPOT p50 ms": 2.0,
                      "TPOT p99 ms": 4.0},
                     {"output tok/s": 110.0, "TTFT p50 ms": 10.5, "TTFT p99 ms": 20.0, "TPOT p50 ms": 2.2,
                      "TPOT p99 ms": 5.2}]}
    # simulated: tok/s +14% in, TTFT p50 -16% out, TTFT p99 +24% in, TPOT p50 -14% in, TPOT p99 -26% out
    s = {"output tok/s": 114.0, "TTFT p50 ms": 8.4, "TTFT p99 ms": 24.8, "TPOT p50 ms": 1.72, "TPOT p99 ms": 2.96}
    # the repeats' largest errors: tok/s -10 / +10 (the first), TTFT p50 +20% out, TTFT p99 +30% out,
    # TPOT p50 +10% in, TPOT p99 +30% out
    assert round(repeat_error(m, "TTFT p50 ms"), 6) == 20.0 and round(repeat_error(m, "TPOT p99 ms"), 6) == 30.0
    # against each cell's median over the three measured runs (100, 10.5, 20, 2.0, 4.0): +14% in, -20% out,
    # +24% in, -14% in, -26% out
    assert line_counts([("moe", "offline", m, s)]) == {"cells": 5, "simulated": 3, "repeated cells": 5,
                                                       "repeats": 2, "both off": 2, "vs median": 3}
    once = {k: v for k, v in m.items() if k != "repeats"}
    assert line_counts([("moe", "offline", once, s), ("moe", "rag_long", once, {})]) == {
        "cells": 5, "simulated": 3, "repeated cells": 0, "repeats": 0, "both off": 0, "vs median": 0}


def test_bench_reprices_kept_runs_with_their_batches(tmp_path):
    """`harness.bench.simulate --keep DIR` then `--reprice DIR` (how a GPU machine's runs are priced
    again here): the repriced run replays the kept measured run's routing and takes its batches
    (the step line appears only where both runs' steps align), with its KV capacity and copies."""
    import os
    import subprocess
    import sys

    keep = tmp_path / "keep"
    bench = [sys.executable, "-m", "harness.bench.simulate"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PWBENCH_CACHE": str(tmp_path / "cache")}
    first = subprocess.run([*bench, "--models", "demo", "--engines", "offload", "--workloads", "offline",
                            "--requests", "2", "--repeats", "1", "--no-calibration", "--keep", str(keep)],
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    # --recount reads the kept folders back: the same cells (time, control plane, send lag; the core
    # share is not kept) and the same count as the run printed
    counted = subprocess.run([*bench, "--recount", str(keep)], capture_output=True, text=True, cwd=ROOT, env=env,
                             timeout=120)
    assert counted.returncode == 0, counted.stderr[-2000:]
    for prefix, cells in (("| offload | offline |", slice(0, 11)), ("demo: time cells within the line", slice(None))):
        rows = [[line.rstrip(" |").split(" | ")[cells] for line in out.stdout.splitlines() if line.startswith(prefix)]
                for out in (first, counted)]
        assert len(rows[0]) == 1 and rows[0] == rows[1], rows
    again = subprocess.run([*bench, "--reprice", str(keep), "--profile", "cpu"], capture_output=True, text=True,
                           cwd=ROOT, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    lines = [line for line in again.stdout.splitlines() if line.startswith("demo-offload-offline:")]
    assert len(lines) == 1 and "step medians measured / simulated: prefill 1 steps" in lines[0]
    row = next(line for line in again.stdout.splitlines() if line.startswith("| offload | offline |"))
    kv, h2d = row.split(" | ")[7:9]  # KV capacity, h2d bytes per output token: equal on both sides
    assert kv.endswith("(+0%)") and h2d.endswith("(+0%)"), row
    bad = subprocess.run([*bench, "--reprice", str(tmp_path / "absent")], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=60)
    assert bad.returncode != 0 and "not a folder" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_hw_calibrate_fits_the_runtime_overheads_and_prefill_steps_pay_them(tmp_path, monkeypatch):
    """`pwbench hw calibrate --model TINY` on this machine (~70 s): the runtime's time per counted
    torch call, the per-layer prefill rates and the engines' parts' overheads are fitted on the
    bundled model (engines/sim/calibrate.py's fits, tested by hand in tests/unit/test_sim_hardware.py),
    land in the cpu profile with their sources; a simulated prefill step pays exactly layers x
    (element rate x tokens x hidden + segment rate x segments + step rate) more than on the same
    profile without them (control time off: compute only); and the tiny checkpoint given with
    --model gets prefill rates of its own, which its simulated prefill pays instead."""
    import dataclasses

    from typer.testing import CliRunner

    from engines.runtime.checkpoint import open_checkpoint
    from engines.runtime.shape import model_shape
    from engines.sim.cost import shape_key
    from engines.sim.hardware import MODEL_PREFILL_TABLES, load_profile, profile_toml
    from harness.cli import app
    from tests.tiny_models import build_hf_model, save_checkpoint

    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path / "cache"))
    tiny = save_checkpoint(build_hf_model("mixtral"), tmp_path / "tiny")
    done = CliRunner().invoke(app, ["hw", "calibrate", "--json", "--model", str(tiny)])
    assert done.exit_code == 0, done.output
    p = load_profile("cpu")
    assert p.step_overhead_s == 0 and p.op_overhead_s > 0 and "per call" in p.sources["op_overhead_s"]
    assert p.decode_sequence_overhead_s >= 0 and "decode sequence" in p.sources["decode_sequence_overhead_s"]
    assert min(p.prefill_element_overhead_s, p.prefill_segment_overhead_s, p.prefill_step_overhead_s) >= 0
    assert "prefill steps of the bundled model" in p.sources["prefill_segment_overhead_s"]
    # each engine's parts, stepped beside engine moe: one key each, full priced by two of them (not fitted)
    for table in (p.executor_overhead_s, p.executor_token_overhead_s):
        assert set(table) == {"offload", "pagedweight", "layer_major"} and min(table.values()) >= 0
    assert "stepped beside engine moe" in p.sources["executor_overhead_s"]

    without = tmp_path / "without.toml"
    without.write_text(profile_toml(dataclasses.replace(p, prefill_element_overhead_s=0.0,
                                                        prefill_segment_overhead_s=0.0, prefill_step_overhead_s=0.0)))
    firsts = []
    for prof in ("cpu", str(without)):
        engine = create_engine("moe", {"model": DEMO, "simulate": prof, "routing": "uniform", "control_time": "off"})
        engine.start()
        try:
            for r in _batch("p", 5):
                engine.add_request(r)
            out = engine.step()
            firsts.append((out.num_prefill_tokens, engine.executor.last.seconds))
            config = engine.checkpoint.config
        finally:
            engine.stop()
    (tokens, with_s), (_, without_s) = firsts
    shape = model_shape(config, 4)
    want = shape.layers * (p.prefill_element_overhead_s * tokens * shape.hidden + p.prefill_segment_overhead_s * 5
                           + p.prefill_step_overhead_s)
    assert tokens == sum(32 + 9 * i for i in range(5))
    assert with_s - without_s == pytest.approx(want, rel=1e-9, abs=1e-12)

    # the tiny model's own rates, by its shape key, from the probe on its checkpoint
    tiny_shape = model_shape(open_checkpoint(str(tiny)).config, 4)
    key = shape_key(tiny_shape)
    own = [getattr(p, t)[key] for t in MODEL_PREFILL_TABLES]
    assert min(own) >= 0 and str(tiny) in p.sources[f"model_prefill_overhead.{key}"]
    bare = tmp_path / "bare.toml"
    bare.write_text(profile_toml(dataclasses.replace(p, prefill_element_overhead_s=0.0, prefill_segment_overhead_s=0.0,
                                                     prefill_step_overhead_s=0.0,
                                                     **{t: {} for t in MODEL_PREFILL_TABLES})))
    firsts = []
    for prof in ("cpu", str(bare)):
        engine = create_engine("moe", {"model": str(tiny), "simulate": prof, "routing": "uniform",
                                       "control_time": "off"})
        engine.start()
        try:
            for i in range(5):  # the tiny model's vocabulary: 257 tokens
                engine.add_request(EngineRequest(f"t{i}", tuple(3 + (53 * i + 17 * j) % 250 for j in range(32 + 9 * i)),
                                                 24, ignore_eos=True))
            out = engine.step()
            firsts.append((out.num_prefill_tokens, engine.executor.last.seconds))
        finally:
            engine.stop()
    (tokens, with_s), (_, without_s) = firsts
    want = tiny_shape.layers * (own[0] * tokens * tiny_shape.hidden + own[1] * 5 + own[2])
    assert with_s - without_s == pytest.approx(want, rel=1e-9, abs=1e-12)

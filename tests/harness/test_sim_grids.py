"""harness/bench/simulate.py `--prefill-grid`: engine moe's prefill step by prompt lengths, and a chunk
after a prefix-cache hit (an open-loop run's later turns), measured and simulated on the same requests.
Oracle: the step each row times computes the tokens the row names (the engine's own step output), on
both sides, and the simulated side replays the measured side's routing without a miss."""

from __future__ import annotations

from engines.common.demo import demo_model_path


def test_prefill_grid_times_fresh_prompts_and_a_chunk_after_a_cached_prefix(monkeypatch, tmp_path):
    import harness.bench.simulate as bench

    monkeypatch.setattr(bench, "PREFILL_GRID", ((32,), (16,) * 3))
    monkeypatch.setattr(bench, "PREFILL_AFTER_CACHED", ((32, 48),))
    monkeypatch.setattr(bench, "PREFILL_GRID_REPEATS", 1)
    timed: list[tuple[int, int]] = []  # (prefill tokens, decode tokens) of every step that prefills
    engines = []
    real = bench.probe_engine

    def probe(*args, **kwargs):
        engine, clock = real(*args, **kwargs)
        step = engine.step

        def recorded():
            out = step()
            if out.num_prefill_tokens:
                timed.append((out.num_prefill_tokens, out.num_decode_tokens))
            return out

        engine.step = recorded
        engines.append(engine)
        return engine, clock

    monkeypatch.setattr(bench, "probe_engine", probe)
    trace = str(tmp_path / "grid.routing.parquet")
    measured = bench.prefill_grid(str(demo_model_path()), "cpu", "", 2, trace)
    steps_measured = list(timed)
    timed.clear()
    simulated = bench.prefill_grid(str(demo_model_path()), "cpu", "cpu", 2, trace)
    keys = {(32,), (16, 16, 16), ("cached", 32, 48)}
    assert set(measured) == set(simulated) == keys
    assert all(v > 0 for v in [*measured.values(), *simulated.values()])
    # per round: the 32-token prompt, the three 16s, the prefix's own prefill, then only the 48 new tokens
    assert steps_measured == timed == [(32, 0), (48, 0), (32, 0), (48, 0)] * 2
    assert bench._lengths(("cached", 32, 48)) == "48 after 32 cached"
    replay = engines[-1].executor.routing
    assert replay.hits > 0 and replay.misses == 0


def _kept_run(folder, tag, measured, simulated=None):
    """A --keep folder's pair as the benchmark writes it: {tag}-measured[-rK]/run.json per measured
    run, {tag}-simulated/run.json; each run's summary holds (tok/s, TTFT p50, TTFT p99, TPOT p50, TPOT p99)."""
    import json

    def write(name, v):
        (folder / name).mkdir(parents=True)
        summary = {"output_tokens_per_s": v[0], "ttft_ms": {"p50": v[1], "p99": v[2]},
                   "tpot_ms": {"p50": v[3], "p99": v[4]}, "duration_s": 1.0}
        (folder / name / "run.json").write_text(json.dumps({"summary": summary, "engine": {}}))

    for k, v in enumerate(measured):
        write(f"{tag}-measured" + (f"-r{k}" if k else ""), v)
    write(f"{tag}-simulated", simulated or measured[0])


def test_across_counts_the_measured_medians_of_two_kept_runs_against_each_other(tmp_path, capsys, monkeypatch):
    """`--across A B`: each time cell's median over a folder's measured runs, one folder's against the
    other's, within issue 31's line (tok/s and p50s 15%, p99s 25%). Hand-computed: A's medians
    (100, 10, 20, 2, 4) (the middle of three runs), B's (110, 12, 26, 2, 3) (one run): tok/s +10% in,
    TTFT p50 +20% off, TTFT p99 +30% off, TPOT p50 0% in, TPOT p99 -25% in (at the line)."""
    import sys

    import pytest

    from harness.bench import simulate as bench

    a, b = tmp_path / "a", tmp_path / "b"
    _kept_run(a, "demo-moe-offline", [(90, 9, 19, 2, 4), (100, 10, 20, 2, 4), (120, 11, 21, 2, 4)])
    _kept_run(b, "demo-moe-offline", [(110, 12, 26, 2, 3)])
    monkeypatch.setattr(sys, "argv", ["simulate", "--across", str(a), str(b)])
    bench.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "a / b: time cells of the measured medians within the line: demo 3 of 5; all 3 of 5"
    assert sorted(line.split(" ms ")[0].strip() for line in out[1:]) == [
        "off: demo moe offline TTFT p50", "off: demo moe offline TTFT p99"]
    monkeypatch.setattr(sys, "argv", ["simulate", "--across", str(a), str(tmp_path / "none")])
    with pytest.raises(SystemExit, match="not a folder"):
        bench.main()

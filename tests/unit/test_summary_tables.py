"""`pwbench show` lines for an engine's own tables (pagedweight's expert_usage, expert_bits,
fallbacks), on hand-made folders whose expected text is worked out by hand."""

from __future__ import annotations

import pandas as pd

from reports.summary_table import rows, table_rows


def test_usage_bits_and_fallbacks_are_summarised(tmp_path):
    pd.DataFrame({"layer": [0, 0, 0, 0, 1, 1], "expert": [1, 0, 3, 2, 0, 1], "tokens": [10, 30, 20, 40, 5, 15],
                  "routing_mass": [1.0] * 6}).to_parquet(tmp_path / "expert_usage.parquet")
    # layer 0: step 0 mean (16+16)/2 = 16, step 16 mean (4+2)/2 = 3, step 32 mean 8 -> mean 9, min 3 at step 16
    # layer 1: 8, 8, 16 -> mean 10.7, min 8 at step 0 (the first minimum)
    rows = [(0, 0, 0, 16), (0, 0, 1, 16), (0, 1, 0, 8), (16, 0, 0, 4), (16, 0, 1, 2), (16, 1, 0, 8),
            (32, 0, 0, 8), (32, 0, 1, 8), (32, 1, 0, 16)]
    pd.DataFrame(rows, columns=["engine_step", "layer", "expert", "bits"]).assign(importance=0.5).to_parquet(
        tmp_path / "expert_bits.parquet")
    pd.DataFrame([{"engine_step": 7, "layer": 1, "expert": 0, "layer_error": 0.3, "expert_error": 0.4,
                   "from_bits": 2, "floor_bits": 3}]).to_parquet(tmp_path / "fallbacks.parquet")
    got = dict(table_rows(tmp_path))
    assert got["experts layer 0"] == "selected 30% / 10% / 40% / 20% of 100 token choices (expert 0, 1, ...)"
    assert got["experts layer 1"] == "selected 25% / 75% of 20 token choices (expert 0, 1, ...)"
    assert got["bits matrix"] == ("3 snapshots, steps 0-32: layer 0 mean 9.0 (min 3.0 at step 16); "
                                  "layer 1 mean 10.7 (min 8.0 at step 0)")
    assert got["fallbacks"] == "1 events: step 7 layer 1 expert 0 2 -> floor 3 bits"


def test_a_folder_without_engine_tables_adds_nothing(tmp_path):
    assert table_rows(tmp_path) == []


def test_verdict_lines_when_the_run_has_them(tmp_path):
    """Fidelity, capacity (a lower bound when the search passed at its highest rate), stability
    and transitions each get a line of `pwbench show`, from the run.json fields."""
    from result_folders import make_run

    from harness.results import read_run

    run = read_run(make_run(tmp_path / "d", decode_ms_per_token=0.1))
    run["summary"]["fidelity"] = {"compared": 4, "identical": 3, "fidelity": 0.75, "flips_lost": 1,
                                  "flips_gained": 0, "token_match_mean": 0.9}
    run["capacity"] = {"requests_per_s": 40.0, "attainment": 0.95, "slo": {"ttft_ms": 500.0},
                       "limit": "above_highest_rate", "points": [{}, {}]}
    run["stability"] = {"probes": 8, "repeats": 3, "loads": [{"name": "idle", "probes_varying": 0, "flips": 1}]}
    run["summary"]["transitions"] = {"windows": 2, "per_minute": 6.0, "itl_ms_inside": {"p99": 12.0},
                                     "itl_ms_outside": {"p99": 9.0}}
    lines = dict(rows(run))
    assert lines["vs full precision"] == ("3/4 answers identical (75.0%), 1 lost / 0 gained flips, "
                                          "token match 90.0%")
    assert lines["capacity at SLO"] == ">= 40.00 req/s with 95% of requests within ttft_ms<=500 (2 points)"
    assert lines["stability"] == "8 probes x 3: idle 0 varying / 1 flips"
    assert lines["bit transitions"] == "2 windows (6.0/min), ITL p99 12.0 ms inside vs 9.0 ms outside"

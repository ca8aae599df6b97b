"""PagedWeight under a budget that forces bit-width transitions, end to end: requests.parquet
carries each request's bits (equal to the engine's request_bits table, which
tests/integration/test_pagedweight_precision.py checks against the bits matrix),
summary.transitions equals a recomputation from the folder's files, and the report shows
latency inside vs outside the transition windows."""

from __future__ import annotations

import json

import pytest

from harness.precision import transition_summary
from harness.results import read_rows
from harness.run import RunArgs, execute
from reports import roi
from reports.html import render
from reports.runs import load_runs
from workloads.registry import WorkloadSpec

BUDGET = 2_511_052  # the demo suite's default budget: KV and experts compete


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    spec = WorkloadSpec("rag_long", requests=10, seed=1, arrival="offline", scale=0.25, time_scale=0.1)
    out = tmp_path_factory.mktemp("precision") / "pagedweight"
    execute(RunArgs(workload=spec, given=frozenset({"requests", "seed", "arrival", "scale", "time_scale"}),
                    engine="pagedweight", engine_options={"budget_bytes": BUDGET}, output=str(out), warmup=0,
                    quality=False, telemetry_hz=20))
    return out


def test_requests_carry_the_engines_per_request_bits(folder):
    table = {r["request_id"]: r for r in read_rows(folder, "request_bits")}
    rows = read_rows(folder, "requests")
    assert rows and all(r["request_id"] in table for r in rows)
    for r in rows:
        b = table[r["request_id"]]
        assert (r["bits_mean"], r["bits_min"], r["in_transition"]) == (b["bits_mean"], b["bits_min"],
                                                                        b["in_transition"])
        assert r["bits_min"] <= r["bits_mean"] <= 16
    # the budget forces transitions: some requests ran below full precision, during a transition
    assert any(r["in_transition"] for r in rows) and min(r["bits_mean"] for r in rows) < 16


def test_transitions_summary_and_the_report(folder):
    run = json.loads((folder / "run.json").read_text())
    rows, steps = read_rows(folder, "requests"), read_rows(folder, "steps")
    again = transition_summary(rows, steps, run["summary"]["duration_s"])
    saved = run["summary"]["transitions"]
    assert saved.keys() == again.keys()
    for key, value in again.items():
        assert saved[key] == (pytest.approx(value) if not isinstance(value, dict) else
                              {k: pytest.approx(v) for k, v in value.items()})
    assert again["windows"] >= 1 and again["move_bytes"] > 0 and again["steps_inside"] >= 1
    html = render(load_runs([folder]), roi.Prices())
    section = html[html.index("<h2 id='precision'>"):]
    assert "ITL p50 inside / outside ms" in section
    assert f"{again['windows']:,}" in section

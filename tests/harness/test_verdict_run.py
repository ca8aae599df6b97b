"""`pwbench run --find-capacity --stability` on the bundled demo model: the capacity search and
the stability probes run after the measured run on the same engine, land in run.json, and the
report shows them (capacity column, stability section)."""

from __future__ import annotations

import json
from html import escape

import pytest
from result_folders import pwbench

from reports import roi
from reports.html import render
from reports.runs import load_runs

pytestmark = pytest.mark.slow  # a demo-model run with a capacity search and probes: ~35 s


def test_capacity_and_stability_reach_run_json_and_the_report(tmp_path):
    out = tmp_path / "moe"
    proc = pwbench("run", "--workload", "rag_long", "--engine", "moe", "--requests", "20", "--rate", "4",
                   "--find-capacity", "--attainment", "0.95", "--stability", "--stability-probes", "4",
                   "--slo", "ttft_ms=500,tpot_ms=150", "--no-quality", "--warmup", "1", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "capacity: " in proc.stderr and "stability: " in proc.stderr  # a progress line per point and load
    run = json.loads((out / "run.json").read_text())
    cap, stab = run["capacity"], run["stability"]
    assert cap["attainment"] == 0.95 and cap["slo"] == {"ttft_ms": 500.0, "tpot_ms": 150.0}
    passed = [p["rate"] for p in cap["points"] if p["passed"]]
    assert cap["requests_per_s"] == (max(passed) if passed else None)
    assert all(p["requests"] == 20 for p in cap["points"])
    assert [x["name"] for x in stab["loads"]] == ["idle", "near capacity", "above capacity"]
    assert stab["probes"] == 4 and stab["repeats"] == 3
    html = render(load_runs([out]), roi.Prices())
    assert "<h2 id='stability'>" in html and escape(stab["finding"]) in html
    rows = roi.executive(load_runs([out]), roi.Prices())
    assert rows[0]["capacity_rps"].value == cap["requests_per_s"]

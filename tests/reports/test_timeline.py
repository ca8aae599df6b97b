"""The report's timeline spans the run it draws: telemetry and steps share the run's clock
(seconds since the measured run started), and CPU is a share of all cores. The screenshot of
the timeline in Chromium is in test_browser.py."""

from __future__ import annotations

import json
import re

import pytest
from result_folders import make_run

from harness.results import read_rows
from reports import roi
from reports.html import render
from reports.runs import load_runs


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("timeline") / "dummy", base_ms=20.0, decode_ms_per_token=1.0)


def timeline(html: str) -> dict:
    spec = re.search(r'<div id="timeline-\d+".*?var f=(\{.*?\});Plotly', html, re.S).group(1)
    return json.loads(spec)


def test_timeline_spans_the_run(run):
    steps = read_rows(run, "steps")
    end = steps[-1]["t_s"] + steps[-1]["duration_s"]
    period = json.loads((run / "run.json").read_text())["telemetry"]["period_s"]
    fig = timeline(render(load_runs([run]), roi.Prices()))
    xs = [x for trace in fig["data"] for x in trace["x"]]
    assert min(xs) >= 0 and max(xs) <= end + period + 0.5  # before: the first sample sat at the host's uptime
    cpu = next(t for t in fig["data"] if t["name"] == "process_cpu_percent")
    assert all(0 <= y <= 100 for y in cpu["y"]) and fig["layout"]["yaxis"]["range"] == [0, 100]

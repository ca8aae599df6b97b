"""The report in a real browser: headless Chromium (Debian's `chromium`, which .ci/run installs)
opens it from a file with the network blocked, logs no console message, renders every chart
(each plotly div holds its SVG), and saves a screenshot to artifacts/report-first-screen.png;
the timeline section alone is shot to artifacts/report-timeline.png (its time axis spans the
run: tests/reports/test_timeline.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from reports import roi
from reports.html import write_report
from reports.runs import load_runs

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


def chromium(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                           "--host-resolver-rules=MAP * ~NOTFOUND", "--enable-logging=stderr", "--v=0",
                           "--virtual-time-budget=20000", "--window-size=1400,900", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=240)


# Skipped only outside CI: .ci/run installs chromium, so there a missing browser is a failure.
@pytest.mark.skipif(CHROMIUM is None and os.environ.get("CI") != "true",
                    reason="needs chromium (apt-get install -y chromium; .ci/run installs it)")
def test_report_renders_offline_in_chromium(runs, tmp_path):
    page = write_report(load_runs([runs]), roi.Prices(), tmp_path / "report.html")
    charts = len(re.findall(r'class="chart plotly-chart"', page.read_text()))
    assert charts >= 8
    proc = chromium(page, tmp_path / "profile", "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []
    dom = proc.stdout
    # Plotly.newPlot marks each div it drew with js-plotly-plot and puts an <svg class="main-svg"> in it
    drawn = re.findall(r'class="chart plotly-chart js-plotly-plot"', dom)
    assert len(drawn) == charts
    assert dom.count('class="main-svg"') >= charts
    assert "Recommendation:" in dom
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report-first-screen.png"
    shot.unlink(missing_ok=True)
    proc = chromium(page, tmp_path / "profile2", f"--screenshot={shot}")
    assert proc.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(CHROMIUM is None and os.environ.get("CI") != "true",
                    reason="needs chromium (apt-get install -y chromium; .ci/run installs it)")
def test_timeline_screenshot(runs, tmp_path):
    page = write_report(load_runs([runs]), roi.Prices(), tmp_path / "report.html")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report-timeline.png"
    shot.unlink(missing_ok=True)
    target = page.with_name("timeline.html")
    # the timeline section alone, so the screenshot's first screen is the chart
    html = page.read_text()
    head, body = html.split("<body>", 1)
    section = body[body.index("<h2 id='timeline'>"):]
    section = section[: section.index("<h2", 10)] if "<h2" in section[10:] else section
    target.write_text(f"{head}<body>{section}</body></html>")
    proc = chromium(target, tmp_path / "profile", f"--screenshot={shot}")
    assert proc.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

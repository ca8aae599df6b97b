"""Simulated and measured numbers are kept apart: a simulated run's report says so on its
first screen (profile, cost model, routing, quality not simulated), compare says so first,
a report over both leaves the other kind out as not comparable, and gate refuses to gate one
against the other. Real runs: engine moe on the bundled model, measured and simulated on the
`cpu` profile, same workload (tests/result_folders.py)."""

from __future__ import annotations

import pytest
from result_folders import make_run
from typer.testing import CliRunner

from harness.cli import app


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("simulated")
    return make_run(root / "measured", engine="moe"), make_run(root / "simulated", engine="moe", simulate="cpu")


def test_simulated_report_says_so_on_its_first_screen(runs, tmp_path):
    _, simulated = runs
    done = cli("report", simulated, "--output", tmp_path / "r.html")
    assert done.exit_code == 0, done.output
    html = (tmp_path / "r.html").read_text()
    first = html[html.index('id="executive"'):html.index('id="recommendation"')]
    assert "Simulated, not measured." in first and "hardware profile cpu" in first
    assert "Quality is not simulated" in first and "kind=synthetic" in first
    assert "on simulated cpu;" in html
    out = cli("compare", simulated, "--markdown")
    assert out.exit_code == 0 and out.stdout.startswith("**SIMULATED on cpu")


def test_measured_and_simulated_are_never_compared(runs, tmp_path):
    measured, simulated = runs
    done = cli("report", measured, simulated, "--output", tmp_path / "both.html")
    assert done.exit_code == 0, done.output
    html = (tmp_path / "both.html").read_text()
    assert "not comparable" in html and "simulated cpu" in html
    gated = cli("gate", "--baseline", measured, "--candidate", simulated)
    assert gated.exit_code == 2
    assert "simulated on cpu (vs measured)" in gated.output and "Traceback" not in gated.output

"""Damaged and unfinished result folders through `report`, `compare`, `gate` and `show`, run as
the CLI in-process (typer's CliRunner): each damage (run.json `null`, `summary` a string, `status`
5, a requests.parquet of another schema, a 0-byte steps.parquet) exits 2 with one line naming
the file, never a traceback; an unfinished run is flagged and never recommended, and gate fails
it; gate refuses runs of different workloads, seeds or models unless --allow-different.

Every folder is a copy of a real dummy-engine run (tests/result_folders.py), damaged by hand."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
from result_folders import make_run
from typer.testing import CliRunner

from harness.cli import app

COMMANDS = ("report", "compare", "gate", "show")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    make_run(root / "fast", decode_ms_per_token=0.5)
    make_run(root / "seed1", seed=1, decode_ms_per_token=0.5)
    return root


def copy(clean, tmp_path, name="fast", to="cand"):
    return shutil.copytree(clean / name, tmp_path / to)


def edit_run(folder, change):
    run = json.loads((folder / "run.json").read_text())
    run = change(run)
    (folder / "run.json").write_text(json.dumps(run))
    return folder


def _null(folder):
    (folder / "run.json").write_text("null")


def _summary_string(folder):
    edit_run(folder, lambda r: {**r, "summary": "fast"})


def _status_5(folder):
    edit_run(folder, lambda r: {**r, "status": 5})


def _requests_other_schema(folder):
    pd.DataFrame({"id": ["a", "b"], "latency": [1.0, 2.0]}).to_parquet(folder / "requests.parquet")


def _requests_wrong_type(folder):
    frame = pd.read_parquet(folder / "requests.parquet")
    frame["arrival_s"] = frame["arrival_s"].astype(str)
    frame.to_parquet(folder / "requests.parquet")


def _steps_empty_file(folder):
    (folder / "steps.parquet").write_bytes(b"")


# damage -> (the file the line names, what it says)
DAMAGE = {
    "run.json null": (_null, "run.json", "expected a JSON object, got NoneType"),
    "summary a string": (_summary_string, "run.json", "field summary must be an object"),
    "status 5": (_status_5, "run.json", "field status must be a string, got 5"),
    "requests other schema": (_requests_other_schema, "requests.parquet", "column request_id is missing"),
    "requests arrival_s text": (_requests_wrong_type, "requests.parquet", "column arrival_s must hold numbers"),
    "steps 0 bytes": (_steps_empty_file, "steps.parquet", "not a readable parquet file"),
}


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def args_for(command, clean, folder, tmp_path):
    return {"report": ["report", folder, "--output", tmp_path / "r.html"],
            "compare": ["compare", folder],
            "gate": ["gate", "--baseline", clean / "fast", "--candidate", folder, "--junit", tmp_path / "j.xml"],
            "show": ["show", folder]}[command]


def one_error_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # not an uncaught error
    assert "Traceback" not in result.output
    lines = result.stderr.removesuffix("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_file_is_one_line_naming_it(clean, tmp_path, damage, command):
    make, file, says = DAMAGE[damage]
    folder = copy(clean, tmp_path)
    make(folder)
    line = one_error_line(cli(*args_for(command, clean, folder, tmp_path)))
    assert f"{folder / file}: " in line and says in line, line
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "j.xml").exists()


@pytest.mark.parametrize("damage", ["summary a string", "status 5"])
def test_damaged_baseline_is_one_line_too(clean, tmp_path, damage):
    make, file, says = DAMAGE[damage]
    folder = copy(clean, tmp_path, to="base")
    make(folder)
    line = one_error_line(cli("gate", "--baseline", folder, "--candidate", clean / "fast"))
    assert f"{folder / file}: " in line and says in line


def test_show_recomputes_the_summary_from_the_files(clean, tmp_path, capsys):
    """reports.summary_table.show_run (what `pwbench show` is to call): the summary from the
    parquet rows equals the one run.json stored at the end of the run; a stored summary edited
    by hand is named as different, and the recomputed numbers are printed."""
    from harness.errors import HarnessError
    from reports.summary_table import show_run

    show_run(clean / "fast", as_json=True)
    out, err = capsys.readouterr()
    assert json.loads(out) == json.loads((clean / "fast" / "run.json").read_text())["summary"] and err == ""
    edited = edit_run(copy(clean, tmp_path), lambda r: {**r, "summary": {**r["summary"], "completed": 99}})
    show_run(edited, as_json=True)
    out, err = capsys.readouterr()
    assert json.loads(out)["completed"] == 6 and "stored summary differs in completed" in err
    show_run(edited)
    out, _ = capsys.readouterr()
    assert "6 completed, 0 failed" in out
    _steps_empty_file(edited)
    with pytest.raises(HarnessError, match="steps.parquet: not a readable parquet file"):
        show_run(edited)


def test_gate_fails_an_unfinished_candidate_and_says_why(clean, tmp_path):
    # a copy whose run.json says what the runner writes after Ctrl-C (harness/runner.py)
    stopped = edit_run(copy(clean, tmp_path, to="stopped"), lambda r: {**r, "status": "interrupted"})
    result = cli("gate", "--baseline", clean / "fast", "--candidate", stopped, "--junit", tmp_path / "j.xml")
    assert result.exit_code == 1, result.output
    assert "FAIL       deterministic run_status" in result.stdout and "status interrupted" in result.stdout
    assert "an unfinished run is not judgeable" in result.stdout and "gate: FAIL: 1 regressions" in result.stdout
    assert 'name="run_status"' in (tmp_path / "j.xml").read_text()
    # a real failed run (the dummy engine fails after 20 steps): the same
    failed = make_run(tmp_path / "failed", decode_ms_per_token=0.5, fail_after_steps=20)
    assert json.loads((failed / "run.json").read_text())["status"] == "failed"
    result = cli("gate", "--baseline", clean / "fast", "--candidate", failed)
    assert result.exit_code == 1 and "status failed" in result.stdout
    # and an unfinished run is no baseline
    line = one_error_line(cli("gate", "--baseline", tmp_path / "b.json", "--candidate", stopped, "--update-baseline"))
    assert "an unfinished run cannot be a baseline" in line and not (tmp_path / "b.json").exists()


def test_gate_refuses_other_workload_seed_or_model_unless_allowed(clean, tmp_path):
    line = one_error_line(cli("gate", "--baseline", clean / "fast", "--candidate", clean / "seed1"))
    assert "different workloads, seeds or models: seed=1 (vs 0)" in line and "--allow-different" in line
    fewer = edit_run(copy(clean, tmp_path, to="fewer"),
                     lambda r: {**r, "config": {**r["config"], "workload": {**r["config"]["workload"], "requests": 5}}})
    assert "requests=5 (vs 6)" in one_error_line(cli("gate", "--baseline", clean / "fast", "--candidate", fewer))
    other = edit_run(copy(clean, tmp_path, to="other-model"),
                     lambda r: {**r, "config": {**r["config"], "model": "/models/other_model"}})
    assert "model='other_model' (vs None)" in one_error_line(
        cli("gate", "--baseline", clean / "fast", "--candidate", other))
    allowed = cli("gate", "--baseline", clean / "fast", "--candidate", clean / "seed1", "--allow-different")
    assert allowed.exit_code in (0, 1) and "note: gating runs that differ (--allow-different): seed=1" in allowed.stderr
    assert "gate: " in allowed.stdout
    # a baseline JSON keeps the identity, so the check holds against it too
    base = tmp_path / "base.json"
    assert cli("gate", "--baseline", base, "--candidate", clean / "fast", "--update-baseline").exit_code == 0
    assert json.loads(base.read_text())["identity"]["workload"]["seed"] == 0
    assert "seed=1 (vs 0)" in one_error_line(cli("gate", "--baseline", base, "--candidate", clean / "seed1"))
    assert cli("gate", "--baseline", base, "--candidate", clean / "fast").exit_code == 0


def arm(clean, folder, goodput_rps, **config):
    """A copy of the dummy run as another arm (engine options, or a suite row) whose summary
    says `goodput_rps`: hand-set, so which arm is best never depends on this machine's speed."""
    shutil.copytree(clean / "fast", folder)
    return edit_run(folder, lambda r: {**r, "summary": {**r["summary"], "goodput_requests_per_s": goodput_rps},
                                       "config": {**r["config"], **config}})


def recommendation(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("**Recommendation:**"))


def test_compare_and_report_flag_an_unfinished_run_and_never_recommend_it(clean, tmp_path):
    """Arms of 10, 5 and 40 goodput req/s: complete, the 40 one is the one the recommendation
    names; marked interrupted, it is flagged and the recommendation names the 10 one."""
    suite = tmp_path / "suite"
    for name, rps in (("fast", 10.0), ("slow", 5.0), ("stopped", 40.0)):
        arm(clean, suite / name, rps, engine_options={"decode_ms_per_token": rps})
    before = cli("compare", suite, "--markdown")
    assert before.exit_code == 0 and recommendation(before.stdout).startswith("**Recommendation:** stopped has")
    edit_run(suite / "stopped", lambda r: {**r, "status": "interrupted"})
    result = cli("compare", suite, "--markdown")
    assert result.exit_code == 0, result.output
    rows = {line.split(" | ")[0][2:] for line in result.stdout.splitlines() if line.startswith("| ")}
    assert {"stopped (unfinished)", "fast", "slow"} <= rows
    assert "- unfinished: stopped: status interrupted: not a whole run, left out of the recommendation" \
        in result.stdout
    assert recommendation(result.stdout).startswith("**Recommendation:** fast has the highest goodput")
    assert "unfinished: stopped: status interrupted" in cli("compare", suite).stdout  # the terminal table too
    out = tmp_path / "r.html"
    assert cli("report", suite, "--output", out).exit_code == 0
    html = out.read_text()
    assert "stopped (unfinished)" in html and "status interrupted: not a whole run" in html
    assert "stopped" not in html[html.index('id="recommendation"'):].split("</div>")[0]


def test_an_unfinished_repeat_leaves_out_its_own_arm_only(clean, tmp_path):
    """Suite layout: every engine's repeats are r1, r2, ...; an interrupted fastest/r1 leaves
    out the fastest arm, not every arm holding an r1."""
    suite = tmp_path / "suite"
    for row, rps in (("fast", 10.0), ("slow", 5.0), ("fastest", 40.0)):
        arm(clean, suite / row / "r1", rps, row=row, repeat=1, engine_options={"decode_ms_per_token": rps})
    edit_run(suite / "fastest" / "r1", lambda r: {**r, "status": "interrupted"})
    result = cli("compare", suite, "--markdown")
    assert result.exit_code == 0, result.output
    assert "- unfinished: fastest: status interrupted: not a whole run" in result.stdout
    assert recommendation(result.stdout).startswith("**Recommendation:** fast has the highest goodput")

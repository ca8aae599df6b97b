"""`pwbench gate`: identical runs pass; 5% fewer tokens/s on repeated samples with stated noise
passes a 10% tolerance and fails a 2% one; a changed deterministic metric fails; p99s and
under-repeated timings are not judged, with the reason; bad input exits 2 with one line; the
JUnit file parses as JUnit XML; and the project's own gate: the bundled model's `moe` run
against the committed baseline of deterministic metrics (tests/baselines/demo_moe.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from xml.etree import ElementTree as ET

from result_folders import pwbench

BASELINE = Path(__file__).resolve().parents[1] / "baselines" / "demo_moe.json"
# tokens/s of 5 repeated runs: 1% noise around 100 (stated, seeded by hand)
SAMPLES = [100.0, 101.0, 99.0, 100.5, 99.5]


def side(path: Path, tokens_per_s: list[float], **det) -> Path:
    path.write_text(json.dumps({"schema": "pwbench-gate-baseline/1", "source": path.name, "requests": 50,
                                "deterministic": {"output_tokens": 1000, **det},
                                "timing": {"output_tokens_per_s": tokens_per_s}}))
    return path


def gate(*args: str):
    proc = pwbench("gate", *args)
    return proc.returncode, proc.stdout, proc.stderr


def test_identical_runs_pass_and_junit_parses(runs, tmp_path):
    code, out, err = gate("--baseline", str(runs / "dummy-fast"), "--candidate", str(runs / "dummy-fast"),
                          "--junit", str(tmp_path / "j.xml"), "--markdown", str(tmp_path / "g.md"))
    assert code == 0, out + err
    suite = ET.parse(tmp_path / "j.xml").getroot()
    assert suite.tag == "testsuite" and suite.get("failures") == "0"
    cases = suite.findall("testcase")
    assert int(suite.get("tests")) == len(cases) > 10
    assert int(suite.get("skipped")) == sum(c.find("skipped") is not None for c in cases) == 2  # the two p99s
    assert {c.get("name") for c in cases} >= {"output_digest", "output_tokens", "output_tokens_per_s", "ttft_ms_p99"}
    assert "a p99 needs 300 requests a run, has 6" in out
    assert (tmp_path / "g.md").read_text().startswith("**pwbench gate: PASS**")


def test_five_percent_slower_passes_10_and_fails_2(tmp_path):
    base = side(tmp_path / "base.json", SAMPLES)
    cand = side(tmp_path / "cand.json", [x * 0.95 for x in SAMPLES])
    loose, strict = tmp_path / "loose.toml", tmp_path / "strict.toml"
    loose.write_text("timing_tolerance = 0.10\n")
    strict.write_text("timing_tolerance = 0.02\n")
    code, out, _ = gate("--baseline", str(base), "--candidate", str(cand), "--policy", str(loose), "--repeat", "5")
    assert code == 0 and "-5.0% (median of 5 vs 5)" in out
    code, out, _ = gate("--baseline", str(base), "--candidate", str(cand), "--policy", str(strict), "--repeat", "5",
                        "--junit", str(tmp_path / "j.xml"))
    assert code == 1 and "FAIL       timing        output_tokens_per_s" in out
    failures = ET.parse(tmp_path / "j.xml").getroot().findall("testcase/failure")
    assert len(failures) == 1 and "-5.0%" in failures[0].get("message")
    # 20% noise: 3 sigma is wider than 5%, so the same drop is not a regression
    noisy = [100.0, 130.0, 70.0, 115.0, 85.0]
    code, out, _ = gate("--baseline", str(side(tmp_path / "nb.json", noisy)), "--candidate",
                        str(side(tmp_path / "nc.json", [x * 0.95 for x in noisy])), "--policy", str(strict), "--repeat",
                        "5")
    assert code == 0
    # fewer runs than --repeat: not judged, said so
    code, out, _ = gate("--baseline", str(base), "--candidate", str(cand), "--repeat", "6")
    assert code == 0 and "needs 6 runs a side (--repeat), has 5 / 5" in out


def test_any_deterministic_change_fails(runs, tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(runs / "dummy-fast", changed)
    run = json.loads((changed / "run.json").read_text())
    run["summary"]["engine"]["h2d_bytes_per_output_token"] += 1.0
    (changed / "run.json").write_text(json.dumps(run))
    code, out, _ = gate("--baseline", str(runs / "dummy-fast"), "--candidate", str(changed))
    assert code == 1 and "FAIL       deterministic h2d_bytes_per_output_token" in out
    base = side(tmp_path / "b.json", SAMPLES)
    code, out, _ = gate("--baseline", str(base), "--candidate",
                        str(side(tmp_path / "c.json", SAMPLES, output_tokens=999)))
    assert code == 1 and "FAIL       deterministic output_tokens" in out


def test_unusable_input_exits_2_with_one_line(runs, tmp_path):
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("timing_tolerence = 0.1\n")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    cases = [
        (["--baseline", str(tmp_path / "nope.json"), "--candidate", str(runs / "dummy-fast")],
         "nope.json: no such baseline file"),
        (["--baseline", str(broken), "--candidate", str(runs / "dummy-fast")], "broken.json: invalid JSON"),
        (["--baseline", str(runs / "dummy-fast"), "--candidate", str(tmp_path / "missing")], "missing: no such folder"),
        (["--baseline", str(runs / "dummy-fast"), "--candidate", str(runs / "dummy-fast"), "--policy", str(bad_toml)],
         "bad.toml: unknown key 'timing_tolerence'"),
    ]
    for args, message in cases:
        code, out, err = gate(*args, "--junit", str(tmp_path / "j.xml"))
        assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err, err
        assert not (tmp_path / "j.xml").exists()


def test_update_baseline_then_gate_the_bundled_model(runs, tmp_path):
    """The project's own gate (CI runs it with the test suite): the fixture's `moe` run on the
    bundled model, 6 offline rag_long requests, seed 0, against the committed baseline."""
    fresh = tmp_path / "fresh.json"
    code, out, _ = gate("--baseline", str(fresh), "--candidate", str(runs / "moe"), "--update-baseline",
                        "--deterministic-only")
    assert code == 0 and json.loads(fresh.read_text())["timing"] == {}
    code, out, err = gate("--baseline", str(BASELINE), "--candidate", str(runs / "moe"))
    assert code == 0, out + err
    committed = json.loads(BASELINE.read_text())["deterministic"]
    assert committed == json.loads(fresh.read_text())["deterministic"]
    assert {"output_digest", "accuracy_closed_book_correct", "kv_capacity_tokens"} <= set(committed)

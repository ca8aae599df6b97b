"""`pwbench report` and `pwbench compare`: the executive numbers against the result files
(recomputed here by hand from run.json and requests.parquet), the cost/device formulas and
the recommendation rule on hand-computed cases, escaping, incomparable runs, bad input."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pandas as pd
import pytest
from result_folders import make_run, pwbench

from reports import roi, verdict
from reports.html import render
from reports.runs import load_runs


class Tables(HTMLParser):
    """Every <table> as rows of cell texts."""

    def __init__(self):
        super().__init__()
        self.tables, self.cell = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self.cell)
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data


def executive_table(html: str) -> dict[str, dict[str, str]]:
    parser = Tables()
    parser.feed(html)
    header, *rows = parser.tables[0]
    return {row[0].split(" (")[0]: dict(zip(header, row)) for row in rows}


def shown(cell: str, value: float) -> bool:
    """The cell shows `value` rounded to the cell's own number of decimals."""
    number = re.search(r"-?[\d,]+(\.\d+)?", cell)
    decimals = len(number.group(1)) - 1 if number.group(1) else 0
    return abs(float(number.group(0).replace(",", "")) - value) <= 0.5 * 10**-decimals + 1e-9


def goodput_by_hand(folder, run) -> float:
    """Output tokens of requests with TTFT and TPOT within the SLO, per second of run."""
    slo = run["summary"]["slo"]
    good = 0
    for r in pd.read_parquet(folder / "requests.parquet").to_dict("records"):
        times = list(r["token_times_s"])
        ttft_ms = (times[0] - r["arrival_s"]) * 1e3
        tpot_ms = (times[-1] - times[0]) / (len(times) - 1) * 1e3 if len(times) > 1 else 0
        if ttft_ms <= slo["ttft_ms"] and tpot_ms <= slo["tpot_ms"]:
            good += r["output_tokens"]
    return good / run["summary"]["duration_s"]


def test_cost_and_devices_on_hand_computed_cases():
    # $4/h at 100 tok/s: 360,000 tokens per hour -> $11.11 per million
    assert roi.cost_per_million(4.0, 100.0) == pytest.approx(11.1111, rel=1e-4)
    assert roi.cost_per_million(2.5, 50.0) == pytest.approx(2.5 / 180000 * 1e6)
    assert roi.cost_per_million(4.0, 0.0) is None
    assert roi.devices_needed(10, 1.5, 0.7) == 10  # 10 / 1.05 = 9.52
    assert roi.devices_needed(7, 1.0, 0.7) == 10  # exactly 10, not 11 from float error
    assert roi.devices_needed(1, 2.0, 1.0) == 1
    assert roi.devices_needed(10, 0.0, 0.7) is None


def row(name, engine, goodput, delta, peak=1, budget=2):
    """An executive row with three repeats at goodput x (0.98, 1.0, 1.02)."""
    V = roi.Value
    prices = roi.Prices(4.0, 10.0, 0.7)
    samples = tuple(goodput * f for f in (0.98, 1.0, 1.02))
    return {"run": V(None, name, name), "engine": V(None, name, engine), "runs": V(3, "", name),
            "goodput_rps": V(goodput, "", "", samples), "per_device_rps": V(goodput, "", "goodput", samples),
            "capacity_rps": V(None, ""),
            "accuracy_delta_points": V(delta, ""), "peak_device_bytes": V(peak, ""), "budget_bytes": V(budget, ""),
            "flips_lost": V(None, ""), "fidelity": V(None, ""), "h2d_bytes_per_token": V(None, ""),
            "served": V(None, ""), "accuracy": V(None, ""),
            "devices": V(roi.devices_needed(prices.target_rps, goodput, prices.utilisation), "")}


def test_recommendation_follows_its_rule():
    prices = roi.Prices(4.0, 10.0, 0.7)
    rows = [row("moe", "moe", 1.0, 0.0), row("pw", "pagedweight", 1.8, -0.4),
            row("lossy", "static-gptq", 3.0, -5.0),          # too much accuracy lost
            row("big", "offload", 2.5, 0.0, peak=3, budget=2)]  # over the budget
    name, text = verdict.recommend(rows, prices)
    assert name == "pw"
    # moe: ceil(10 / 0.7) = 15 devices; pw: ceil(10 / 1.26) = 8; 7 x $4 x 730 h = $20,440
    assert "1.80x" in text and "-0.4 accuracy points" in text
    assert "7 fewer devices than full precision (8 vs 15)" in text
    assert "$20,440" in text
    assert verdict.recommend(rows, prices, excluded={"pw"})[0] == "moe"
    assert verdict.recommend([row("moe", "moe", 0.0, 0.0)], prices)[0] is None


def test_executive_numbers_equal_the_result_files(runs):
    html = render(load_runs([runs]), roi.Prices(4.0, 10.0, 0.7))
    table = executive_table(html)
    assert set(table) == {"moe", "dummy-fast", "dummy-slow"}
    for name, cells in table.items():
        run = json.loads((runs / name / "run.json").read_text())
        s = run["summary"]
        assert f"{name} = {run['engine']['name']}" in html
        assert shown(cells["out tok/s"], s["output_tokens_per_s"])
        good = goodput_by_hand(runs / name, run)
        assert shown(cells["goodput tok/s"], good)
        assert cells["$ / 1M tok"].startswith("$") and shown(cells["$ / 1M tok"], 4.0 / (good * 3600) * 1e6)
        assert cells["devices"] == str(math.ceil(10 / (s["goodput_requests_per_s"] * 0.7)))
        assert cells["KV tokens"] == f"{s['memory']['kv_capacity_tokens']:,}"
        assert cells["peak mem"] == f"{s['memory']['peak_device_bytes'] / 2**20:.2f} MiB"
    acc = json.loads((runs / "moe" / "run.json").read_text())["summary"]["accuracy"]
    correct = acc["closed_book"]["correct"] + acc["rag_recall"]["correct"]
    sent = pd.read_parquet(runs / "moe" / "requests.parquet")["task"].notna().sum()  # served or not
    # all 6 served, so accuracy among served = correct / 6
    assert sent == 6 and table["moe"]["accuracy among served"] == f"{correct / sent * 100:.1f}%"
    assert table["moe"]["vs full (both served)"] == "+0.0 pt" and table["dummy-fast"]["accuracy among served"] == "-"
    # every cell names its source: run folder and metric
    assert re.search(r'title="moe: summary\.output_tokens_per_s \[one run: no interval\]"', html)
    # plotly.js once, no CDN
    assert html.count("Plotly.newPlot") >= 8 and html.count("plotly.js v") == 1
    assert not re.search(r"<script[^>]*\bsrc=", html)
    # the recommendation is the rule's choice, stated on the page
    rows = roi.executive(load_runs([runs]), roi.Prices(4.0, 10.0, 0.7))
    assert verdict.recommend(rows, roi.Prices(4.0, 10.0, 0.7))[1].replace("'", "&#x27;") in html


def test_model_name_with_script_is_escaped(runs, tmp_path):
    bad = tmp_path / "x<script>alert(1)</script>"
    shutil.copytree(runs / "dummy-fast", bad)
    run = json.loads((bad / "run.json").read_text())
    run["config"]["model"] = run["engine"]["model"] = "<script>alert(2)</script>"
    (bad / "run.json").write_text(json.dumps(run))
    html = render(load_runs([bad]), roi.Prices())
    assert "<script>alert(" not in html
    assert "&lt;script&gt;alert(1)" in html and "&lt;script&gt;alert(2)" in html


def test_kv_held_in_host_memory_is_labelled(runs, tmp_path):
    """A run whose engine keeps KV in host memory (moegen's plan, engine.model_stats) shows its
    pool as host tokens, not as device KV comparable with the others'."""
    host = tmp_path / "host-kv"
    shutil.copytree(runs / "dummy-fast", host)
    run = json.loads((host / "run.json").read_text())
    run["engine"].setdefault("model_stats", {})["plan_kv_on_host"] = 1
    run["config"]["engine_options"]["kv_on_host"] = True  # another configuration, so another arm
    run["summary"]["memory"]["kv_capacity_tokens"] = 524288
    (host / "run.json").write_text(json.dumps(run))
    rows = roi.executive(load_runs([runs / "dummy-fast", host]), roi.Prices())
    texts = [roi.fmt("kv_capacity_tokens", row["kv_capacity_tokens"]) for row in rows]
    assert texts[1] == "524,288 (host)" and "(host)" not in texts[0]
    assert "plan_kv_on_host" in rows[1]["kv_capacity_tokens"].source


def test_incomparable_runs_are_flagged(runs, tmp_path):
    other = make_run(tmp_path / "other-seed", seed=1)
    html = render(load_runs([runs / "dummy-fast", other]), roi.Prices())
    assert "other-seed (not comparable)" in executive_table(html)["other-seed"]["run"]
    assert "seed=1 (vs 0)" in html


def test_cli_report_and_compare(runs, tmp_path):
    out = tmp_path / "r.html"
    proc = pwbench("report", str(runs), "--output", str(out), "--gpu-hour-usd", "2")
    assert proc.returncode == 0, proc.stderr
    assert f"report: {out}" in proc.stdout and out.stat().st_size > 3_000_000
    assert "$2 per device-hour" in out.read_text()
    md = pwbench("compare", str(runs), "--markdown")
    assert md.returncode == 0, md.stderr
    lines = [line for line in md.stdout.splitlines() if line.startswith("| ")]
    assert len(lines) == 4 and {line.split(" | ")[0][2:] for line in lines[1:]} == {"moe", "dummy-fast", "dummy-slow"}
    assert "**Recommendation:**" in md.stdout


def test_report_and_gate_import_no_torch(runs, tmp_path):
    """A report renders on a machine without torch: the whole `pwbench report` and `pwbench
    gate` commands, in a fresh interpreter, import no torch and no engine runtime."""
    code = ("import sys\nfrom harness.cli import app\nfor argv in "
            f"({['report', str(runs), '--output', str(tmp_path / 'r.html')]!r},"
            f" {['gate', '--baseline', str(runs / 'moe'), '--candidate', str(runs / 'moe')]!r}):\n"
            "    try:\n        app(argv)\n    except SystemExit as e:\n        assert e.code == 0, e.code\n"
            "print(' '.join(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    mods = set(proc.stdout.split("\n")[-2].split())
    assert (tmp_path / "r.html").exists()
    assert not {m for m in mods if m.split(".")[0] in ("torch", "triton", "transformers", "safetensors")}
    # the CLI's shared error types only (harness/cli/common.py), no engine runtime
    allowed = {"engines", "engines.base", "engines.common", "engines.common.folders", "engines.common.demo",
               "engines.common.presets"}
    assert {m for m in mods if m.split(".")[0] == "engines"} <= allowed


def test_bad_input_is_one_line_exit_2(tmp_path, runs):
    proc = pwbench("report", str(tmp_path / "missing"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "missing: no such folder" in proc.stderr
    broken = tmp_path / "broken"
    shutil.copytree(runs / "dummy-fast", broken)
    (broken / "run.json").write_text("{not json")
    out = tmp_path / "out.html"
    proc = pwbench("report", str(broken), "--output", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and "run.json: invalid JSON" in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.html*"))
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = pwbench("compare", str(empty))
    assert proc.returncode == 2 and "holds no result folder" in proc.stderr

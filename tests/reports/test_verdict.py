"""The verdict: repeats grouped into arms, 95% intervals on hand-computed samples, ties against
winners, two runs of one configuration, capacity driving devices and cost, and quality kept
apart from capacity (recomputed here from requests.parquet).

Result folders are one real dummy-engine run, copied and edited (run.json fields, parquet
columns) into suites whose numbers the tests choose."""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics

import pandas as pd
import pytest
from result_folders import make_run, pwbench

from engines.registry import engine_role
from reports import roi, stats, verdict
from reports.html import render
from reports.runs import arms, load_runs

PRICES = roi.Prices(4.0, 10.0, 0.7)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("base") / "dummy", decode_ms_per_token=0.5)


def clone(src, dst, *, row=None, repeat=None, engine=None, options=None, capacity=None, goodput=None,
          stability=None):
    shutil.copytree(src, dst)
    run = json.loads((dst / "run.json").read_text())
    c = run["config"]
    if row is not None:
        c["row"] = row
    if repeat is not None:
        c["repeat"] = repeat
    if engine is not None:
        c["engine"] = run["engine"]["name"] = engine
        c["role"] = engine_role(engine)
    if options is not None:
        c["engine_options"] = options
    if capacity is not None:
        run["capacity"] = {"requests_per_s": capacity, "attainment": 0.99, "slo": c["slo"], "criterion": "test",
                           "limit": "found", "points": []}
    if goodput is not None:
        run["summary"]["goodput_requests_per_s"] = goodput
    if stability is not None:
        run["stability"] = stability
    (dst / "run.json").write_text(json.dumps(run))
    return dst


def suite(base, root, arms_: dict[str, tuple[str, list[float]]]):
    """row -> (engine, capacities of its repeats), interleaved like the suite (A B A B ...)."""
    for i in range(max(len(v[1]) for v in arms_.values())):
        for row, (engine, caps) in arms_.items():
            if i < len(caps):
                clone(base, root / f"{row}-r{i + 1}", row=row, repeat=i + 1, engine=engine, capacity=caps[i])
    return load_runs([root])


def test_t_quantiles_and_intervals_by_hand():
    assert stats.t975(2) == pytest.approx(4.303, abs=5e-4)
    assert stats.t975(1) == pytest.approx(12.706, abs=5e-4) and stats.t975(30) == pytest.approx(2.042, abs=5e-4)
    # beyond the table: t(0.975, 60) = 2.000, t(0.975, 120) = 1.980 (printed tables), never the normal's 1.960
    assert stats.t975(60) == pytest.approx(2.000, abs=5e-4) and stats.t975(120) == pytest.approx(1.980, abs=5e-4)
    # [1, 2, 3] (positive: on logs): logs 0, 0.69315, 1.09861; mean 0.59725, s 0.55555;
    # 0.59725 +- 4.3027 x 0.55555 / sqrt(3) = 0.59725 +- 1.38008 -> exp: 0.45712 .. 7.2236
    e = stats.estimate([3.0, 1.0, 2.0])
    assert (e.median, e.n) == (2.0, 3)
    assert e.low == pytest.approx(0.45712, abs=1e-4) and e.high == pytest.approx(7.2236, abs=1e-3)
    # [-1, 1, 3, 5] (not all positive: plain mean): median 2, mean 2, s = sqrt(20 / 3) = 2.58199;
    # t(3) = 3.1824 -> 2 +- 3.1824 x 2.58199 / 2 = 2 +- 4.10846
    e = stats.estimate([-1, 1, 3, 5])
    assert e.median == 2 and e.low == pytest.approx(-2.10846, abs=1e-3) and e.high == pytest.approx(6.10846, abs=1e-3)
    one = stats.estimate([5.0])
    assert one.median == 5.0 and not one.has_interval
    # ratio: b = a / 3 run for run, so the logs differ by log 3 with equal variances: Welch df = 4 exactly.
    a, b = [6.0, 6.3, 6.6], [2.0, 2.1, 2.2]
    la = [math.log(x) for x in a]
    se = math.sqrt(2 * statistics.variance(la) / 3)
    c = stats.ratio(a, b)
    assert c.df == pytest.approx(4.0) and c.point == pytest.approx(3.0)
    assert c.low == pytest.approx(3 * math.exp(-2.7764 * se), rel=1e-4)
    assert c.high == pytest.approx(3 * math.exp(2.7764 * se), rel=1e-4)
    assert c.beyond_noise and not c.tie
    tie = stats.ratio([2.0, 2.2, 2.1], [2.1, 2.0, 2.2])
    assert tie.tie and not tie.beyond_noise
    none = stats.ratio([4.0], [1.0])
    assert none.point == 4.0 and not none.has_interval and not none.tie and none.why_no_interval() == stats.NO_INTERVAL
    # difference: [1, 2, 3] - [0, 0, 0]: se = 1 / sqrt(3), df = 2 -> 2 +- 4.3027 / sqrt(3)
    d = stats.difference([1, 2, 3], [0, 0, 0])
    assert d.point == 2 and d.low == pytest.approx(2 - 2.48417, abs=1e-4) and d.tie


def test_t_table_against_scipy():
    t = pytest.importorskip("scipy.stats").t
    for df in range(1, 31):
        assert stats.t975(df) == pytest.approx(t.ppf(0.975, df), abs=1e-4)
    for df in (31, 45, 80, 500):
        assert stats.t975(df) == pytest.approx(t.ppf(0.975, df), abs=2e-4)
    # a fractional df is interpolated between its neighbours: never narrower than the exact quantile
    assert stats.t975(2.5) >= t.ppf(0.975, 2.5)


def test_repeats_group_into_arms(base, tmp_path):
    runs = suite(base, tmp_path, {"pw": ("pagedweight", [2.0, 2.1]), "gptq": ("static-gptq", [1.0, 1.1, 1.2])})
    groups = arms(runs)
    # arms in the order of their first run (load_runs sorts folders by name)
    assert [(a.label, len(a.runs)) for a in groups] == [("gptq", 3), ("pw", 2)]
    assert [r.folder.name for r in groups[0].runs] == ["gptq-r1", "gptq-r2", "gptq-r3"]
    # two arms of one engine without config.row take their folder names
    clone(base, tmp_path / "x" / "fast", options={"decode_ms_per_token": 0.5})
    clone(base, tmp_path / "x" / "slow", options={"decode_ms_per_token": 3.0})
    assert [a.label for a in arms(load_runs([tmp_path / "x"]))] == ["fast", "slow"]


def test_within_noise_is_a_tie_naming_both(base, tmp_path):
    runs = suite(base, tmp_path / "a", {"pagedweight": ("pagedweight", [2.10, 2.31, 2.20]),
                                        "moegen": ("moegen", [2.25, 2.12, 2.18])})
    rows = roi.executive(runs, PRICES)
    name, text = verdict.recommend(rows, PRICES)
    assert name is None
    assert text.startswith("moegen and pagedweight are within noise of each other: ")
    # the range of the medians (2.18, 2.20) and the widest relative half-interval, by hand
    assert "2.18-2.20 req/s at the SLO" in text
    half = max((stats.estimate(x).high - stats.estimate(x).low) / 2 / statistics.median(x)
               for x in ([2.10, 2.31, 2.20], [2.25, 2.12, 2.18]))
    assert f"(+-{half * 100:.0f}%)" in text
    # the two copies have the same memory, bytes and answers: nothing measured separates them
    assert text.endswith("what separates them: nothing measured (memory, bytes moved, served, quality are the same).")
    # a second run of the same suite, with the noise landing the other way round: the same statement
    again = suite(base, tmp_path / "b", {"pagedweight": ("pagedweight", [2.24, 2.11, 2.15]),
                                         "moegen": ("moegen", [2.08, 2.29, 2.21])})
    _, text2 = verdict.recommend(roi.executive(again, PRICES), PRICES)

    def words(s):
        return re.sub(r"[\d.,]+", "#", s)

    assert words(text2) == words(text)
    html = render(runs, PRICES)
    assert "within noise" in html and "(recommended)" not in html


def test_far_beyond_noise_names_the_winner_with_its_interval(base, tmp_path):
    pw, gptq = [6.0, 6.3, 6.6], [2.0, 2.1, 2.2]
    stab = {"probes": 20, "repeats": 3, "finding": "none", "loads": [
        {"name": "idle", "rate": 0.0, "unique_completions_mean": 1.0, "probes_varying": 0, "flips": 0,
         "first_divergence_min": None},
        {"name": "above capacity", "rate": 9.0, "unique_completions_mean": 1.1, "probes_varying": 1, "flips": 1,
         "first_divergence_min": 3}]}
    root = tmp_path / "s"
    for i in range(3):
        clone(base, root / f"static-gptq-4bit-r{i + 1}", row="static-gptq-4bit", repeat=i + 1, engine="static-gptq",
              capacity=gptq[i])
        clone(base, root / f"pagedweight-r{i + 1}", row="pagedweight", repeat=i + 1, engine="pagedweight",
              capacity=pw[i], stability=stab)
    runs = load_runs([root])
    rows = roi.executive(runs, PRICES)
    name, text = verdict.recommend(rows, PRICES)
    c = stats.ratio(pw, gptq)
    assert name == "pagedweight"
    assert text.startswith(f"pagedweight serves 3.00x the requests per device at the SLO (95% CI {c.low:.2f}-"
                           f"{c.high:.2f}x) vs static-gptq-4bit")
    # the first screen: one sentence per technique against the baseline, flips under load from run.json stability
    (sentence,) = verdict.technique_sentences(rows, PRICES)
    # devices at 10 req/s: ceil(10 / (6.3 x 0.7)) = 3 vs ceil(10 / (2.1 x 0.7)) = 7
    assert sentence == (f"pagedweight: 3.00x the requests per device at the SLO (95% CI {c.low:.2f}-{c.high:.2f}x) "
                        "vs static-gptq-4bit, with 1 flip under load; 4 fewer devices at 10 req/s.")
    html = render(runs, PRICES)
    assert sentence in html and "pagedweight (recommended)" in html
    # error bars from the interval on the capacity bar chart
    spec = re.search(r'<div id="per-device".*?var f=(\{.*?\});Plotly', html, re.S).group(1)
    err = json.loads(spec)["data"][0]["error_y"]
    e = stats.estimate(pw)
    assert [a.label for a in arms(runs)] == ["pagedweight", "static-gptq-4bit"]
    assert err["array"][0] == pytest.approx(e.high - e.median)
    assert err["arrayminus"][0] == pytest.approx(e.median - e.low)
    assert "<h2 id='stability'>" in html


def test_same_configuration_is_the_environment_not_the_engine(base, tmp_path):
    """Two runs of one engine, configuration and seed; the second 4x slower (a busy machine)."""
    a = clone(base, tmp_path / "a")
    b = clone(base, tmp_path / "b")
    run = json.loads((b / "run.json").read_text())
    s = run["summary"]
    for key in ("requests_per_s", "output_tokens_per_s", "goodput_requests_per_s", "input_tokens_per_s"):
        s[key] /= 4
    s["duration_s"] *= 4
    (b / "run.json").write_text(json.dumps(run))
    req = pd.read_parquet(b / "requests.parquet")
    for col in ("started_s", "first_token_s", "finish_s"):
        req[col] = req[col] * 4
    req["token_times_s"] = [list(x * 4) for x in req["token_times_s"]]
    req.to_parquet(b / "requests.parquet", index=False)
    proc = pwbench("compare", str(a), str(b))
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "a and b are the same configuration (engine dummy, workload rag_long, seed 0" in out
    assert ("their difference (4.00x in goodput req/s) is the environment's (e.g. a busy machine), not the "
            "engine's") in out
    assert "serves" not in out and "fewer devices" not in out
    html = render(load_runs([a, b]), PRICES)
    assert "same configuration" in html and "(recommended)" not in html


def test_one_run_per_side_has_no_interval(base, tmp_path):
    a = clone(base, tmp_path / "fast", options={"decode_ms_per_token": 0.5}, goodput=8.0)
    b = clone(base, tmp_path / "slow", options={"decode_ms_per_token": 3.0}, goodput=2.0)
    proc = pwbench("compare", str(a), str(b), "--markdown")
    assert proc.returncode == 0, proc.stderr
    rec = next(line for line in proc.stdout.splitlines() if line.startswith("**Recommendation:**"))
    assert "fast has the highest goodput req/s (8.00, 4.00x slow)" in rec
    assert "the comparison has no interval (one run each: no interval; use --repeat 3)" in rec
    assert verdict.recommend(roi.executive(load_runs([a, b]), PRICES), PRICES)[0] is None


def test_capacity_drives_devices_and_cost(base, tmp_path):
    runs = suite(base, tmp_path, {"a": ("static-rtn", [1.5, 1.5, 1.5])})
    (row,) = roi.executive(runs, PRICES)
    out = [t for r in runs for t in pd.read_parquet(r.folder / "requests.parquet")["output_tokens"]]
    mean_out = sum(out) / len(out)
    assert row["capacity_rps"].value == 1.5 and row["per_device_rps"].text == "capacity"
    assert row["devices"].value == 10  # ceil(10 / (1.5 x 0.7)) = ceil(9.52)
    assert row["cost_per_1m"].value == pytest.approx(4.0 / (1.5 * mean_out * 3600) * 1e6)
    assert "capacity req/s" in row["devices"].source and roi.NO_CAPACITY not in row["devices"].source
    # without a capacity search: today's goodput, said so
    (plain,) = roi.executive(load_runs([base]), PRICES)
    g = json.loads((base / "run.json").read_text())["summary"]["goodput_requests_per_s"]
    assert plain["devices"].value == math.ceil(10 / (g * 0.7) - 1e-9) and roi.NO_CAPACITY in plain["devices"].source
    assert plain["capacity_rps"].value is None and roi.NO_CAPACITY in plain["cost_per_1m"].source


def with_answers(src, dst, engine, correct, identical, flip, unserved=()):
    """A copy whose requests carry a task, correctness and fidelity columns; `unserved` rows failed."""
    folder = clone(src, dst, engine=engine, row=engine)
    req = pd.read_parquet(folder / "requests.parquet")
    req["task"] = "closed_book"
    req["answer"] = "x"
    req["correct"] = pd.Series([None if i in unserved else c for i, c in enumerate(correct)], dtype=object)
    req["ref_identical"] = pd.Series([None if i in unserved else c for i, c in enumerate(identical)], dtype=object)
    req["flip"] = pd.Series(flip, dtype=object)
    req["error"] = pd.Series(["prompt longer than the KV cache" if i in unserved else None for i in range(len(req))],
                             dtype=object)
    req["finish_s"] = [None if i in unserved else x for i, x in enumerate(req["finish_s"])]
    req.to_parquet(folder / "requests.parquet", index=False)
    run = json.loads((folder / "run.json").read_text())
    run["summary"]["completed"] = len(req) - len(unserved)
    (folder / "run.json").write_text(json.dumps(run))
    return folder


def test_quality_columns_equal_a_recomputation(base, tmp_path):
    ref = with_answers(base, tmp_path / "moe", "moe", [True, True, False, True, True, True], [True] * 6, [None] * 6,
                       unserved=(0, 1))
    q = with_answers(base, tmp_path / "static-rtn", "static-rtn", [True, False, True, True, False, True],
                     [True, False, False, True, False, True], [None, "lost", "gained", None, "lost", None])
    rows = roi.executive(load_runs([ref, q]), PRICES)
    by = {row["run"].text: row for row in rows}
    for folder in (ref, q):
        req = pd.read_parquet(folder / "requests.parquet").to_dict("records")
        served = [r for r in req if pd.isna(r["error"]) and not pd.isna(r["finish_s"])]
        row = by[folder.name]
        assert row["served"].value == len(served) / len(req) and row["served"].text == f"{len(served)}/{len(req)}"
        assert row["accuracy"].value == pytest.approx(sum(bool(r["correct"]) for r in served) / len(served))
        assert row["fidelity"].value == pytest.approx(sum(bool(r["ref_identical"]) for r in served) / len(served))
        assert row["flips_lost"].value == sum(r["flip"] == "lost" for r in served)
    # full precision served 4 of 6 (capacity), all 4 task answers... 3 of 4 right: 75% among served
    assert by["moe"]["accuracy"].value == 0.75 and by["moe"]["served"].value == pytest.approx(4 / 6)
    # vs full among the requests both served (rows 2..5): rtn 3/4 right, moe 3/4 right -> +0.0 points
    assert by["static-rtn"]["accuracy_delta_points"].value == pytest.approx(0.0)
    assert by["static-rtn"]["flips_lost"].text == "2 lost / 1 gained"
    # 2 lost flips per run where full precision loses none: outside the tolerance, so moe stands alone
    assert verdict.recommend(rows, PRICES)[0] == "moe"
    table = roi.table(rows)
    assert table[1][1][table[0].index("identical to full")] == "50.0%"


def test_precision_section_from_transitions_and_bits(base, tmp_path):
    """summary.transitions as ITL inside vs outside; fidelity per 0.5-bit bin of bits_mean,
    recomputed here from requests.parquet."""
    folder = clone(base, tmp_path / "pagedweight", engine="pagedweight", row="pagedweight")
    run = json.loads((folder / "run.json").read_text())
    run["summary"]["transitions"] = {"windows": 3, "per_minute": 12.5, "move_bytes": 40960,
                                     "itl_ms_inside": {"p50": 7.25, "p99": 19.5},
                                     "itl_ms_outside": {"p50": 5.0, "p99": 9.75}}
    (folder / "run.json").write_text(json.dumps(run))
    req = pd.read_parquet(folder / "requests.parquet")
    req["bits_mean"] = [4.0, 4.1, 4.0, 8.0, 7.9, 16.0]
    req["ref_identical"] = pd.Series([True, False, False, True, True, True], dtype=object)
    req.to_parquet(folder / "requests.parquet", index=False)
    html = render(load_runs([folder]), PRICES)
    assert "<td>7.25 / 5.00</td>" in html and "<td>19.50 / 9.75</td>" in html and "<td>40,960</td>" in html
    spec = json.loads(re.search(r'<div id="fidelity-bits".*?var f=(\{.*?\});Plotly', html, re.S).group(1))
    bins: dict[float, list[bool]] = {}
    for bits, same in zip(req["bits_mean"], req["ref_identical"]):
        bins.setdefault(round(bits * 2) / 2, []).append(same)
    (trace,) = spec["data"]
    assert trace["x"] == sorted(bins) == [4.0, 8.0, 16.0]
    assert trace["y"] == pytest.approx([sum(bins[x]) / len(bins[x]) * 100 for x in sorted(bins)])


def test_capacity_bounds_are_shown_as_bounds(base, tmp_path):
    """A search that passed at its highest rate gives a lower bound (">= x", "at least" in the
    sentence); one that failed at every rate it tried shows "< lowest rate" and no devices."""
    def with_limit(folder, rps, limit, rates):
        run = json.loads((folder / "run.json").read_text())
        run["capacity"].update(requests_per_s=rps, limit=limit,
                               points=[{"rate": r, "requests": 20, "completed": 20, "attainment": 1.0,
                                        "passed": rps is not None, "duration_s": 1.0} for r in rates])
        (folder / "run.json").write_text(json.dumps(run))

    root = tmp_path / "s"
    for i, (fast, slow) in enumerate(((50.0, None), (52.0, None))):
        with_limit(clone(base, root / f"moegen-r{i + 1}", row="moegen", repeat=i + 1, engine="moegen", capacity=1.0),
                   fast, "above_highest_rate", [12.5, 25.0, fast])
        with_limit(clone(base, root / f"static-r{i + 1}", row="static", repeat=i + 1, engine="static-gptq",
                         capacity=1.0), slow, "below_lowest_rate", [1.7, 0.85])
    rows = {row["run"].text: row for row in roi.executive(load_runs([root]), PRICES)}
    assert roi.fmt("capacity_rps", rows["moegen"]["capacity_rps"]).startswith(">= 51 [")
    assert roi.fmt("capacity_rps", rows["static"]["capacity_rps"]) == "< 0.85"
    assert rows["static"]["devices"].value is None

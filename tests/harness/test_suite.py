"""`pwbench run --workload rag_long` with no --engine: the PoC suite, here with 2 requests an
engine, 2 repeats and capacity points of those 2 requests (the README's command runs the demo
defaults): every suite engine gets a folder per repeat in the suite folder, interleaved, all
under the same budget (below full-precision weights + peak KV) and the same workload, each
with its capacity at the demo SLO and, on repeat 1, its stability probes; then the report,
whose path is printed with the executive table and the verdict."""

from __future__ import annotations

import json

import pytest
from result_folders import pwbench

from harness.suite import SUITE


@pytest.mark.slow  # over a minute on 2 cores
def test_suite_runs_every_engine_under_one_budget_then_the_report(tmp_path):
    out = tmp_path / "suite"
    proc = pwbench("run", "--workload", "rag_long", "--requests", "2", "--warmup", "0", "--no-quality",
                   "--repeat", "2", "--find-capacity", "--attainment", "0.5", "--output", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {row: json.loads((out / row / "r1" / "run.json").read_text()) for row in SUITE}
    again = {row: json.loads((out / row / "r2" / "run.json").read_text()) for row in SUITE}
    # interleaved: every row's first repeat started before any row's second
    assert max(r["started_at_unix"] for r in runs.values()) < min(r["started_at_unix"] for r in again.values())
    assert all(r["config"]["row"] == row and r["config"]["repeat"] == 1 for row, r in runs.items())
    assert all(r["config"]["slo"] == {"ttft_ms": 500.0, "tpot_ms": 150.0} for r in runs.values())  # the demo SLO
    assert all(r["capacity"]["points"] and "stability" in r for r in runs.values())
    assert all("capacity" in r and "stability" not in r for r in again.values())  # probes once a row
    assert {row: r["engine"]["name"] for row, r in runs.items()} == {row: engine for row, (engine, _) in SUITE.items()}
    budgets = {r["summary"]["memory"]["budget_bytes"] for r in runs.values()}
    assert len(budgets) == 1
    moe = runs["moe"]
    full = moe["engine"]["weight_bytes"] + moe["summary"]["memory"]["peak_kv_bytes"]
    assert budgets.pop() < moe["engine"]["weight_bytes"] + 3000 * moe["engine"]["model_stats"]["kv_bytes_per_token"]
    assert full > 0 and len({json.dumps(r["config"]["workload"], sort_keys=True) for r in runs.values()}) == 1
    assert f"report: {out / 'report.html'}" in proc.stdout and (out / "report.html").stat().st_size > 3_000_000
    assert "recommendation:" in proc.stdout and all(row in proc.stdout for row in SUITE)
    assert (out / "reference").is_dir()  # the float32 reference's answers, computed once
    # memory pressure separates the engines: the quantized ones hold more KV than full precision
    assert runs["static-gptq-4bit"]["engine"]["kv_capacity_tokens"] > moe["engine"]["kv_capacity_tokens"]
    assert runs["offload"]["summary"]["engine"]["h2d_bytes_per_output_token"] > 0


def test_default_budget_squeezes_full_precision_but_lets_it_run():
    """demo: dense + 40% of (experts + 3,000 tokens of KV), by hand from its sizes (dense 967,680 B,
    experts 786,432 B, KV 1,024 B a token): 2,511,052 B, where full precision holds 46 blocks of KV.
    demo-fine's dense weights are over half the model: the share rule would leave full precision
    a couple of hundred tokens, not one request, so the floor gives it the same 736 tokens as on
    demo (its sizes read from the engine)."""
    from engines.common.demo import DEMO_FINE_MODEL_DIR, DEMO_MODEL_DIR
    from engines.registry import create_engine
    from harness.suite import MIN_KV_TOKENS, default_budget

    assert default_budget(str(DEMO_MODEL_DIR), {}) == 967_680 + int(0.4 * (786_432 + 3000 * 1024))
    if not (DEMO_FINE_MODEL_DIR / "config.json").is_file():
        return
    budget = default_budget(str(DEMO_FINE_MODEL_DIR), {})
    with create_engine("moe", {"model": str(DEMO_FINE_MODEL_DIR), "budget_bytes": budget}) as engine:
        info = engine.info()
    kv = int(info.model_stats["kv_bytes_per_token"])
    assert budget == info.weight_bytes + MIN_KV_TOKENS * kv
    assert info.kv_capacity_tokens == MIN_KV_TOKENS

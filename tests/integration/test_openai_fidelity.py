"""Fidelity for a real server: `pwbench run --engine openai --model DIR` against `pwbench serve`
(engine moe, the bundled demo model) compares every streamed answer with the float32
reference's, computed locally from the same folder; the served float32 model answers as the
reference does, so every request is identical and the columns say so."""

from __future__ import annotations

import json

import pytest
from serving import Server

from engines.common.demo import demo_model_path
from harness.results import read_rows
from harness.run import RunArgs, execute
from workloads.registry import WorkloadSpec

pytestmark = pytest.mark.slow  # a pwbench serve subprocess and a local reference: ~30 s


def test_openai_run_is_compared_with_the_local_reference(tmp_path):
    model = str(demo_model_path())
    server = Server("--engine", "moe", "--model", model, "--dtype", "float32")
    try:
        spec = WorkloadSpec("rag_long", requests=6, seed=2, arrival="offline", direct_share=0.5, scale=0.25,
                            time_scale=0.1)
        execute(RunArgs(workload=spec, given=frozenset({"requests", "seed", "arrival", "direct_share", "scale",
                                                         "time_scale"}),
                        engine="openai", model=model, engine_options={"base_url": server.url + "/v1"},
                        output=str(tmp_path / "openai"), warmup=0, telemetry_hz=20))
    finally:
        server.stop()
    run = json.loads((tmp_path / "openai" / "run.json").read_text())
    f = run["summary"]["fidelity"]
    rows = read_rows(tmp_path / "openai", "requests")
    assert f["compared"] == sum(1 for r in rows if r["finish_s"] is not None and not r["error"]) == 6
    assert f["identical"] == sum(bool(r["ref_identical"]) for r in rows) == 6 and f["flips_lost"] == 0

"""Quality per request against full precision (harness/fidelity.py) on the bundled demo model,
checked by recomputing every column from the result folders; the warm-up's own traffic and the
emptied prefix cache; the telemetry's time axis."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from harness.fidelity import compare_output, fidelity_summary
from harness.offline import cut_at_eos
from harness.results import read_rows
from harness.run import RunArgs, execute
from workloads.demo.tasks import score
from workloads.registry import WorkloadSpec

SPEC = WorkloadSpec("rag_long", requests=12, seed=3, arrival="offline", direct_share=0.5, scale=0.25, time_scale=0.1)
GIVEN = frozenset({"requests", "seed", "arrival", "direct_share", "scale", "time_scale"})


def run(folder, engine, warmup=0, **options):
    execute(RunArgs(workload=SPEC, given=GIVEN, engine=engine, engine_options={"dtype": "float32", **options},
                    output=str(folder), warmup=warmup, telemetry_hz=20))
    return json.loads((folder / "run.json").read_text()), read_rows(folder, "requests")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("fidelity")
    return run(base / "moe", "moe", device="cpu"), run(base / "rtn2", "static-rtn", bits=2, group_size=32)


def test_compare_output_by_hand():
    m = compare_output([1, 2, 3], [1, 2, 3])
    assert (m.identical, m.divergence, m.token_match) == (True, None, 1.0)
    m = compare_output([1, 2, 9, 4], [1, 2, 3, 4])
    assert (m.identical, m.divergence, m.token_match) == (False, 2, 0.75)
    m = compare_output([1, 2], [1, 2, 3, 4])  # a prefix: diverges where the shorter one ends
    assert (m.identical, m.divergence, m.token_match) == (False, 2, 0.5)


@pytest.mark.slow  # two demo-model runs and the reference: ~35 s for both tests
def test_reference_run_is_identical_and_2bit_rtn_is_not(pair):
    (ref_run, ref), (rtn_run, rtn) = pair
    f = ref_run["summary"]["fidelity"]
    assert (f["compared"], f["identical"], f["fidelity"], f["flips_lost"], f["flips_gained"]) == (12, 12, 1.0, 0, 0)
    f = rtn_run["summary"]["fidelity"]
    assert f["fidelity"] < 1.0 and f["identical"] < f["compared"] == 12
    flips = [r["flip"] for r in rtn if r["flip"] is not None]
    assert len(flips) == f["flips_lost"] + f["flips_gained"] >= 1
    assert set(flips) <= {"lost", "gained"}


@pytest.mark.slow
def test_fidelity_columns_equal_a_recomputation_from_the_two_folders(pair):
    """The float32 moe run answered every request as the reference does (fidelity 100%), so its
    folder is the reference here: each 2-bit column is recomputed from the two folders' ids."""
    (ref_run, ref), (rtn_run, rtn) = pair
    eos = set(rtn_run["engine"]["eos_token_ids"])
    by_id = {r["request_id"]: r for r in ref}
    for row in rtn:
        other = by_id[row["request_id"]]
        want, got = cut_at_eos(other["output_ids"], eos), cut_at_eos(row["output_ids"], eos)
        assert row["ref_identical"] == (want == got)
        if want != got:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            assert row["ref_divergence"] == first
            same = sum(a == b for a, b in zip(got, want))
            assert row["ref_token_match"] == pytest.approx(same / max(len(got), len(want)))
        if row["answer"] is not None:
            right, ref_right = score(row["output_text"], row["answer"]), score(other["output_text"], row["answer"])
            assert row["correct"] == right and row["ref_correct"] == ref_right
            assert row["flip"] == (None if right == ref_right else "lost" if ref_right else "gained")
    again = fidelity_summary(rtn)
    assert again == rtn_run["summary"]["fidelity"]


def test_warmup_uses_its_own_requests_and_leaves_no_cached_prefix(tmp_path):
    """The first measured request repeats nothing the warm-up computed: it gets no cached tokens
    (before, the warm-up ran copies of the first measured requests and they were cache hits)."""
    spec = WorkloadSpec("rag_long", requests=1, seed=0, arrival="offline", scale=0.25, time_scale=0.1)
    execute(RunArgs(workload=spec, given=GIVEN, engine="moe", engine_options={"dtype": "float32"},
                    output=str(tmp_path / "w"), warmup=2, quality=False, telemetry_hz=20))
    steps = pd.read_parquet(tmp_path / "w" / "steps.parquet")
    assert steps["cached_prompt_tokens"].sum() == 0
    run_json = json.loads((tmp_path / "w" / "run.json").read_text())
    # the telemetry shares the run's clock: it starts after 0 and ends by the run's end
    tel = pd.read_parquet(tmp_path / "w" / "telemetry.parquet")
    end = steps["t_s"].iloc[-1] + steps["duration_s"].iloc[-1]
    assert tel["t_s"].min() >= 0 and tel["t_s"].max() <= end + 1.0
    assert tel["process_cpu_percent"].between(0, 100).all()
    assert "logical cores" in run_json["telemetry"]["cpu_percent"]

"""Stability probes at three loads. The recorded per-load numbers are recomputed here from the
raw outputs the measurement returns and the float32 reference's answers (harness/fidelity.py); on the dummy
engine (tokens a function of the prompt alone) every load gives the same answers, so the
counts against a reference altered by hand are known exactly."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from tiny_models import CPU32

from engines.dummy import DummyConfig, DummyEngine
from harness.calibration import create_calibrated
from harness.fidelity import reference_outputs
from harness.offline import run_offline
from harness.stability import (
    LOADS,
    ProbeSet,
    demo_probes,
    finding,
    measure_stability,
    random_probes,
    summarize_load,
)
from workloads.base import Request
from workloads.demo.language import demo_language
from workloads.demo.tasks import score

DEMO = "engines/demo_model"


def background(vocab: int, n: int, new: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"b{i}", tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(40, 120))), new,
                    arrival_s=0.1 * i) for i in range(n)]


def recount(outputs, reference, answers):
    """(mean unique outputs per probe, probes with > 1, answers != reference, earliest divergence,
    right/wrong flips) by hand from the raw outputs of one load."""
    uniques, differ, earliest, task_flips = [], 0, None, 0
    decode = demo_language().decode
    for pid, outs in outputs.items():
        uniques.append(len(set(map(tuple, outs))))
        ref = reference[pid]
        for out in outs:
            if out != ref:
                differ += 1
                pos = next((i for i in range(min(len(out), len(ref))) if out[i] != ref[i]), min(len(out), len(ref)))
                earliest = pos if earliest is None else min(earliest, pos)
            if pid in answers:
                task_flips += score(decode(out), answers[pid]) != score(decode(ref), answers[pid])
    return sum(uniques) / len(uniques), sum(u > 1 for u in uniques), differ, earliest, task_flips


def test_dummy_answers_do_not_move_with_load_and_flips_are_counted_against_the_reference():
    engine = DummyEngine(DummyConfig(base_ms=1.0, max_num_seqs=4))
    engine.start()
    probe_set = random_probes(32000, (2,), count=4, max_new_tokens=5, seed=1)
    own = {p.probe_id: c.output_ids for p in probe_set.probes
           for c in [run_offline(engine, [p.request()])[p.probe_id]]}
    stab = measure_stability(engine, probe_set, own, 200.0, background(32000, 8, 3), repeats=2)
    assert stab.finding.startswith("All 4 probes gave the full-precision reference's output")
    assert [x.to_dict() for x in stab.loads] == [
        {"name": n, "rate": r, "unique_completions_mean": 1.0, "probes_varying": 0, "flips": 0,
         "first_divergence_min": None} for n, r in zip(LOADS, (0.0, 200.0, 300.0))]
    altered = dict(own, p1=own["p1"][:3] + [own["p1"][3] + 1, own["p1"][4]])
    stab = measure_stability(engine, probe_set, altered, 200.0, background(32000, 8, 3), repeats=2)
    assert [(x.flips, x.first_divergence_min) for x in stab.loads] == [(2, 3)] * 3  # p1's two repeats, at token 3
    assert "1 of 4 differ from the full-precision reference at every load" in stab.finding
    assert stab.to_dict()["probes"] == 4 and stab.to_dict()["repeats"] == 2
    engine.stop()


@pytest.mark.parametrize("name,options", [("moe", {}), pytest.param("pagedweight", {"budget_bytes": 1_900_000},
                                                                   marks=pytest.mark.slow)])
def test_probes_at_three_loads_match_a_recount_from_the_raw_outputs(name, options, tmp_path, monkeypatch):
    """Demo closed-book questions (scored) and random-token prompts with 16-token outputs, on
    moe (the reference's own engine, float32 on the CPU) and pagedweight under a budget the
    background's KV demand makes it demote in: the loaded runs see lower bits than 16."""
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    demo = demo_probes(count=4, seed=0)
    tokens = random_probes(1109, (0, 1, 2, 3), count=4, max_new_tokens=16, seed=0).probes
    probe_set = ProbeSet((*demo.probes, *(replace(p, probe_id=f"r{i}") for i, p in enumerate(tokens))), demo.decode)
    reference = reference_outputs(DEMO, [p.request() for p in probe_set.probes])
    answers = {p.probe_id: p.answer for p in probe_set.probes if p.answer is not None}
    engine = create_calibrated(name, {"model": DEMO, **CPU32, **options})
    engine.start()
    try:
        stab = measure_stability(engine, probe_set, reference, 20.0, background(1109, 12, 16), repeats=2)
    finally:
        engine.stop()
    assert [x.name for x in stab.loads] == list(LOADS) and [x.rate for x in stab.loads] == [0.0, 20.0, 30.0]
    for load in stab.loads:
        outs = stab.outputs[load.name]
        assert sorted(outs) == sorted(reference) and all(len(o) == 2 for o in outs.values())
        mean, varying, flips, earliest, task_flips = recount(outs, reference, answers)
        assert (load.unique_completions_mean, load.probes_varying, load.flips, load.first_divergence_min,
                load.task_flips) == (pytest.approx(mean), varying, flips, earliest, task_flips)
    if name == "moe":
        assert stab.loads[0].flips == 0  # alone, in float32, moe is the reference
        assert all(x.bits is None for x in stab.loads)
    else:
        assert min(stab.loads[2].bits) < 16  # the load did change the bit widths
    d = stab.to_dict()
    assert set(d) == {"probes", "repeats", "loads", "finding"} and d["probes"] == 8 and d["finding"].endswith(".")


def test_varying_answers_at_fixed_precision_are_called_batch_dependent_numerics():
    # p0: [5, 6, 7] twice (the reference); p1: [5, 6] (a prefix: diverges at token 2) and
    # [5, 9, 9] (at token 1), reference [5, 6, 8].
    reference = {"p0": [5, 6, 7], "p1": [5, 6, 8]}
    outputs = {"p0": [[5, 6, 7], [5, 6, 7]], "p1": [[5, 6], [5, 9, 9]]}
    load = summarize_load("near capacity", 4.0, outputs, reference)
    assert (load.unique_completions_mean, load.probes_varying, load.flips, load.first_divergence_min) == (1.5, 1, 2, 1)
    idle = summarize_load("idle", 0.0, {"p0": [[5, 6, 7]], "p1": [[5, 6, 8]]}, reference)
    sentence = finding([idle, load], {"idle": {"p0": [[5, 6, 7]], "p1": [[5, 6, 8]]}, "near capacity": outputs},
                       reference, 2)
    assert sentence.startswith("1 of 2 probes were answered differently") and "batch-dependent numerics" in sentence
    changing = replace(load, bits=(4.0, 16.0))
    sentence = finding([idle, changing], {"idle": {}, "near capacity": outputs}, reference, 2)
    assert "as load changed the bit widths (4-16 mean expert bits)" in sentence and "earliest at token 1" in sentence

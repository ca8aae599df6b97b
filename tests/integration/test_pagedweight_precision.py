"""PagedWeight's per-request precision record and its move accounting.

Oracles: a model whose every token routes to every expert (top_k = num_experts), so the widths
a request's tokens met follow from the bits table (`expert_bits`, every step) and the tokens
each step computed for it, read off the step outputs; the transfer ledger's host->device bytes
under the expert-pages tag, counted by the copy path at issue; a second run with one arbiter
setting changed.
"""

from __future__ import annotations

import random

import pytest
from tiny_models import CPU32

from engines.base import EngineRequest
from engines.registry import create_engine
from harness.calibration import create_calibrated
from harness.metrics import step_row
from harness.precision import transition_steps

DEMO = "engines/demo_model"
DEMO_DENSE = 967_680
DEMO_EXPERTS = 8 * 3 * 128 * 64 * 4


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path / "cache"))


def random_prompts(vocab: int, n: int, new: int, seed: int) -> list[EngineRequest]:
    rng = random.Random(seed)
    return [EngineRequest(f"r{i}", tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(10, 120))), new,
                          ignore_eos=True) for i in range(n)]


def serve(engine, arrivals: dict[int, list[EngineRequest]], on_step=None) -> list:
    """Step the started engine, adding arrivals[i] before step i, until every request is done;
    idle steps in between let the widths settle."""
    outs, i = [], 0
    while i <= max(arrivals) or engine.has_unfinished():
        for r in arrivals.get(i, []):
            engine.add_request(r)
        if on_step is not None:
            on_step("before")
        outs.append(engine.step())
        if on_step is not None:
            on_step("after")
        i += 1
    return outs


def short(rid: str) -> EngineRequest:
    return EngineRequest(rid, (5,) * 12, 6, ignore_eos=True)


def test_request_bits_agree_with_the_bits_table_when_every_token_routes_to_every_expert(checkpoints):
    """Top-6 of 6 experts: each computed token of a request counts 2 layers x 6 choices at the
    widths of the step that computed it (expert_bits, matrix_every=1). The budget holds every
    expert at 16 bits plus two KV blocks: the short requests run in steady state, the longer
    ones force demotions (and promotions once they finish). A request's prompt is computed in
    the step that starts it, then one token per step until its last."""
    folder = checkpoints("mixtral", num_experts_per_tok=6)
    moe = create_engine("moe", {"model": str(folder), **CPU32, "kv_blocks": 1})
    moe.start()
    info = moe.info()
    moe.stop()
    budget = info.weight_bytes + 2 * info.kv_cache_bytes
    long = random_prompts(257, 8, 12, seed=3)
    prompt_len = {r.request_id: len(r.prompt_ids) for r in [*long, short("s0"), short("s1")]}
    arrivals = {30: [short("s0")], 40: long[:2], 46: long[2:4], 54: long[4:6], 70: long[6:7], 90: long[7:],
                140: [short("s1")]}
    engine = create_calibrated("pagedweight", {"model": str(folder), **CPU32, "budget_bytes": budget,
                                               "matrix_every": 1, "prefix_caching": False})
    engine.start()
    try:
        outs = serve(engine, arrivals)
        tables = engine.tables()
    finally:
        engine.stop()
    rows = [step_row(o) for o in outs]
    assert all(o.num_preempted == 0 for o in outs)
    widths: dict[int, list[int]] = {}
    for row in tables["expert_bits"]:
        widths.setdefault(row["engine_step"], []).append(row["bits"])
    assert all(len(w) == 12 for w in widths.values())
    inside = transition_steps(rows)

    expected = {}
    for rid, n_prompt in prompt_len.items():
        start = next(i for i, o in enumerate(outs) if rid in o.started)
        token_steps = [i for i, o in enumerate(outs) for t in o.outputs if t.request_id == rid and t.new_token_ids]
        assert token_steps[0] == start and token_steps == list(range(start, token_steps[-1] + 1))
        tokens = {i: n_prompt if i == start else 1 for i in token_steps}  # rows of the batch that were its
        at = {i: widths[rows[i]["x_engine_step"]] for i in token_steps}
        choices = sum(n * 12 for n in tokens.values())
        expected[rid] = {"request_id": rid, "expert_choices": choices,
                         "bits_mean": sum(n * sum(at[i]) for i, n in tokens.items()) / choices,
                         "bits_min": min(min(at[i]) for i in token_steps),
                         "in_transition": any(i in inside for i in token_steps), "steps": len(token_steps)}
    got = {r["request_id"]: r for r in tables["request_bits"]}
    assert got == expected
    assert {r["in_transition"] for r in got.values()} == {True, False}
    assert not got["s0"]["in_transition"] and got["s0"]["steps"] == 6
    assert sum(o.extras["demotions"] for o in outs) > 0 and min(r["bits_min"] for r in got.values()) < 16


def staggered(n: int = 16, new: int = 16, seed: int = 4) -> dict[int, list[EngineRequest]]:
    """Demo-model requests arriving one every third step: KV demand that rises and falls."""
    return {3 * i: [r] for i, r in enumerate(random_prompts(1109, n, new, seed))}


def ledger_deltas(name: str, arrivals, **options) -> tuple[list, list[int]]:
    """Each step's output and the expert-pages bytes the transfer ledger counted during it."""
    engine = create_calibrated(name, {"model": DEMO, **CPU32, **options})
    engine.start()
    marks: list[int] = []
    try:
        outs = serve(engine, arrivals, lambda when: marks.append(engine.ledger.total["h2d:expert_pages"]))
    finally:
        engine.stop()
    return outs, [b - a for a, b in zip(marks[::2], marks[1::2])]


@pytest.mark.parametrize(("name", "options"), [
    # feedback pinning experts up: its moves start after the step's compute and count in that step
    ("pagedweight", {"budget_bytes": 1_600_000, "feedback_every": 4, "feedback_threshold": 0.001}),
    # experts that left the device are fetched on demand under the same tag (not moves: their own column)
    pytest.param("full", {"budget_bytes": DEMO_DENSE + int(0.15 * DEMO_EXPERTS), "kv_placement": "host",
                          "host_kv_gb": 0.01}, marks=pytest.mark.slow),
])
def test_each_steps_move_bytes_are_the_expert_page_bytes_the_ledger_counted(name, options):
    outs, counted = ledger_deltas(name, staggered(), **options)
    reported = [o.extras["move_bytes"] + o.extras["on_demand_fetch_bytes"] for o in outs]
    assert reported == counted
    assert sum(o.extras["move_bytes"] for o in outs) > 0
    assert sum(o.extras["promotions"] for o in outs) > 0 and sum(o.extras["demotions"] for o in outs) > 0
    if name == "pagedweight":
        assert sum(o.extras["fallbacks"] for o in outs) > 0
        assert sum(o.extras["on_demand_fetch_bytes"] for o in outs) == 0  # every expert stays on the device
    else:
        assert sum(o.extras["on_demand_fetches"] for o in outs) > 0


def moves(**options) -> int:
    engine = create_calibrated("pagedweight", {"model": DEMO, **CPU32, "budget_bytes": 1_600_000, **options})
    engine.start()
    try:
        outs = serve(engine, staggered())
    finally:
        engine.stop()
    return sum(o.extras["promotions"] + o.extras["demotions"] for o in outs)


@pytest.mark.slow  # ~11 s; kept under the README's ~12 min; CI's slow step runs it
def test_residence_hysteresis_and_transition_budget_reach_the_arbiter():
    """Each setting changed alone (from PagedWeightConfig's defaults: hysteresis 0.02, 8 steps of
    residence, no transition byte budget) changes the moves of the same seeded traffic; the
    arbiter's own defaults (0.02, 0 steps, none) differ, so an engine that did not hand a
    setting over would repeat the baseline's count."""
    baseline = moves()
    assert baseline == moves()  # deterministic
    assert moves(min_residence_steps=32) < baseline
    assert moves(hysteresis=0.5) < baseline
    assert moves(transition_bytes_per_step=4096) != baseline

"""Engine `pagedweight`: bit widths that change while serving, inside one device budget.

Oracles: `moe`'s greedy tokens (a budget that holds every expert at 16 bits: the paged
backend must compute exactly what the resident one does); the budget itself, checked after
every step of whole runs; a second run of the same seed; a corrupted expert that the
quality feedback has to find.
"""

from __future__ import annotations

import pytest
from engine_runs import random_requests, run_engine
from tiny_models import CPU32

from engines.base import EngineRequest
from harness.calibration import create_calibrated
from harness.offline import run_offline
from harness.run import RunArgs, execute
from workloads.registry import WorkloadSpec

DEMO = "engines/demo_model"


def requests(vocab: int, n: int = 6, new: int = 12, seed: int = 0) -> list[EngineRequest]:
    return random_requests(vocab, n, new, seed, lo=10, hi=120)


def generate(name: str, model, reqs, **options):
    engine = create_calibrated(name, {"model": str(model), **CPU32, **options})
    outputs, steps, _ = run_engine(engine, reqs)
    return outputs, steps, engine


@pytest.mark.parametrize(("model", "representation"), [("demo", "bitplanes"), ("mixtral", "requantize"),
    *(pytest.param(m, r, marks=pytest.mark.slow) for m, r in (("demo", "requantize"), ("mixtral", "bitplanes")))])
def test_a_budget_for_everything_at_16_bits_gives_moes_tokens(model, representation, checkpoints, tmp_path,
                                                              monkeypatch):
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    folder = DEMO if model == "demo" else checkpoints("mixtral")
    reqs = requests(1109 if model == "demo" else 257)
    expected, _, _ = generate("moe", folder, reqs)
    got, steps, engine = generate("pagedweight", folder, reqs, budget_bytes=64 << 20, representation=representation)
    assert got == expected
    assert all(s.extras["mean_bits"] == 16 and s.extras["demotions"] == 0 for s in steps)


def run_rag(tmp_path, engine: str, **options):
    # all at t=0: the steps do not depend on this machine's speed, so the bits do not either
    spec = WorkloadSpec("rag_long", requests=24, arrival="offline", seed=3)
    folder, run = execute(RunArgs(workload=spec, engine=engine, model=DEMO,
                                  engine_options={**CPU32, **options},
                                  output=str(tmp_path / f"{engine}-{len(list(tmp_path.iterdir()))}"),
                                  warmup=0, quality=False))
    assert run["status"] == "complete", run["error"]
    import pandas as pd

    return run, pd.read_parquet(folder / "steps.parquet")


@pytest.mark.slow  # rag_long on the demo model at several budgets (~15 s on 2 cores)
def test_rag_long_under_shrinking_budgets(tmp_path, monkeypatch):
    """Budgets of 100%, 60%, 40% and 30% of (full-precision expert bytes + the peak KV the
    same traffic needs without a budget), dense weights on top: never exceeded after any
    step, no request fails, mean bits fall as the budget shrinks and rise again once the
    long requests are done."""
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    ref, ref_steps = run_rag(tmp_path, "moe", prefix_caching=False)
    peak_kv = int(ref_steps["device_kv_bytes"].max())
    dense = ref["engine"]["model_stats"]["dense_weight_bytes"] + 1109 * 128 * 4  # + the tied embedding table
    experts = ref["engine"]["weight_bytes"] - dense
    means = []
    for share in (1.0, 0.6, 0.4, 0.3):
        budget = int(dense + share * (experts + peak_kv))
        run, steps = run_rag(tmp_path, "pagedweight", budget_bytes=budget)
        s = run["summary"]
        assert s["completed"] == 24 and s["failed"] == 0, share
        assert ((steps["device_weight_bytes"] + steps["device_kv_bytes"]) <= budget).all(), share
        assert s["memory"]["peak_device_bytes"] <= budget
        means.append(float(steps["x_mean_bits"].mean()))
        if share < 1.0:
            assert steps["x_mean_bits"].min() < 16  # the budget made it demote
            assert steps["x_mean_bits"].iloc[-1] > steps["x_mean_bits"].min()  # and promote again
    assert means == sorted(means, reverse=True) and means[0] > means[-1], means


@pytest.mark.slow  # kept under the README's ~12 min; CI's slow step runs it
def test_same_seed_same_bits_bytes_and_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    reqs = requests(1109, n=8, new=16, seed=5)
    runs = [generate("pagedweight", DEMO, reqs, budget_bytes=1_900_000, feedback_every=4) for _ in range(2)]
    (t1, s1, e1), (t2, s2, e2) = runs
    assert t1 == t2
    keys = ("mean_bits", "promotions", "demotions", "move_bytes", "fallbacks", "feedback_checks")
    assert [[s.extras[k] for k in keys] for s in s1] == [[s.extras[k] for k in keys] for s in s2]
    assert [s.h2d_bytes for s in s1] == [s.h2d_bytes for s in s2]
    assert e1.tables()["expert_bits"] == e2.tables()["expert_bits"]
    assert sum(s.extras["demotions"] for s in s1) > 0  # the budget is tight enough to matter


def test_feedback_finds_a_corrupted_expert_and_pins_it_up(tmp_path, monkeypatch):
    """Scale one quantized expert's scales by 8 in the host tier: the feedback's measured error
    for its layer rises above the threshold within `feedback_every` steps and the expert is
    pinned one width higher (recorded as a fallback)."""
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    engine = create_calibrated("pagedweight", {"model": DEMO, **CPU32, "budget_bytes": 1_600_000, "feedback_every": 3,
                                               "feedback_share": 0.5, "feedback_threshold": 0.2})
    engine.start()
    try:
        backend = engine.experts
        key = min(backend.held, key=lambda k: (backend.bits(k), k))
        bits = backend.bits(key)
        assert bits < 16
        held = backend.held[key]
        scale_parts = [n for n in held.parts if "scale" in n]
        assert scale_parts
        for name in scale_parts:
            held.parts[name].mul_(8.0)  # the device copy the steps read
        for r in requests(1109, n=6, new=20, seed=9):
            engine.add_request(r)
        steps = []
        while engine.has_unfinished() and len(steps) < 12:
            steps.append(engine.step())
        events = engine.tables()["fallbacks"]
        final_bits = backend.bits(key)
    finally:
        engine.stop()
    pinned = [e for e in events if (e["layer"], e["expert"]) == key]
    assert pinned, events
    assert pinned[0]["engine_step"] < 3 + 3  # found at the first or second check
    # (bit-planes share the scales across widths, so the corruption follows demotions too)
    assert pinned[0]["from_bits"] <= bits and pinned[0]["floor_bits"] > pinned[0]["from_bits"]
    assert final_bits >= pinned[-1]["floor_bits"]  # moved up at once, not left below its floor
    assert pinned[0]["expert_error"] > 0.2
    assert sum(s.extras["fallbacks"] for s in steps) >= 1


def test_an_expert_at_0_bits_runs_through_the_staging_slot_at_its_quality_floor(tmp_path, monkeypatch):
    """floor_bits=0: an expert that left the device is fetched on demand at its quality floor
    through the staging slots (counted in the device bytes and the budget minimum) and gives
    exactly what the same expert held at that width gives; the fetch's bytes are counted."""
    import torch

    from engines.runtime.experts import dispatch

    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    engine = create_calibrated("pagedweight", {"model": DEMO, **CPU32, "budget_bytes": 2_000_000, "floor_bits": 0})
    engine.start()
    try:
        backend = engine.experts
        key = (1, 2)
        store = backend.stores[key]
        lowest = backend.fetch_bits[key]  # its quality floor (max_expert_error)
        assert lowest == min(b for b in store.bits if b == 16 or engine.paged.sensitivity[key][b] <= 0.01)
        slot = max(s.nbytes(backend.fetch_bits[k]) for k, s in backend.stores.items())
        assert backend.staging_bytes == slot  # copies are memcpys at issue here: one slot, nothing to overlap
        minimum = dict(engine.budget.parts())
        assert minimum["a staging slot for one expert fetched on demand at its quality floor"] == backend.staging_bytes
        held_bytes = backend.device_bytes()
        x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
        ids = torch.tensor([[2, 0], [2, 1], [3, 2], [2, 3], [0, 1]])
        weights = torch.full((5, 2), 0.5)
        d = dispatch(ids, weights, torch.bincount(ids.flatten(), minlength=4).tolist())
        backend.start_move(key, lowest)
        backend.commit()
        at_lowest = backend.forward(1, x, d)
        backend.start_move(key, 0)
        assert backend.bits(key) == 0
        h2d_before = engine.ledger.total["h2d:expert_pages"]
        on_demand = backend.forward(1, x, d)
        h2d_after = engine.ledger.total["h2d:expert_pages"]
    finally:
        engine.stop()
    assert torch.equal(on_demand, at_lowest)
    assert h2d_after - h2d_before == store.transfer_bytes(0, lowest)
    assert backend.step_stats()["on_demand_fetches"] >= 1
    assert backend.device_bytes() < held_bytes + store.nbytes(lowest)  # the fetched copy was not kept


def test_on_demand_fetches_pipeline_through_two_slots(tmp_path, monkeypatch):
    """With copies beside compute (the link model), four routed experts, none on the device:
    two copies go out before any computes, and each later copy is issued as soon as an
    expert's compute freed its slot, so expert k+1 copies while expert k computes and never
    more than two fetched experts are on the device (both slots in the budget minimum). The
    result is what the same experts held at their fetch widths give."""
    import torch

    from engines.runtime.experts import dispatch

    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    engine = create_calibrated("pagedweight", {"model": DEMO, **CPU32, "budget_bytes": 2_000_000, "floor_bits": 0,
                                               "link_gbps": 50})
    engine.start()
    log: list[tuple[str, int]] = []
    try:
        backend = engine.experts
        assert backend.staging_bytes == 2 * backend.staging_slot_bytes()
        minimum = dict(engine.budget.parts())
        assert minimum["2 staging slots for experts fetched on demand at their quality floor (one copies while "
                       "another computes)"] == backend.staging_bytes
        keys = [(1, e) for e in range(4)]
        x = torch.randn(6, 128, generator=torch.Generator().manual_seed(1))
        ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
        d = dispatch(ids, torch.full((6, 2), 0.5), torch.bincount(ids.flatten(), minlength=4).tolist())
        for k in keys:
            backend.start_move(k, backend.fetch_bits[k])
        backend.commit()
        held = backend.forward(1, x, d)
        for k in keys:
            backend.start_move(k, 0)
        assert all(backend.bits(k) == 0 for k in keys)

        copies, issued = backend.copies, []
        h2d = copies.h2d

        def logged_h2d(pairs, tag):
            handle, n = h2d(pairs, tag=tag), len(issued)
            issued.append(handle)
            log.append(("issue", n))
            wait = handle.wait

            def logged_wait():
                log.append(("wait", n))
                return wait()
            handle.wait = logged_wait
            return handle
        copies.h2d = logged_h2d
        fetched = backend.forward(1, x, d)
        copies.h2d = h2d
    finally:
        engine.stop()
    assert torch.equal(fetched, held)
    assert log == [("issue", 0), ("issue", 1), ("wait", 0), ("issue", 2), ("wait", 1), ("issue", 3),
                   ("wait", 2), ("wait", 3)]


def test_kv_demand_counts_only_queued_requests_that_could_be_admitted(tmp_path, monkeypatch):
    """The arbiter demotes experts only for KV a request can use: waiting requests count in
    admission order while they fit the pool as it is with every expert at its floor; the
    first that does not fit (and every one after it) waits either way."""
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    engine = create_calibrated("pagedweight", {"model": DEMO, **CPU32, "budget_bytes": 1_900_000})
    engine.start()
    try:
        alloc = engine.kv.allocator
        pool = alloc.num_blocks * alloc.block_size  # tokens with every expert at its floor
        size = int(pool * 0.4)  # two fit the pool, three do not
        new = 8
        for i in range(4):
            engine.add_request(EngineRequest(f"w{i}", (3,) * (size - new), new, ignore_eos=True))
        per = alloc.blocks_for(size)
        assert 2 * per <= alloc.num_blocks < 3 * per
        assert engine.controller.kv_demand_blocks() == 2 * per  # w0 and w1; w2 would not fit even at the floors
    finally:
        engine.stop()


@pytest.mark.parametrize("bound", [0.01, *(pytest.param(b, marks=pytest.mark.slow) for b in (0.05, None))])
def test_quality_floors_keep_every_expert_within_max_expert_error(bound, tmp_path, monkeypatch):
    """An expert's floor is the lowest width whose measured sensitivity is within
    max_expert_error (None: floor_bits); a budget far too small for the KV demand never pushes
    an expert below it, and the pool is sized with every expert at that floor."""
    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    engine = create_calibrated("pagedweight", {"model": DEMO, **CPU32, "budget_bytes": 1_500_000,
                                               "max_expert_error": bound, "feedback_every": 0})
    engine.start()  # feedback off: the floors stay the ones the measured sensitivities give
    try:
        expected = {k: 2 if bound is None else min(b for b in (16, 8, 4, 3, 2) if b == 16 or s[b] <= bound)
                    for k, s in engine.paged.sensitivity.items()}
        assert engine.paged.floors == expected
        steps = []
        run_offline(engine, requests(1109, n=10, new=24, seed=2), on_step=steps.append)
    finally:
        engine.stop()
    below = [(row["engine_step"], row["layer"], row["expert"]) for row in engine.tables()["expert_bits"]
             if row["bits"] < expected[(row["layer"], row["expert"])]]
    assert not below
    assert min(s.extras["mean_bits"] for s in steps) >= sum(expected.values()) / len(expected)
    assert any(s.extras["mean_bits"] < 16 for s in steps)  # the budget did make it demote


def test_quality_pins_never_take_the_kv_a_request_in_flight_needs(tmp_path, monkeypatch):
    """feedback_threshold 0 pins every expert the feedback samples one width up, at every step, up
    to 16 bits (floors are never demoted). Before, the floors took the KV room an admitted 900-token
    request needed and it waited forever (a rag_long run stalled at 6 of 12 requests). Now a pin is
    refused while a request in flight needs that room (an event with refused_bits), every request
    finishes, and one that arrives after the floors rose is refused at admission with the room left."""
    from engines.base import InvalidRequestError

    monkeypatch.setenv("PWBENCH_CACHE", str(tmp_path))
    engine = create_calibrated("pagedweight", {"model": DEMO, **CPU32, "budget_bytes": 2_511_052,
                                               "feedback_threshold": 0.0, "feedback_every": 1})
    engine.start()
    try:
        controller = next(c for c in engine.parts.controllers if c.max_request_tokens() is not None)
        long = EngineRequest("long", tuple(range(5, 805)), 100, ignore_eos=True)  # 900 tokens
        for r in [long, *random_requests(1109, 4, 24, 5, lo=100, hi=300)]:
            engine.add_request(r)
        steps, rooms = 0, []
        while engine.has_unfinished() and steps < 2_000:
            finished = {o.request_id for o in engine.step().outputs if o.finished}
            steps += 1
            if "long" not in finished and any(s.id == "long" for s in engine.scheduler.running):
                rooms.append(controller.max_request_tokens())
        assert not engine.has_unfinished(), "requests left waiting"
        assert rooms and min(rooms) >= 900  # while it ran, the floors left it its room
        refused = [e for e in engine.tables()["fallbacks"] if e["refused_bits"]]
        assert refused and all(e["refused_bits"] > e["floor_bits"] for e in refused)
        room = controller.max_request_tokens()  # the floors rose once it finished
        assert room < 900
        with pytest.raises(InvalidRequestError, match="beside the weights' floors"):
            engine.add_request(EngineRequest("too-long", tuple(range(5, 5 + room)), 16, ignore_eos=True))
    finally:
        engine.stop()

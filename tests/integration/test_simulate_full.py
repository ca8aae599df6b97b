"""--simulate with engine full: pagedweight's stores, arbiter and page moves under moegen's plan and
layer-major step, on the meta device, priced by moegen's cost model.

Oracle: a measured `full` run on the bundled model, at a budget where the arbiter demotes,
promotes and fetches experts on demand, with the KV where its plan puts it. The simulated run
is given what the measured run's start computed from weights or from this machine:

- the routing: recorded from the measured `full` run itself. Not from a measured `moe` run (as
  test_simulate_moegen does): full's demoted experts change the hidden states, so its routing is
  not moe's (15 to 21 of the 704 (token, layer) choices differ in the cases below; replayed,
  moe's routing gives the stream and device cases other experts hit and on-demand fetches than
  the measured full run has). `record_routing` refuses layer-major executors, though
  LayerMajorExecutor routes each layer's whole batch in row order, as the flat executor does; so
  the test hangs the same recorder (engines/sim/routing.py RoutingRecorder) on the model's
  routing hook with the batch's (request, position) keys;
- the sensitivities: the table the measured start wrote (`sim_sensitivity`);
- the plan: the measured run's KV placement and micro-batch (its own choice on this machine's
  peaks), fixed for the simulated run, whose planner then gives the same plan.

Both weigh experts by token shares (`importance_from` tokens) and run without quality feedback.
Then KV capacity, weight bytes and every step's batch, preemptions, experts that ran, bytes
read and copied each way and device bytes, and every bit-width extra (mean bits, widths held,
promotions, demotions, move bytes, on-demand fetches) are equal; only `predicted_step_s` differs
(moegen's prediction on this machine's peaks against the profile's). Scale: Mixtral-8x7B on one
H100 under a 60 GB budget, its plan the planner's on the profile, experts below 16 bits, every
step priced at or above the roofline of the bytes it reads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from engines.base import EngineRequest
from engines.moegen.plan import loaded_shape, make_plan
from engines.moegen.simulate import sim_hardware
from engines.registry import create_engine
from engines.sim.routing import RoutingRecorder

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "engines" / "demo_model")
MIXTRAL = str(ROOT / "engines" / "sim" / "presets" / "mixtral-8x7b")
STEP_KEYS = ("num_prefill_tokens", "num_decode_tokens", "num_running", "num_waiting", "num_preempted",
             "cached_prompt_tokens", "experts_hit", "context_tokens", "weight_bytes_read", "h2d_bytes",
             "h2d_transfers", "d2h_bytes", "d2h_transfers", "device_weight_bytes", "device_kv_bytes")
PLAN = ("kv_placement", "batch_seqs", "micro_batch", "expert_slots", "resident_experts", "staging_bytes",
        "host_share")
MACHINE = ("predicted_step_s",)  # the plan's prediction: this machine's peaks vs the profile's
# Token-id calibration prompts (the demo model refuses random ones): the measured start computes
# its sensitivity table from them.
CALIB = [[(13 * i + 5 * j) % 400 + 3 for j in range(96)] for i in range(4)]


def _requests() -> list[EngineRequest]:
    """Distinct prompts (no prefix-cache hit) and output lengths that end one by one."""
    return [EngineRequest(f"r{i}", tuple((13 * i + 7 * j) % 400 + 3 for j in range(18 + 5 * i)), 6 + i,
                          ignore_eos=True) for i in range(8)]


def _run(engine) -> list[dict]:
    for r in _requests():
        engine.add_request(r)
    rows = []
    while engine.has_unfinished():
        out = engine.step()
        rows.append({**{k: getattr(out, k) for k in STEP_KEYS},
                     **{k: v for k, v in out.extras.items() if k not in MACHINE}})
    return rows


def _record_routing(engine, recorder: RoutingRecorder) -> None:
    """What record_routing does, for a layer-major executor: each MoE layer's choices of the
    step's rows, keyed (request id, position) in the batch's row order."""
    keys: list[tuple[str, int]] = []
    engine.model.on_route = lambda layer, ids: recorder.add(layer, keys, ids.cpu().numpy())
    execute = engine.executor.execute

    def recorded(batch):
        keys[:] = batch.row_keys()
        return execute(batch)

    engine.executor.execute = recorded


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One PWBENCH_CACHE for the module: the demo's sensitivity table is measured once."""
    return tmp_path_factory.mktemp("cache")


CASES = [
    # The plan's own choice on this machine: KV in the host tier; 3.5 bits on average, experts
    # demoted, promoted and fetched on demand at their quality floor.
    {"budget_bytes": 1_100_000},
    # KV streamed through a staging buffer of 4-sequence parts; experts at 3-4 bits, fetches.
    pytest.param({"budget_bytes": 1_250_000, "kv_placement": "stream", "micro_batch": 4, "plan_context": 16,
                  "max_model_len": 128}, marks=pytest.mark.slow),
    # KV on the device: the arbiter gives the pages what the KV demand leaves (all experts off
    # the device while the batch holds its KV, promoted as requests finish).
    pytest.param({"budget_bytes": 1_350_000, "kv_placement": "device", "plan_context": 32, "max_model_len": 128},
                 marks=pytest.mark.slow),
    pytest.param({"budget_bytes": 1_560_000, "kv_placement": "split", "host_share": 0.5, "micro_batch": 2,
                  "max_model_len": 256}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("options", CASES)
def test_simulated_full_takes_the_measured_decisions(options, cache, tmp_path, monkeypatch):
    monkeypatch.setenv("PWBENCH_CACHE", str(cache))
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps(CALIB))
    trace = tmp_path / "routing.parquet"
    common = {"model": DEMO, "importance_from": "tokens", "feedback_every": 0, "host_kv_gb": 0.01, **options}
    measured = create_engine("full", {**common, "device": "cpu", "dtype": "float32", "calib_file": str(calib)})
    measured.start()
    try:
        recorder = RoutingRecorder()
        _record_routing(measured, recorder)
        want = _run(measured)
        want_info, want_tables, want_plan = measured.info(), measured.tables(), measured.plan
    finally:
        measured.stop()
    recorder.write(trace)
    written = list((cache / "sensitivity").glob("*.json"))
    assert len(written) == 1  # the table the measured start wrote
    fixed = {"kv_placement": want_plan.kv_placement, "micro_batch": want_plan.micro_batch}
    if want_plan.kv_placement == "split":
        fixed["host_share"] = want_plan.host_share
    simulated = create_engine("full", {**common, **fixed, "simulate": "cpu", "routing": f"replay:{trace}",
                                       "sim_sensitivity": str(written[0])})
    simulated.start()
    try:
        plan = simulated.plan
        got = _run(simulated)
        info, tables = simulated.info(), simulated.tables()
        replay = simulated.simulation.routing.describe()
        executor, notes = simulated.executor, simulated.notes()
    finally:
        simulated.stop()
    assert [getattr(plan, k) for k in PLAN] == [getattr(want_plan, k) for k in PLAN]
    assert replay["replay_misses"] == 0 and replay["replay_hits"] == recorder.rows  # every (token, layer) replayed
    assert info.kv_capacity_tokens == want_info.kv_capacity_tokens
    assert info.weight_bytes == want_info.weight_bytes and info.kv_cache_bytes == want_info.kv_cache_bytes
    # The case has something to decide: widths change, experts leave and are fetched, KV or
    # activations cross the link as the placement says.
    assert sum(s["move_bytes"] for s in want) > 0 and len({s["mean_bits"] for s in want}) > 1
    assert all(s["mean_bits"] < 16 for s in want) and sum(s["on_demand_fetches"] for s in want) > 0
    if want_plan.kv_placement != "device":
        assert sum(s["d2h_bytes"] for s in want) > 0
    assert got == want
    bits = [{k: v for k, v in r.items() if k != "importance"} for r in tables["expert_bits"]]
    assert bits == [{k: v for k, v in r.items() if k != "importance"} for r in want_tables["expert_bits"]]
    assert [r["importance"] for r in tables["expert_bits"]] == pytest.approx(
        [r["importance"] for r in want_tables["expert_bits"]], rel=1e-9)
    assert info.device == "simulated cpu" and info.model_stats["sim_steps"] == len(want)
    assert executor.totals.seconds >= executor.totals.roofline_s > 0
    assert any("quality feedback off" in n for n in notes) and any(str(written[0]) in n for n in notes)


def test_mixtral_full_on_one_h100_under_60_gb():
    """Mixtral-8x7B's routed experts are 84 GiB in bf16: under 60 GB the arbiter holds them below
    16 bits; the plan is the planner's on the profile's machine; every step is priced at or
    above the roofline of the bytes it reads, and at or above its page moves on the link."""
    budget = 60 * 10**9
    engine = create_engine("full", {"model": MIXTRAL, "simulate": "h100-sxm", "routing": "uniform",
                                    "budget_bytes": budget, "max_num_seqs": 16})
    engine.start()
    try:
        cfg, sim, backend = engine.config, engine.simulation, engine.paged.backend
        profile = sim.profile
        # The plan: moegen's planner on the profile's hardware for experts at their quality floor
        # (an independent call), its residents then what the arbiter placed.
        shape = loaded_shape(engine.loaded, 352_321_536, "full")
        at_floor = dataclasses.replace(shape, expert_bytes=max(s.nbytes(engine.paged.quality[k])
                                                                for k, s in backend.stores.items()))
        hw = sim_hardware(profile, "bfloat16", shape, sim.shared_processor, cfg.plan_context)
        want = make_plan(dataclasses.replace(cfg, expert_slots=backend.fetch_slots), at_floor, hw,
                         engine.checkpoint.config.max_position_embeddings)
        plan = engine.plan
        assert [getattr(plan, k) for k in PLAN if k not in ("resident_experts", "expert_slots")] == \
               [getattr(want, k) for k in PLAN if k not in ("resident_experts", "expert_slots")]
        # 60 GB holds every expert at 4 bits or more here: all resident, no ring.
        assert plan.resident_experts == len(backend.held) and plan.expert_slots == (0 if len(backend.held) == 256
                                                                                    else backend.fetch_slots)
        info = engine.info()
        assert info.weight_bytes <= budget
        for i in range(6):
            engine.add_request(EngineRequest(f"r{i}", tuple(range(1 + i, 200 + 37 * i)), 6, ignore_eos=True))
        executor, steps, link = engine.executor, [], hw.link_bytes_per_s
        while engine.has_unfinished():
            out = engine.step()
            cost = executor.last
            assert cost.seconds >= cost.roofline_s >= out.weight_bytes_read / profile.memory_bytes_per_s * (1 - 1e-9)
            # Page moves cross the link before the step's end: it takes at least their link time.
            assert cost.parts["page_moves_link"] == pytest.approx(out.extras["move_bytes"] / link, rel=1e-9)
            assert cost.seconds >= cost.parts["page_moves_link"]
            assert out.device_weight_bytes + out.device_kv_bytes <= budget
            steps.append(out)
        assert sum(len(s.outputs) for s in steps) >= 6 * 6
        assert all(s.extras["experts_at_16_bits"] < 256 and s.extras["mean_bits"] < 16 for s in steps)
        assert engine.virtual_clock.now() == pytest.approx(executor.totals.seconds) and executor.totals.seconds > 0
        assert engine.info().model_stats["sim_steps"] == len(steps)
    finally:
        engine.stop()

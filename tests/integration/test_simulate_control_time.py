"""--simulate's control time: the CPU time of the engine's own control code is measured and added
to each simulated step (`control_time = "measured"`), and nothing is added with "off".

Oracle: a controller hook that burns a known amount of this thread's CPU time before every step
(busy work, so thread time counts it): with "measured" each step lasts at least its compute
price plus that much; with "off" each step is exactly its compute price (two runs equal to the
last bit); the harness's loop between the steps of a busy engine (a busy loop between
engine.step calls) is charged to the next step, and time while the engine is idle (a warm-up's
teardown, a wait for arrivals) is not."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engines.base import EngineError, EngineRequest
from engines.registry import create_engine
from engines.runtime.engine import Controller

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "engines" / "demo_model")
BURN_S = 0.004


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class SlowController(Controller):
    """A controller whose before_step spends BURN_S of CPU (an arbiter that plans slowly)."""

    def before_step(self) -> None:
        _burn(BURN_S)


def _run(control_time: str, slow: bool, between: float = 0.0, idle: float = 0.0,
         batches: int = 1) -> list[list[tuple[float, dict]]]:
    """Per batch of 4 requests (each served to the end), each step's (seconds, cost parts)."""
    engine = create_engine("offload", {"model": DEMO, "simulate": "cpu", "routing": "uniform",
                                       "experts_per_layer": 2, "budget_bytes": 6 << 20,
                                       "control_time": control_time})
    engine.start()
    try:
        if slow:
            engine.parts.controllers.append(SlowController())
        out = []
        for b in range(batches):
            _burn(idle)  # the engine is idle: a wait for arrivals, a warm-up's teardown
            for i in range(4):
                engine.add_request(EngineRequest(f"b{b}r{i}", tuple(range(3, 40 + 5 * i)), 6, ignore_eos=True))
            steps = []
            while engine.has_unfinished():
                before = engine.virtual_clock.now()
                engine.step()
                cost = engine.simulation.executor.last
                steps.append((engine.virtual_clock.now() - before, dict(cost.parts)))
                _burn(between)  # the harness's loop between steps of a busy engine
            out.append(steps)
        return out
    finally:
        engine.stop()


def test_a_slow_control_hook_lengthens_every_step_by_its_cpu_time():
    [steps] = _run("measured", slow=True)
    assert len(steps) > 5
    for seconds, parts in steps:
        compute = sum(v for k, v in parts.items() if k not in ("link_busy", "control"))
        assert seconds == pytest.approx(compute + parts["control"])
        assert parts["control"] >= BURN_S  # the hook's busy time, at least
    # The engine's own control code alone (no hook) is far below the hook's time.
    [plain] = _run("measured", slow=False)
    assert sorted(p.get("control", 0.0) for _, p in plain)[len(plain) // 2] < BURN_S


def test_the_loop_between_busy_steps_counts_and_idle_time_does_not():
    first, second = _run("measured", slow=False, between=0.01, idle=0.03, batches=2)
    for steps in (first, second):
        assert steps[0][1].get("control", 0.0) < 0.01  # after idle (or start): only its own step
        assert all(p["control"] >= 0.01 for _, p in steps[1:])  # the loop since the step before


def test_off_prices_compute_only_and_is_deterministic():
    a, b = _run("off", slow=True), _run("off", slow=True)
    assert a == b
    assert all("control" not in parts for _, parts in a[0])


def test_a_bad_control_time_is_a_one_line_error():
    engine = create_engine("moe", {"model": DEMO, "simulate": "cpu", "control_time": "sometimes"})
    with pytest.raises(EngineError, match=r"control_time must be one of measured, off.*--set control_time=off"):
        engine.start()


def test_admissions_on_an_idle_engine_count_and_a_rejected_one_does_not():
    """A measured run's first token waits for its requests' admission; the simulated first step is
    charged for it. A request refused on an idle engine starts nothing: the idle time after it is
    not charged."""
    from engines.base import InvalidRequestError

    engine = create_engine("moe", {"model": DEMO, "simulate": "cpu", "routing": "uniform"})
    engine.start()
    try:
        admit = engine.scheduler.add

        def slow_add(seq):  # an admission that takes BURN_S of CPU
            _burn(BURN_S)
            return admit(seq)

        engine.scheduler.add = slow_add
        with pytest.raises(InvalidRequestError):
            engine.add_request(EngineRequest("bad", (3, 10**9), 2, ignore_eos=True))
        _burn(0.03)  # idle after the refusal
        for i in range(3):
            engine.add_request(EngineRequest(f"r{i}", tuple(range(3, 30)), 2, ignore_eos=True))
        engine.step()
        control = engine.simulation.executor.last.parts["control"]
        assert 3 * BURN_S <= control < 3 * BURN_S + 0.03
    finally:
        engine.stop()

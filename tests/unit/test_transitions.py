"""Transition windows (harness/precision.py) on a hand-made steps table.

Oracle: the windows, rates, bytes and inter-token percentiles worked out by hand below.
"""

from __future__ import annotations

import pytest

from harness.precision import transition_steps, transition_summary, windows


def step(t, d, promotions=0, demotions=0, inflight=0, moved=0):
    return {"t_s": t, "duration_s": d, "x_promotions": promotions, "x_demotions": demotions,
            "x_moves_in_flight": inflight, "x_move_bytes": moved}


# Step ends 0.1, 0.2, 0.4, 0.5, 0.8, 0.9, 1.1. Transition steps: 1 (a promotion in flight), 3 (two
# demotions), 4 (only a copy in flight), 6 (a promotion and a demotion): windows {1}, {3, 4}, {6}.
STEPS = [step(0.0, 0.1), step(0.1, 0.1, 1, 0, 1, 1000), step(0.2, 0.2), step(0.4, 0.1, 0, 2),
         step(0.5, 0.3, 0, 0, 1), step(0.8, 0.1), step(1.0, 0.1, 1, 1, 1, 300)]
REQUESTS = [
    # gaps 0.1 (ends at step 1: inside), 0.2 (step 2: outside), 0.1 (step 3: inside)
    {"request_id": "a", "token_times_s": [0.1, 0.2, 0.4, 0.5]},
    # gaps 0.4 (step 4: inside), 0.1 (step 5: outside), 0.2 (step 6: inside)
    {"request_id": "b", "token_times_s": [0.4, 0.8, 0.9, 1.1]},
    {"request_id": "c", "token_times_s": [0.2]},  # one token: no gap
    {"request_id": "w", "token_times_s": [0.1, 0.9], "warmup": True},  # not measured
    {"request_id": "x", "token_times_s": None, "error": "refused"},
]


def test_transition_steps_and_windows():
    assert transition_steps(STEPS) == {1, 3, 4, 6}
    assert windows({1, 3, 4, 6}) == 3
    assert windows(set()) == 0


def test_summary_by_hand():
    got = transition_summary(REQUESTS, STEPS, duration_s=30.0)
    # inside gaps 0.1, 0.1, 0.2, 0.4 s: linear ranks at 1.5, 2.7, 2.97 -> 150, 340, 394 ms
    # outside gaps 0.1, 0.2 s: ranks 0.5, 0.9, 0.99 -> 150, 190, 199 ms
    assert got == {
        "windows": 3,
        "per_minute": pytest.approx(6.0),  # 3 windows in 30 s
        "move_bytes": 1300,
        "itl_ms_inside": {"p50": pytest.approx(150.0), "p90": pytest.approx(340.0), "p99": pytest.approx(394.0)},
        "itl_ms_outside": {"p50": pytest.approx(150.0), "p90": pytest.approx(190.0), "p99": pytest.approx(199.0)},
        "steps_inside": 4,
        "steps_outside": 3,
    }
    assert isinstance(got["move_bytes"], int)


def test_a_token_time_that_is_no_step_end_is_left_out():
    # 0.65 ends no step: the gap 0.5 -> 0.65 is dropped; 0.65 -> 0.8 ends at step 4 (inside), 0.8 -> 0.9
    # at step 5 (outside)
    got = transition_summary([{"token_times_s": [0.5, 0.65, 0.8, 0.9]}], STEPS, duration_s=60.0)
    assert got["itl_ms_inside"] == pytest.approx({"p50": 150.0, "p90": 150.0, "p99": 150.0})
    assert got["itl_ms_outside"] == pytest.approx({"p50": 100.0, "p90": 100.0, "p99": 100.0})
    assert got["per_minute"] == pytest.approx(3.0)


def test_missing_extras_and_nan_columns():
    plain = [{"t_s": 0.0, "duration_s": 0.1}, {"t_s": 0.1, "duration_s": 0.1}]
    assert transition_summary([{"token_times_s": [0.1, 0.2]}], plain, 1.0) is None
    # a column absent in some rows reads as NaN after a parquet round trip: no move there
    nan = float("nan")
    mixed = [step(0.0, 0.1, 1), {"t_s": 0.1, "duration_s": 0.1, "x_promotions": nan, "x_demotions": nan,
                                 "x_moves_in_flight": nan, "x_move_bytes": nan}]
    assert transition_steps(mixed) == {0}
    assert transition_summary([], mixed, 1.0)["move_bytes"] == 0

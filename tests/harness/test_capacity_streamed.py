"""A capacity search that drops each point's records as they become final (what `pwbench run
--find-capacity` does, so a point of 20k requests holds none) judges every point exactly as
the search that keeps them, whose points tests/harness/test_capacity.py recomputes by hand."""

from __future__ import annotations

from engines.dummy import DummyConfig, DummyEngine
from harness.capacity import CapacitySettings, find_capacity
from workloads.base import Request


class SimClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += max(seconds, 1e-9)


def search(keep_records: bool):
    clock = SimClock()
    engine = DummyEngine(DummyConfig(base_ms=10.0, max_num_seqs=1), sleep=clock.advance)
    engine.start()
    # 100 requests 1 s apart, 10 tokens each; one of them asks a token id outside the
    # vocabulary, so every point also has a rejection to leave out.
    requests = [Request(f"r{i}", (5, 6, 7, 40000 if i == 7 else i % 50 + 10), 10, arrival_s=float(i + 1))
                for i in range(100)]
    settings = CapacitySettings(attainment=0.95, start_rate=2.0, tolerance=0.10, max_points=8)
    return find_capacity(engine, requests, {"ttft_ms": 50.0, "tpot_ms": 100.0}, settings, clock=clock.now,
                         sleep=clock.advance, keep_records=keep_records)


def test_dropping_records_judges_every_point_the_same():
    kept, dropped = search(True), search(False)
    assert dropped.to_dict() == kept.to_dict()
    assert len(kept.points) >= 3 and {p.passed for p in kept.points} == {True, False}
    assert all(p.rejected == 1 for p in kept.points)
    assert all(r.requests for r in kept.records) and not any(r.requests for r in dropped.records)

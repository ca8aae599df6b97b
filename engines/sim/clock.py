"""The virtual clock of a simulated run: it moves only when told (a step's predicted duration,
the run loop's wait for the next arrival), so an hour of traffic runs in seconds."""

from __future__ import annotations


class VirtualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        """Move the clock forward (the run loop's `sleep`, the executor's step time)."""
        if seconds > 0:
            self.t += seconds

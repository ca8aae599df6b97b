"""Online importance of each routed expert: what share of its layer's routing it gets lately.

Per step and MoE layer the router's dispatch gives each expert's token count and routing
probability mass (the sum of its routing weights). Importance is an exponential moving
average of the expert's share of its layer's mass, so the experts of a layer sum to 1 and a
layer's quality cost is spread by how much of its output each expert makes. Token counts are
kept as an EMA of shares too, and as run totals (the per-run expert selection table).
Before an expert is seen, its importance is the prior (calibration counts, or 1/E).
Deterministic: the inputs are the router's choices, nothing else.

`signal` chooses what importance is: "mass" (the default) or "tokens", the EMA of the expert's
share of its layer's token assignments. A simulated run (--simulate) has routing choices but no
routing weights (`observe_counts`), so it weighs experts by tokens; a measured run asked for
"tokens" weighs them the same way (what the simulator's exactness test compares against).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engines.runtime.experts import Dispatch

Key = tuple[int, int]  # (layer, expert)
SIGNALS = ("mass", "tokens")


class Importance:
    def __init__(self, experts_per_layer: Mapping[int, int], decay: float = 0.9,
                 prior: Mapping[Key, float] | None = None, signal: str = "mass") -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"importance decay must be in [0, 1), got {decay}")
        if signal not in SIGNALS:
            raise ValueError(f"importance signal must be one of {', '.join(SIGNALS)}, got {signal!r}")
        self.decay, self.signal = decay, signal
        self.mass: dict[Key, float] = {}
        self.tokens: dict[Key, float] = {}
        for layer, n in experts_per_layer.items():
            for e in range(n):
                key = (layer, e)
                self.mass[key] = self.tokens[key] = prior[key] if prior and key in prior else 1.0 / n
        self.total_tokens: dict[Key, int] = dict.fromkeys(self.mass, 0)
        self.total_mass: dict[Key, float] = dict.fromkeys(self.mass, 0.0)
        self._step: dict[int, tuple[list[float], list[int]]] = {}

    def observe(self, layer: int, d: Dispatch) -> None:
        """Add one forward's routing (a layer runs once per step; twice adds up)."""
        masses = torch.zeros(len(d.counts), dtype=torch.float64)
        index = torch.repeat_interleave(torch.arange(len(d.counts)), torch.tensor(d.counts))
        masses.index_add_(0, index, d.weights.detach().to("cpu", torch.float64))
        mass, counts = self._step.setdefault(layer, ([0.0] * len(d.counts), [0] * len(d.counts)))
        for e, (m, n) in enumerate(zip(masses.tolist(), d.counts)):
            mass[e] += m
            counts[e] += n

    def observe_counts(self, layer: int, counts: list[int]) -> None:
        """Add one simulated forward's routing: token counts only (no routing weights, so the
        layer's mass is not moved by it)."""
        mass, seen = self._step.setdefault(layer, ([0.0] * len(counts), [0] * len(counts)))
        seen[:] = [a + n for a, n in zip(seen, counts, strict=True)]

    def end_step(self) -> None:
        """Fold this step's shares into the averages (layers that ran nothing keep theirs)."""
        a, b = self.decay, 1 - self.decay
        mass_ema, tokens, total_tokens, total_mass = self.mass, self.tokens, self.total_tokens, self.total_mass
        for layer, (mass, counts) in self._step.items():
            total_m, total_n = sum(mass), sum(counts)
            if not total_n:
                continue
            for e, (m, n) in enumerate(zip(mass, counts)):
                key = (layer, e)
                if total_m:  # a simulated step has counts but no mass
                    mass_ema[key] = a * mass_ema[key] + b * m / total_m
                tokens[key] = a * tokens[key] + b * n / total_n
                if n:  # adding 0 changes neither total
                    total_tokens[key] += n
                if m:
                    total_mass[key] += m
        self._step = {}

    def __getitem__(self, key: Key) -> float:
        return self.tokens[key] if self.signal == "tokens" else self.mass[key]

    def values(self) -> dict[Key, float]:
        """Every key's importance (the live table: do not write it)."""
        return self.tokens if self.signal == "tokens" else self.mass

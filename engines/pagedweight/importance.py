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

import numpy as np
import torch

from engines.runtime.experts import Dispatch

Key = tuple[int, int]  # (layer, expert)
SIGNALS = ("mass", "tokens")


class Importance:
    """The averages are kept as arrays over every (layer, expert) in key order, so a step's
    fold is a few vector operations (a simulated Mixtral step folds 32 layers x 8 experts);
    each array element follows the same float operations, in the same order, as a per-key
    loop would (tests/unit/test_importance.py checks it against one)."""

    def __init__(self, experts_per_layer: Mapping[int, int], decay: float = 0.9,
                 prior: Mapping[Key, float] | None = None, signal: str = "mass") -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"importance decay must be in [0, 1), got {decay}")
        if signal not in SIGNALS:
            raise ValueError(f"importance signal must be one of {', '.join(SIGNALS)}, got {signal!r}")
        self.decay, self.signal = decay, signal
        self.keys: list[Key] = [(layer, e) for layer, n in experts_per_layer.items() for e in range(n)]
        self._index = {key: i for i, key in enumerate(self.keys)}
        self._layers, sizes = list(experts_per_layer), list(experts_per_layer.values())
        self._size = dict(experts_per_layer)
        offsets = np.cumsum([0, *sizes[:-1]]).tolist()
        self._start = dict(zip(self._layers, offsets))
        self._spans = list(zip(offsets, sizes))  # (first key index, experts) per layer
        self._sizes = np.array(sizes, dtype=np.int64)
        self._offsets = np.array(offsets, dtype=np.int64)
        first = [prior[key] if prior and key in prior else 1.0 / experts_per_layer[key[0]] for key in self.keys]
        self._mass = np.array(first, dtype=np.float64)
        self._tokens = self._mass.copy()
        self._total_tokens = np.zeros(len(self.keys), dtype=np.int64)
        self._total_mass = np.zeros(len(self.keys), dtype=np.float64)
        self._step_mass = np.zeros(len(self.keys), dtype=np.float64)
        self._step_counts = np.zeros(len(self.keys), dtype=np.int64)
        self._observed = False
        self._views: dict[str, dict] = {}

    def observe(self, layer: int, d: Dispatch) -> None:
        """Add one forward's routing (a layer runs once per step; twice adds up)."""
        n = len(d.counts)
        masses = torch.zeros(n, dtype=torch.float64)
        index = torch.repeat_interleave(torch.arange(n), torch.tensor(d.counts))
        masses.index_add_(0, index, d.weights.detach().to("cpu", torch.float64))
        s = self._slice(layer, n)
        self._step_mass[s] += masses.numpy()
        self._step_counts[s] += d.counts
        self._observed = True

    def observe_counts(self, layer: int, counts: list[int]) -> None:
        """Add one simulated forward's routing: token counts only (no routing weights, so the
        layer's mass is not moved by it)."""
        self._step_counts[self._slice(layer, len(counts))] += counts
        self._observed = True

    def observe_matrix(self, layers: list[int], counts: np.ndarray) -> None:
        """`observe_counts` for every layer of a simulated step at once: counts [len(layers), E]."""
        if counts.size == len(self.keys) and layers == self._layers:
            self._step_counts += counts.ravel()
            self._observed = True
        else:
            for layer, row in zip(layers, counts):
                self.observe_counts(layer, row)

    def _slice(self, layer: int, n: int) -> slice:
        if n != self._size.get(layer):
            raise ValueError(f"layer {layer}: {n} experts routed, {self._size.get(layer, 0)} tracked")
        start = self._start[layer]
        return slice(start, start + n)

    def end_step(self) -> None:
        """Fold this step's shares into the averages (layers that ran nothing keep theirs)."""
        if not self._observed:
            return
        a, b = self.decay, 1 - self.decay
        counts, mass = self._step_counts, self._step_mass
        total_n = np.add.reduceat(counts, self._offsets)
        # Each layer's mass summed left to right, as a loop would (numpy's sums may pair terms).
        total_m = np.array([sum(mass[o:o + n].tolist()) for o, n in self._spans]) if mass.any() else \
            np.zeros(len(self._spans))
        ran = np.repeat(total_n > 0, self._sizes)
        tn = np.repeat(np.where(total_n > 0, total_n, 1), self._sizes)
        self._tokens = np.where(ran, a * self._tokens + b * counts / tn, self._tokens)
        weighed = np.repeat((total_n > 0) & (total_m != 0), self._sizes)  # a simulated step has counts but no mass
        tm = np.repeat(np.where(total_m != 0, total_m, 1.0), self._sizes)
        self._mass = np.where(weighed, a * self._mass + b * mass / tm, self._mass)
        self._total_tokens += np.where(ran, counts, 0)
        self._total_mass = np.where(ran & (mass != 0), self._total_mass + mass, self._total_mass)
        counts[:] = 0
        mass[:] = 0.0
        self._observed = False
        self._views = {}

    def _view(self, name: str) -> dict:
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = dict(zip(self.keys, getattr(self, "_" + name).tolist()))
        return view

    @property
    def mass(self) -> dict[Key, float]:
        """Each expert's EMA share of its layer's routing mass (a read-only view)."""
        return self._view("mass")

    @property
    def tokens(self) -> dict[Key, float]:
        """Each expert's EMA share of its layer's token assignments (a read-only view)."""
        return self._view("tokens")

    @property
    def total_tokens(self) -> dict[Key, int]:
        return self._view("total_tokens")

    @property
    def total_mass(self) -> dict[Key, float]:
        return self._view("total_mass")

    def __getitem__(self, key: Key) -> float:
        return float((self._tokens if self.signal == "tokens" else self._mass)[self._index[key]])

    def values(self) -> dict[Key, float]:
        """Every key's importance (a view built once per step: do not write it)."""
        return self.tokens if self.signal == "tokens" else self.mass

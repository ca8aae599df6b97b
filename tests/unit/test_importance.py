"""Importance's vector fold against a per-key loop (the oracle: each expert's EMA and totals as
a loop over keys forms them), over random steps of counts and routing weights, measured
(`observe`) and simulated (`observe_counts`, `observe_matrix`) alike: every float equal."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engines.pagedweight.importance import Importance
from engines.runtime.experts import Dispatch


class LoopImportance:
    def __init__(self, sizes: dict[int, int], decay: float, prior: dict | None = None) -> None:
        self.a, self.b = decay, 1 - decay
        keys = [(layer, e) for layer, n in sizes.items() for e in range(n)]
        self.mass = {k: prior[k] if prior and k in prior else 1.0 / sizes[k[0]] for k in keys}
        self.tokens = dict(self.mass)
        self.total_tokens = dict.fromkeys(keys, 0)
        self.total_mass = dict.fromkeys(keys, 0.0)
        self.step: dict[int, tuple[list[float], list[int]]] = {}

    def add(self, layer: int, masses: list[float], counts: list[int]) -> None:
        m, n = self.step.setdefault(layer, ([0.0] * len(counts), [0] * len(counts)))
        for e in range(len(counts)):
            m[e] += masses[e]
            n[e] += counts[e]

    def end_step(self) -> None:
        for layer, (mass, counts) in self.step.items():
            tm, tn = sum(mass), sum(counts)
            if not tn:
                continue
            for e in range(len(counts)):
                k = (layer, e)
                if tm:
                    self.mass[k] = self.a * self.mass[k] + self.b * mass[e] / tm
                self.tokens[k] = self.a * self.tokens[k] + self.b * counts[e] / tn
                self.total_tokens[k] += counts[e]
                if mass[e]:
                    self.total_mass[k] += mass[e]
        self.step = {}


def _dispatch(rng: random.Random, experts: int, rows: int) -> tuple[Dispatch, list[float]]:
    counts = [rng.choice([0, 0, rng.randint(1, rows)]) for _ in range(experts)]
    weights = torch.tensor([rng.random() for _ in range(sum(counts))], dtype=torch.float32)
    idx = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    masses = torch.zeros(experts, dtype=torch.float64).index_add_(0, idx, weights.to(torch.float64)).tolist()
    return Dispatch(torch.empty(0, dtype=torch.long), weights, counts), masses


def test_vector_fold_equals_the_per_key_loop() -> None:
    for seed in range(6):
        rng = random.Random(seed)
        sizes = {0: 8, 2: 8, 3: 4} if seed % 2 else {1: 6}
        prior = {(next(iter(sizes)), 1): 0.5} if seed % 3 == 0 else None
        imp, ref = Importance(sizes, 0.8, prior=prior), LoopImportance(sizes, 0.8, prior)
        for _ in range(40):
            kind = rng.choice(["measured", "counts", "matrix", "idle"])
            if kind == "matrix" and len(set(sizes.values())) == 1:
                m = np.array([[rng.choice([0, rng.randint(0, 9)]) for _ in range(n)] for n in sizes.values()])
                imp.observe_matrix(list(sizes), m)
                for layer, row in zip(sizes, m.tolist()):
                    ref.add(layer, [0.0] * len(row), row)
            elif kind != "idle":
                for layer, n in sizes.items():
                    if rng.random() < 0.3:
                        continue  # a layer that did not run this step keeps its averages
                    if kind == "measured":
                        d, masses = _dispatch(rng, n, 5)
                        imp.observe(layer, d)
                        ref.add(layer, masses, d.counts)
                    else:
                        counts = [rng.choice([0, rng.randint(0, 9)]) for _ in range(n)]
                        imp.observe_counts(layer, counts)
                        ref.add(layer, [0.0] * n, counts)
            imp.end_step()
            ref.end_step()
            assert imp.mass == ref.mass and imp.tokens == ref.tokens
            assert imp.total_tokens == ref.total_tokens and imp.total_mass == ref.total_mass
            assert imp.values() == ref.mass and all(imp[k] == ref.mass[k] for k in ref.mass)


def test_a_layer_of_another_width_is_refused() -> None:
    with pytest.raises(ValueError, match="3 experts routed, 4 tracked"):
        Importance({0: 4}, 0.9).observe_counts(0, [1, 2, 3])

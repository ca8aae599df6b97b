"""Sampling: filters against hand-computed cases, frequencies against the softmax, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from engines.base import InvalidRequestError, SamplingParams
from engines.runtime.sampling import filter_logits, make_generator, sample

CPU = torch.device("cpu")


def test_top_p_keeps_smallest_prefix_reaching_mass():
    logits = torch.log(torch.tensor([0.15, 0.5, 0.05, 0.3]))
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.8)))
    assert kept.tolist() == [False, True, False, True]  # 0.5 + 0.3 reaches 0.8
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.81)))
    assert kept.tolist() == [True, True, False, True]


def test_top_k():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=0.5, top_k=2)))
    assert kept.tolist() == [False, True, True, False]


def test_greedy_rows_take_argmax():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0]])
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1)]
    assert sample(logits, params, [None, None]).tolist() == [1, 0]


def test_frequencies_follow_tempered_softmax():
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    p = SamplingParams(temperature=2.0, seed=0)
    gen = make_generator(0, CPU)
    draws = torch.tensor([sample(logits, [p], [gen]).item() for _ in range(6000)])
    expected = torch.softmax(logits[0] / 2.0, dim=-1)
    observed = torch.bincount(draws, minlength=4).float() / len(draws)
    # 4.5 standard errors of a binomial proportion at n = 6000
    tol = 4.5 * torch.sqrt(expected * (1 - expected) / len(draws))
    assert torch.all((observed - expected).abs() < tol), (observed, expected)


def test_same_seed_same_tokens():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, top_p=0.9)
    runs = []
    for _ in range(2):
        gen = make_generator(7, CPU)
        runs.append([sample(logits, [p], [gen]).item() for _ in range(20)])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)])
def test_invalid_params(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_entropy_sanity():
    # top_p=1, top_k=0 leaves the distribution untouched
    logits = torch.tensor([0.3, -0.2, 1.1])
    out = filter_logits(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(out, logits) and math.isfinite(out.sum().item())

"""Sampling: filters against hand-computed cases, frequencies against the softmax, seeds."""

from __future__ import annotations

import pytest
import torch

from engines.base import InvalidRequestError, SamplingParams
from engines.runtime.sampling import GREEDY_BLOCK, filter_logits, greedy, make_generator, sample

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


@pytest.mark.parametrize("vocab", [32000, 8 * GREEDY_BLOCK, 1000, 50])
def test_greedy_is_torch_argmax_with_ties_nan_and_inf(vocab):
    # The two-pass CPU choice against torch.argmax itself: ties across and inside blocks go to
    # the first index, a NaN wins (the first NaN), a row of -inf picks 0.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, vocab, generator=g)
    x[1, vocab - 1] = x[1, 3] = x[1].max() + 1  # tie across blocks
    x[2, 5] = x[2, 6] = x[2].max() + 1  # tie inside a block
    x[3, vocab // 2] = float("nan")
    x[3, vocab - 2] = float("nan")
    x[4] = float("-inf")
    x[5, 0] = float("inf")
    x[6] = 0.0  # every position ties
    assert torch.equal(greedy(x), torch.argmax(x, dim=-1))
    assert greedy(x)[1].item() == 3 and greedy(x)[2].item() == 5


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


def test_a_rows_draws_depend_on_its_own_seed_only():
    """A seeded row draws the same tokens alone, next to other seeded and greedy rows, and
    while torch's global generator is used in between; another seed draws other tokens."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, top_p=0.9)

    def draws(seed: int, batched: bool) -> list[int]:
        gen, out = make_generator(seed, CPU), []
        neighbour = make_generator(seed + 100, CPU)
        for _ in range(20):
            if batched:
                torch.rand(3)  # the global generator moves; the row's own must not care
                out.append(sample(logits, [SamplingParams(), p, p], [None, gen, neighbour])[1].item())
            else:
                out.append(sample(logits[1:2], [p], [gen]).item())
        return out

    alone = draws(7, batched=False)
    assert draws(7, batched=True) == alone
    assert draws(8, batched=False) != alone
    assert len(set(alone)) > 1  # top_p = 0.9 of a random row leaves many tokens: it really samples


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)])
def test_invalid_params(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_no_filter_only_scales_by_temperature():
    # top_p=1, top_k=0 keep every token: the logits come back divided by the temperature
    logits = torch.tensor([0.3, -0.2, 1.1])
    assert torch.equal(filter_logits(logits, SamplingParams(temperature=1.0)), logits)
    out = filter_logits(logits, SamplingParams(temperature=0.5))
    assert torch.isfinite(out).all() and torch.allclose(out, torch.tensor([0.6, -0.4, 2.2]))

"""Sampling no request can break (engines/runtime/sampling.py), against hand-computed
distributions: the values that used to kill `pwbench serve`'s engine (temperature and top_p that
round to 0 in float32, NaN/inf logits, seeds past 64 bits) give a valid distribution or a refused
request, and the in-process `moe` engine answers them with its greedy tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
from serving import DEMO

from engines.base import EngineRequest, InvalidRequestError, SamplingParams
from engines.registry import create_engine
from engines.runtime.sampling import MIN_TEMPERATURE, distribution, make_generator, sample
from harness.offline import run_offline

CPU = torch.device("cpu")


def _dist(logits: list[float], **params) -> list[float]:
    x = torch.tensor(logits, dtype=torch.float32)
    fallback = torch.argmax(x)
    return distribution(x, SamplingParams(**params), fallback).tolist()


def test_distribution_equals_the_tempered_softmax_by_hand():
    p = [0.5, 0.3, 0.2]
    got = _dist([math.log(v) for v in p], temperature=1.0)
    assert got == pytest.approx(p, abs=1e-6)
    # T = 2: p_i^(1/2) / sum_j p_j^(1/2)
    root = [math.sqrt(v) for v in p]
    assert _dist([math.log(v) for v in p], temperature=2.0) == pytest.approx([r / sum(root) for r in root], abs=1e-6)


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-38, 0.3])
def test_a_top_p_below_the_top_tokens_mass_keeps_only_that_token(top_p):
    # 1e-300 and 1e-45 round to 0 / a subnormal in float32; the top token (mass 0.5) always stays.
    assert _dist([math.log(0.2), math.log(0.5), math.log(0.3)], temperature=1.0, top_p=top_p) == [0.0, 1.0, 0.0]


def test_logits_near_float32_max_do_not_overflow_at_small_temperatures():
    # Unshifted, 3e38 / 0.5 is inf and the softmax NaN; shifted by the maximum it is one-hot.
    assert _dist([2e38, 3e38, 0.0], temperature=0.5) == [0.0, 1.0, 0.0]
    # 1.0 / 1e-5 = 1e5 apart: exp(-1e5) is 0 in float32
    assert _dist([0.0, 1.0], temperature=MIN_TEMPERATURE) == [0.0, 1.0]


@pytest.mark.parametrize("logits, want", [
    ([0.0, float("nan"), 1.0], 1),  # greedy's choice: a NaN counts as the maximum (torch.argmax)
    ([0.0, float("inf"), 1.0], 1),  # inf - inf = NaN after the shift: the +inf token
    ([float("-inf")] * 3, 0),  # nothing finite at all: token 0, as argmax
])
def test_non_finite_logits_fall_back_to_the_greedy_token(logits, want):
    probs = _dist(logits, temperature=1.0)
    assert probs == [1.0 if i == want else 0.0 for i in range(3)]
    tokens = sample(torch.tensor([logits]), [SamplingParams(temperature=1.0, seed=0)], [make_generator(0, CPU)])
    assert tokens.tolist() == [want]


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-7, MIN_TEMPERATURE / 2])
def test_temperatures_below_the_threshold_are_greedy(temperature):
    logits = torch.tensor([[0.1, 0.3, 0.2], [5.0, -1.0, 4.9]])
    params = [SamplingParams(temperature=temperature, seed=1)] * 2
    assert sample(logits, params, [make_generator(1, CPU)] * 2).tolist() == [1, 0]


def test_seeds_outside_64_bits_are_refused_inside_are_used():
    make_generator(2**64 - 1, CPU)
    make_generator(-(2**63), CPU)
    for seed in (2**64, -(2**63) - 1, 10**30):
        with pytest.raises(InvalidRequestError, match="64 bits"):
            make_generator(seed, CPU)


def test_moe_engine_answers_the_poison_values_with_its_greedy_tokens():
    engine = create_engine("moe", {"model": DEMO})
    engine.start()
    try:
        prompt = (5, 17, 42, 9)
        greedy = run_offline(engine, [EngineRequest("g", prompt, 8)])["g"].output_ids
        for i, params in enumerate([SamplingParams(temperature=1e-300, seed=3), SamplingParams(temperature=1e-45),
                                    SamplingParams(temperature=1.0, top_p=1e-300, seed=2**64 - 1),
                                    SamplingParams(temperature=2.0, top_p=1e-45, seed=0)]):
            done = run_offline(engine, [EngineRequest(f"p{i}", prompt, 8, params)])
            assert done[f"p{i}"].output_ids == greedy, params
        with pytest.raises(InvalidRequestError, match="64 bits"):
            engine.add_request(EngineRequest("s", prompt, 8, SamplingParams(temperature=1.0, seed=2**64)))
        assert run_offline(engine, [EngineRequest("after", prompt, 8)])["after"].output_ids == greedy
    finally:
        engine.stop()

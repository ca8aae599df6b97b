"""Next-token choice: greedy, or seeded temperature / top-k / top-p sampling.

Each sampled request owns a torch.Generator seeded from its SamplingParams, so its tokens
depend on its own seed and logits only, not on which other requests share the batch. No
request's parameters can make a step fail: temperatures below MIN_TEMPERATURE are greedy, the
top token always survives top-p, and a row left without a finite distribution (NaN or inf
logits) takes its greedy token (docs/serving.md#what-is-validated).
"""

from __future__ import annotations

import torch
from torch import Tensor

from engines.base import InvalidRequestError, SamplingParams

# Below this temperature a row is sampled greedily (vLLM's _SAMPLING_EPS): dividing float32
# logits by a smaller one only sharpens an already one-hot softmax, and a temperature that
# rounds to 0 in float32 (1e-300, 1e-46) would divide by zero.
MIN_TEMPERATURE = 1e-5
# torch.Generator.manual_seed's range (a seed outside it raises RuntimeError deep in the engine).
SEED_RANGE = (-(2**63), 2**64 - 1)


def is_greedy(params: SamplingParams) -> bool:
    """Whether a row takes the argmax: temperature 0 (or below MIN_TEMPERATURE) or top_k 1."""
    return params.greedy or params.temperature < MIN_TEMPERATURE


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise InvalidRequestError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] (64 bits), got {seed}")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """One row [V]: temperature-scaled logits with tokens outside top-k / top-p set to -inf."""
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        probs, order = torch.sort(torch.softmax(scaled, dim=-1), descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < top_p.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        # The top token always stays: a top_p that rounds to 0 in float32 (1e-300) drops nothing else.
        drop[0] = False
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return scaled


GREEDY_BLOCK = 128  # vocabulary positions per block of the CPU greedy choice


def greedy(logits: Tensor) -> Tensor:
    """Row-wise argmax of logits [S, V] (first index of the maximum; a NaN counts as the maximum,
    as in torch.argmax). On CPU in two passes: the maximum of each block of GREEDY_BLOCK
    positions (a vectorised reduction), the first block holding the row's maximum, then the
    first maximum inside it: the same index as torch.argmax, whose CPU kernel reads a
    [256, 32000] batch about 4x slower than this."""
    S, V = logits.shape
    if logits.device.type != "cpu" or V % GREEDY_BLOCK or V < 8 * GREEDY_BLOCK:
        return torch.argmax(logits, dim=-1)
    blocks = logits.reshape(S, V // GREEDY_BLOCK, GREEDY_BLOCK)
    best = blocks.amax(dim=-1).argmax(dim=-1)
    return best * GREEDY_BLOCK + blocks[torch.arange(S), best].argmax(dim=-1)


def distribution(logits: Tensor, params: SamplingParams, fallback: Tensor) -> Tensor:
    """One row's sampling distribution [V] float32, always valid for torch.multinomial: the
    logits are shifted so their maximum is 0 before the temperature divides them (nothing
    overflows), and a row whose result is not finite (a NaN or +inf logit) is one-hot at
    `fallback` (its greedy token). No host sync: the check is a tensor `where`."""
    x = logits.float()
    probs = torch.softmax(filter_logits(x - x.max(), params), dim=-1)
    ok = torch.isfinite(probs).all() & (probs.sum() > 0)
    return torch.where(ok, probs, torch.nn.functional.one_hot(fallback, x.shape[-1]).to(probs.dtype))


def sample(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> Tensor:
    """logits [S, V] float32 -> token ids [S] (on the logits' device)."""
    tokens = greedy(logits)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not is_greedy(p):
            probs = distribution(logits[row], p, tokens[row])
            tokens[row] = torch.multinomial(probs, 1, generator=gen)[0]
    return tokens

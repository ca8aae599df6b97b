"""engines/sim/ahead.py: decode rows drawn a window ahead keep the routing source's law, long
prefill chunks are counted from each expert's inclusion probability, and the windows follow
positions (a restart draws a new one).

Oracle: the same source drawing row by row, step by step (`route_layers`, the path the executor
took before), and the source's own inclusion probabilities; statistics over thousands of rows
with bounds several standard errors wide, on fixed seeds."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engines.sim.ahead import AheadRouter
from engines.sim.routing import SyntheticRouting, UniformRouting

E, K, LAYERS = 8, 2, (0, 1, 2, 3)


def _chunk(rid: str, start: int, length: int = 1) -> SimpleNamespace:
    """What the router reads of a scheduler chunk: its request id, first position and rows."""
    return SimpleNamespace(seq=SimpleNamespace(request=SimpleNamespace(request_id=rid)), start=start, length=length)


def _batch(decodes: list[SimpleNamespace], prefills: list[SimpleNamespace] = ()) -> SimpleNamespace:
    return SimpleNamespace(chunks=[*decodes, *prefills], num_decode=len(decodes))


def _source(seed: int) -> SyntheticRouting:
    return SyntheticRouting(num_layers=len(LAYERS), num_experts=E, top_k=K, skew=0.6, locality=0.5, seed=seed)


def _decode_rows(draw, requests: int = 6, steps: int = 300) -> np.ndarray:
    """[steps, requests, layers, k] ids of `requests` decoding together from position 100."""
    return np.stack([draw([_chunk(f"r{i}", 100 + t) for i in range(requests)]) for t in range(steps)])


def _stats(ids: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean share of a row's experts its request's previous row used, and each layer's expert shares."""
    a, b = ids[1:], ids[:-1]
    overlap = (a[..., :, None] == b[..., None, :]).any(-1).mean()
    shares = np.stack([np.bincount(ids[:, :, li].ravel(), minlength=E) for li in range(len(LAYERS))]).astype(float)
    return float(overlap), shares / shares.sum(axis=1, keepdims=True)


def test_decode_rows_drawn_ahead_keep_the_sources_locality_and_popularity():
    ahead = AheadRouter(_source(1), LAYERS, E, K)
    ahead_ids = _decode_rows(ahead._decode, steps=600)
    step_src = _source(1)  # the oracle: the same law (same popularity), drawn one step at a time
    step_ids = _decode_rows(lambda chunks: step_src.route_layers(
        LAYERS, [(c.seq.request.request_id, c.start) for c in chunks], E, K).transpose(1, 0, 2), steps=600)
    ahead_overlap, ahead_shares = _stats(ahead_ids)
    step_overlap, step_shares = _stats(step_ids)
    # 599 x 6 x 4 x 2 slots: the reuse share's standard error is ~0.005; a layer's expert share
    # over 3,600 correlated rows ~0.009 (their difference ~0.013: the bound is ~4 of those)
    assert ahead_overlap == pytest.approx(step_overlap, abs=0.03)
    assert ahead_overlap == pytest.approx(0.5, abs=0.04)
    assert np.abs(ahead_shares - step_shares).max() < 0.05
    assert ahead.stats["decode_rows"] == 600 * 6
    assert ahead.stats["window_calls"] <= 600 / ahead.window + 6  # about a call per window, not one per step


def test_a_window_follows_positions_and_a_restart_draws_a_new_one():
    ahead = AheadRouter(_source(3), LAYERS, E, K)
    w = ahead.window
    for t in range(w + 1):  # one request: its window, read to the end, then the next one
        ahead._decode([_chunk("a", 10 + t)])
    assert ahead.stats["window_calls"] == 2 and ahead.stats["rows_drawn_ahead"] == 2 * w
    assert ahead.stats["rows_drawn_unused"] == 0
    ahead._decode([_chunk("a", 3)])  # a jump back (preempted and recomputed): the rest is dropped
    assert ahead.stats["rows_drawn_unused"] == w - 1
    assert ahead.stats["window_calls"] == 3
    # A prefill chunk of a request drops its buffer too: its next decode draws a fresh window.
    ahead.matrix(_batch([], [_chunk("a", 0, 5)]))
    ahead._decode([_chunk("a", 5)])
    assert ahead.stats["window_calls"] == 4


def test_a_request_needing_a_window_tops_up_the_others_in_the_same_call():
    ahead = AheadRouter(_source(6), LAYERS, E, K)
    w = ahead.window
    for t in range(w // 2 + 1):  # "a" alone: one window, then under half of it is left
        ahead._decode([_chunk("a", t)])
    ahead._decode([_chunk("a", w // 2 + 1), _chunk("b", 50)])  # "b" needs a window: "a" is topped up
    assert ahead.stats["window_calls"] == 2 and ahead.stats["rows_drawn_ahead"] == 3 * w
    for t in range(w // 2 + 2, w + w // 2):  # "a" reads on past its first window without another call
        ahead._decode([_chunk("a", t)])
    assert ahead.stats["window_calls"] == 2


def test_a_long_prefill_chunk_is_counted_from_the_inclusion_probabilities():
    src = _source(4)
    ahead = AheadRouter(src, LAYERS, E, K, tail=64)
    rows = 20_000
    m = ahead.matrix(_batch([], [_chunk("p", 0, rows)]))
    assert m.shape == (len(LAYERS), E)
    assert ahead.stats == {**ahead.stats, "prefill_rows_counted": rows - 1, "prefill_rows_chained": 1}
    pi = np.stack([src.expected_shares(layer, E, K) * K for layer in LAYERS])  # inclusion probabilities
    # Binomial(rows, pi): standard deviation <= sqrt(rows / 4) ~ 71 per expert
    assert np.abs(m - rows * pi).max() < 5 * np.sqrt(rows / 4)
    assert np.abs(m.sum(axis=1) - rows * K).max() < 5 * np.sqrt(rows * K)


def test_uniform_source_bulk_counts_and_windows():
    ahead = AheadRouter(UniformRouting(5), LAYERS, E, K)
    m = ahead.matrix(_batch([_chunk("d", 7)], [_chunk("p", 0, 10_000)]))
    assert np.abs(m - (10_000 * K / E + K / E)).max() < 5 * np.sqrt(10_000 / 4)
    ids = ahead._decode([_chunk("d", 8)])
    assert ids.shape == (1, len(LAYERS), K)
    assert all(len(set(row)) == K for row in ids.reshape(-1, K).tolist())  # distinct experts in a row

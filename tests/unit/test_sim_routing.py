"""engines/sim/routing.py: shapes, determinism, popularity vs the Zipf law, locality, replay, specs."""

from __future__ import annotations

import numpy as np
import pytest

from engines.sim.routing import (
    ReplayRouting,
    RoutingRecorder,
    SyntheticRouting,
    UniformRouting,
    routing_source,
    write_routing_trace,
)


def _distinct(ids: np.ndarray) -> bool:
    s = np.sort(ids, axis=1)
    return not (s[:, 1:] == s[:, :-1]).any()


def _decode(src, layer, n_req, steps, e, k):
    """n_req requests decoding one token per call; returns ids [steps, n_req, k]."""
    return np.stack([src.route(layer, [(f"r{i}", s) for i in range(n_req)], e, k) for s in range(steps)])


@pytest.mark.parametrize("e,k", [(8, 2), (256, 8), (8, 8), (64, 6)])
def test_shape_distinct_and_uniform_shares(e, k):
    src = UniformRouting(seed=3)
    ids = src.route(0, [("a", i) for i in range(4000)], e, k)
    assert ids.shape == (4000, k) and ids.dtype == np.int64
    assert _distinct(ids) and ids.min() >= 0 and ids.max() < e
    shares = np.bincount(ids.ravel(), minlength=e) / ids.size
    # Binomial sd of a share 1/e over 4000*k slots; 5 sd
    sd = np.sqrt((1 / e) * (1 - 1 / e) / ids.size)
    assert np.abs(shares - 1 / e).max() < 5 * sd + 1e-12


def test_determinism_by_seed():
    keys = [(f"r{i}", 0) for i in range(64)]
    for make in (lambda s: UniformRouting(s), lambda s: SyntheticRouting(skew=1.0, locality=0.4, seed=s)):
        a, b, c = make(7), make(7), make(8)
        ra = [a.route(layer, keys, 64, 4) for layer in range(3)]
        rb = [b.route(layer, keys, 64, 4) for layer in range(3)]
        rc = [c.route(layer, keys, 64, 4) for layer in range(3)]
        assert all((x == y).all() for x, y in zip(ra, rb, strict=True))
        assert any((x != y).any() for x, y in zip(ra, rc, strict=True))


@pytest.mark.parametrize("e,k,skew", [(8, 2, 1.0), (64, 4, 0.8)])
def test_synthetic_popularity_matches_zipf(e, k, skew):
    src = SyntheticRouting(skew=skew, locality=None, seed=1)
    layer = 5
    ids = src.route(layer, [("x", i) for i in range(100_000 // k)], e, k)
    assert _distinct(ids)
    counts = np.bincount(ids.ravel(), minlength=e)
    # Hand-computed law: shares by rank r proportional to r^-skew, in a per-layer order of experts.
    ranks = np.arange(1, e + 1, dtype=float)
    law = ranks**-skew / (ranks**-skew).sum()
    assert k * law.max() <= 1  # no capping in these cases
    got = np.sort(counts / counts.sum())[::-1]
    # Each expert's share within 4 binomial sd of the law (slots are not independent within a row,
    # systematic sampling makes them less variable, so this is conservative).
    sd = np.sqrt(law * (1 - law) / counts.sum())
    assert (np.abs(got - law) < 4 * sd + 1e-4).all(), (got, law)
    # and it is the per-layer permutation the source says
    stated = src.expected_shares(layer, e, k)  # the law in the source's per-layer order of experts
    assert np.allclose(np.sort(stated)[::-1], law, atol=1e-12)
    per_sd = np.sqrt(stated * (1 - stated) / counts.sum())
    assert (np.abs(counts / counts.sum() - stated) < 4 * per_sd + 1e-4).all()
    # a different layer has a different popular expert order
    other = src.expected_shares(layer + 1, e, k)
    assert not np.allclose(other, src.expected_shares(layer, e, k))


def test_given_popularity_vector():
    pop = np.array([5.0, 1, 1, 1, 0, 2, 0, 0])
    src = SyntheticRouting(popularity=pop, locality=None, seed=2)
    ids = src.route(0, [("x", i) for i in range(50_000)], 8, 2)
    shares = np.bincount(ids.ravel(), minlength=8) / ids.size
    assert np.allclose(shares, pop / pop.sum(), atol=0.01)
    assert shares[4] == shares[6] == shares[7] == 0


@pytest.mark.parametrize("e,k,q", [(8, 2, 0.3), (256, 8, 0.5), (64, 4, 0.0), (32, 4, 0.9)])
def test_locality_reuse_rate(e, k, q):
    src = SyntheticRouting(skew=0.6, locality=q, seed=4)
    ids = _decode(src, 1, n_req=50, steps=200, e=e, k=k)
    assert all(_distinct(ids[s]) for s in range(len(ids)))
    # overlap |A_t ∩ A_{t-1}| / k counted independently of the source's own counters
    a, b = ids[1:], ids[:-1]
    overlap = (a[:, :, :, None] == b[:, :, None, :]).any(axis=3).sum(axis=2) / k
    measured = overlap.mean()
    sd = np.sqrt(q * (1 - q) / (k * overlap.size))
    assert abs(measured - q) < 5 * sd + 1e-3, (measured, q)
    assert abs(src.describe()["measured_reuse"] - measured) < 1e-9


def test_locality_within_a_prefill_chunk_and_resets():
    src = SyntheticRouting(skew=0.0, locality=0.7, seed=5)
    ids = src.route(0, [("p", i) for i in range(4000)], 16, 4)  # one request, consecutive positions
    overlap = (ids[1:, :, None] == ids[:-1, None, :]).any(axis=2).sum(axis=1) / 4
    assert abs(overlap.mean() - 0.7) < 0.03
    src.route(0, [("p", 10_000)], 16, 4)  # a jump: no previous token
    assert src.describe()["locality_resets"] == 1


def test_state_is_bounded():
    src = SyntheticRouting(skew=0.0, locality=0.5, seed=6, stale_calls=8, prune_every=4)
    for s in range(100):  # a new batch of requests every call, each seen once
        src.route(0, [(f"s{s}-{i}", 0) for i in range(10)], 16, 2)
    d = src.describe()
    assert d["live_states"] <= 10 * (8 + 4 + 1)
    assert d["states_dropped"] > 0


def test_family_defaults_describe():
    mix = SyntheticRouting(num_layers=32, model_type="mixtral", seed=0)
    mix.route(0, [("a", 0)], 8, 2)
    mix.route(31, [("a", 0)], 8, 2)
    d = mix.describe()
    assert "2401.04088" in d["sources"]["locality"]
    # Table 5 'first or second choice' ~46% at layer 0 -> q = 1 - sqrt(0.54)
    assert abs(d["locality_per_layer"][0] - (1 - 0.54**0.5)) < 1e-3
    ds = SyntheticRouting(model_type="deepseek_v3", seed=0)
    assert ds.describe()["note"] == "no published measurement; uniform-ish default"


def test_replay_round_trip(tmp_path):
    gen = SyntheticRouting(skew=1.0, locality=0.3, seed=9)
    rec = RoutingRecorder()
    truth = {}
    for s in range(5):
        keys = [(f"q{i}", s) for i in range(20)]
        for layer in range(3):
            ids = gen.route(layer, keys, 32, 4)
            rec.add(layer, keys, ids)
            for key, row in zip(keys, ids, strict=True):
                truth[(layer, *key)] = row
    path = rec.write(tmp_path / "trace.parquet")
    rep = ReplayRouting(path, seed=1)
    keys = [(f"q{i}", 2) for i in range(20)] + [("unknown", 0), ("q1", 99)]
    out = rep.route(1, keys, 32, 4)
    for key, row in zip(keys[:20], out[:20], strict=True):
        assert (row == truth[(1, *key)]).all()
    assert _distinct(out[20:]) and out.shape == (22, 4)
    d = rep.describe()
    assert (d["replay_hits"], d["replay_misses"]) == (20, 2)
    assert d["fallback"]["kind"] == "uniform"
    # write_routing_trace writes the same format
    p2 = write_routing_trace(tmp_path / "t2.parquet", [("a", 0, 0, [3, 1]), ("a", 1, 0, [2, 0])])
    assert (ReplayRouting(p2).route(0, [("a", 1), ("a", 0)], 4, 2) == [[2, 0], [3, 1]]).all()
    with pytest.raises(ValueError, match="top_k"):
        ReplayRouting(p2).route(0, [("a", 1)], 4, 3)


def test_recorder_step_rows_match_per_layer_rows(tmp_path):
    """`add_step` (the engine's one host copy per step) writes the rows `add` writes once per layer."""
    import pyarrow.parquet as pq

    gen = SyntheticRouting(skew=1.0, locality=0.3, seed=3)
    per_layer, per_step = RoutingRecorder(), RoutingRecorder()
    for s in range(4):
        keys = [(f"q{i}", s) for i in range(5 + s)]
        layers = [1, 2, 4]
        ids = np.stack([gen.route(layer, keys, 16, 2) for layer in layers])
        for layer, layer_ids in zip(layers, ids, strict=True):
            per_layer.add(layer, keys, layer_ids)
        per_step.add_step(layers, keys, ids)
    assert per_step.rows == per_layer.rows == 3 * (5 + 6 + 7 + 8)
    a = pq.read_table(per_layer.write(tmp_path / "a.parquet"))
    b = pq.read_table(per_step.write(tmp_path / "b.parquet"))
    assert a.equals(b)
    with pytest.raises(ValueError, match="len\\(layers\\)"):
        per_step.add_step([0], keys, ids)


def test_specs_and_errors(tmp_path):
    assert isinstance(routing_source("uniform", None, 8, 0), UniformRouting)
    s = routing_source("synthetic:skew=1.2,locality=0.3", "mixtral", 8, 0, top_k=2)
    assert isinstance(s, SyntheticRouting) and s.skew == 1.2 and s.locality_at(0) == 0.3
    assert s.describe()["sources"] == {"skew": "given", "locality": "given"}
    assert isinstance(routing_source("synthetic", "mixtral", 8, 0), SyntheticRouting)
    for bad in ("", "zipf", "synthetic:skew=abc", "synthetic:foo=1", "synthetic:locality=2", "replay:", "uniform:3"):
        with pytest.raises(ValueError) as ei:
            routing_source(bad, None, 8, 0)
        msg = str(ei.value)
        assert "\n" not in msg and "valid:" in msg and repr(bad) in msg
    missing = tmp_path / "nope.parquet"
    with pytest.raises(ValueError) as ei:
        routing_source(f"replay:{missing}", None, 8, 0)
    assert str(missing) in str(ei.value) and "\n" not in str(ei.value)
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(ValueError) as ei:
        routing_source(f"replay:{junk}", None, 8, 0)
    assert str(junk) in str(ei.value) and "\n" not in str(ei.value)


# ---- the vectorised locality path: oracles computed from the returned ids ------------------------


def _overlap_oracle(calls, k):
    """calls: [(keys, ids)] of one layer in call order. Per key with (request, position - 1) routed
    before it (earlier call or earlier row of the same call): the overlap with that row, counted here."""
    seen = {}
    overlaps = []
    for keys, ids in calls:
        rows = dict(zip(keys, ids.tolist(), strict=True))
        for key in sorted(rows, key=lambda kp: (kp[0], kp[1])):
            r, p = key
            prev = rows.get((r, p - 1), seen.get((r, p - 1)))
            if prev is not None:
                overlaps.append(len(set(prev) & set(rows[key])))
        seen.update(rows)
    return np.array(overlaps)


def test_alias_table_is_exact():
    from engines.sim.routing import _alias_table

    for shares in (np.array([5.0, 1, 1, 1, 0, 2, 0, 0]), np.full(8, 1.0), 1 / np.arange(1, 257.0)):
        prob, alias = _alias_table(shares)
        e = len(shares)
        # P(id) = (prob[id] + sum of (1 - prob[j]) over columns j that alias to id) / e, by hand
        p = prob.copy()
        np.add.at(p, alias, 1.0 - prob)
        assert np.allclose(p / e, shares / shares.sum(), atol=1e-12)


@pytest.mark.parametrize("e,k,q", [(8, 2, 0.3), (64, 8, 0.6), (8, 6, 0.5), (4, 4, 0.5)])
def test_chunked_prefill_mixed_with_decode_in_any_row_order(e, k, q):
    """Two requests prefill in chunks while others decode; each call's rows come in a shuffled order."""
    src = SyntheticRouting(skew=0.8, locality=q, seed=11)
    rng = np.random.default_rng(0)
    calls = []
    for c in range(30):
        keys = [(f"p{j}", 64 * c + i) for j in range(2) for i in range(64)] + [(f"d{i}", c) for i in range(20)]
        keys = [keys[i] for i in rng.permutation(len(keys))]
        ids = src.route(3, keys, e, k)
        assert ids.shape == (len(keys), k) and _distinct(ids) and ids.min() >= 0 and ids.max() < e
        calls.append((keys, ids))
    ov = _overlap_oracle(calls, k)
    d = src.describe()
    # the counters match the overlap counted from the ids: fresh experts never repeat the previous token's
    assert d["rows_with_previous"] == len(ov) == 30 * 148 - 22
    assert d["reused_slots"] == ov.sum()
    if e >= 2 * k:  # otherwise surplus fresh slots copy (at most e - k ids lie outside the previous set)
        sd = np.sqrt(q * (1 - q) / (k * len(ov)))
        assert abs(ov.mean() / k - q) < 5 * sd + 1e-3
    else:
        assert ov.min() >= 2 * k - e


def test_same_list_across_layers_and_changed_in_place():
    """The step cache: a list reused for every layer and then changed in place routes exactly like
    fresh lists with the same rows."""
    a = SyntheticRouting(skew=1.0, locality=0.5, seed=3)
    b = SyntheticRouting(skew=1.0, locality=0.5, seed=3)
    keys = [(f"r{i}", 5) for i in range(16)] + [("long", p) for p in range(40)]
    for step in range(6):
        for layer in range(4):
            x = a.route(layer, keys, 32, 4)
            y = b.route(layer, [tuple(kp) for kp in list(keys)], 32, 4)
            assert (x == y).all()
        for i in range(len(keys)):  # the next step, written into the same list object
            keys[i] = (keys[i][0], keys[i][1] + (1 if i < 16 else 40))
        if step == 3:
            keys[0] = ("new", 0)
    assert a.describe()["reused_slots"] == b.describe()["reused_slots"] > 0


def test_freed_state_is_not_inherited():
    """Requests whose state was dropped free their slots; new requests reusing those slots start fresh."""
    src = SyntheticRouting(skew=0.0, locality=0.9, seed=2, stale_calls=2, prune_every=1)
    for s in range(3):
        src.route(0, [(f"old{i}", s) for i in range(8)], 16, 2)
    for s in range(6):  # old requests go unseen: dropped after 2 calls
        src.route(0, [("other", s)], 16, 2)
    d = src.describe()
    assert d["states_dropped"] >= 8 and d["tracked_requests"] == 1 and d["live_states"] == 1
    before = d["rows_with_previous"]
    src.route(0, [(f"new{i}", 3) for i in range(8)], 16, 2)  # position 3 = old requests' last + 1
    assert src.describe()["rows_with_previous"] == before


@pytest.mark.parametrize("prefill", [False, True])
def test_locality_keeps_uniform_shares(prefill):
    e, k, q = 16, 4, 0.5
    src = SyntheticRouting(skew=0.0, locality=q, seed=8)
    if prefill:
        ids = np.concatenate([src.route(0, [(f"c{j}", 256 * s + p) for j in range(4) for p in range(256)], e, k)
                              for s in range(8)])
    else:
        ids = _decode(src, 0, n_req=64, steps=128, e=e, k=k).reshape(-1, k)
    shares = np.bincount(ids.ravel(), minlength=e) / ids.size
    # binomial sd of a share 1/e, widened for the correlation copies bring ((1 + q) / (1 - q) = 3)
    sd = np.sqrt((1 / e) * (1 - 1 / e) / ids.size * 3)
    assert np.abs(shares - 1 / e).max() < 5 * sd


def test_route_layers_per_layer_locality_and_state():
    """route_layers routes several layers in one call: per layer, rows distinct, the reuse each layer's
    locality asks (a depth profile: 0.1 at the first layer, 0.8 at the last), counters equal to the
    overlap counted from the ids, and the state shared with `route` (a later single-layer call continues)."""
    e, k, n_layers, n_req, steps = 16, 2, 4, 40, 150
    src = SyntheticRouting(num_layers=n_layers, skew=0.5, locality=[(0.0, 0.1), (1.0, 0.8)], seed=9)
    layers = list(range(n_layers))
    out = []
    for s in range(steps):
        # one request prefills a 24-token chunk at each step beside the decoding ones
        keys = [(f"r{i}", s) for i in range(n_req)] + [("p", 24 * s + p) for p in range(24)]
        ids = src.route_layers(layers, keys, e, k)
        assert ids.shape == (n_layers, len(keys), k)
        assert all(_distinct(ids[layer]) for layer in layers) and ids.min() >= 0 and ids.max() < e
        out.append(ids)
    ids = np.stack(out)  # [steps, layers, rows, k]
    dec = ids[:, :, :n_req]  # decode rows: previous token = the same request's row one step before
    ov_dec = (dec[1:, :, :, :, None] == dec[:-1, :, :, None, :]).any(axis=4).sum(axis=3)  # [steps-1, L, n_req]
    pre = ids[:, :, n_req:].transpose(1, 0, 2, 3).reshape(n_layers, -1, k)  # the prefill chain, in position order
    ov_pre = (pre[:, 1:, :, None] == pre[:, :-1, None, :]).any(axis=3).sum(axis=2)  # [L, positions-1]
    for layer in layers:
        q = 0.1 + 0.7 * layer / (n_layers - 1)
        ov = np.concatenate((ov_dec[:, layer].ravel(), ov_pre[layer]))
        sd = np.sqrt(q * (1 - q) / (k * ov.size))
        assert abs(ov.mean() / k - q) < 5 * sd + 1e-3, (layer, ov.mean() / k, q)
    d = src.describe()
    n_prev = n_layers * ((steps - 1) * n_req + (steps * 24 - 1))
    assert d["rows_with_previous"] == n_prev
    assert d["reused_slots"] == ov_dec.sum() + ov_pre.sum()
    assert d["calls"] == steps * n_layers
    # the next step routed one layer at a time continues the same per-layer state
    before = d["rows_with_previous"]
    for layer in layers:
        src.route(layer, [(f"r{i}", steps) for i in range(n_req)], e, k)
    assert src.describe()["rows_with_previous"] == before + n_layers * n_req


def test_uniform_route_layers_shape_and_shares():
    src = UniformRouting(seed=1)
    ids = src.route_layers([0, 1, 2], [("a", i) for i in range(3000)], 8, 2)
    assert ids.shape == (3, 3000, 2) and all(_distinct(ids[layer]) for layer in range(3))
    shares = np.bincount(ids.ravel(), minlength=8) / ids.size
    assert np.abs(shares - 1 / 8).max() < 5 * np.sqrt(1 / 8 * 7 / 8 / ids.size)
    assert src.describe()["calls"] == 3 and src.describe()["rows"] == 9000

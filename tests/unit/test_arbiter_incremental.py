"""The arbiter's and the controller's per-step caches against from-scratch oracles: the arbiter
(shape-token cache, index lookups, early-stopping scans) decides exactly as the slow reference
(tests/arbiter_reference.py, the code before the caches) over random multi-step runs with
drifting costs, commits, aborts, raised floors and changed option shapes; `replan_every` runs
the fresh greedy only on its steps while forced demotions still fit every step; the
controller's kept option rows equal a rebuild after random importance updates and pins."""

from __future__ import annotations

import random
from types import SimpleNamespace

import arbiter_reference as ref
import pytest
import torch

from engines.pagedweight import arbiter as fast
from engines.pagedweight.arbiter import Arbiter, Choice
from engines.pagedweight.backend import FeedbackSample, PagedWeightBackend
from engines.pagedweight.controller import MISS_COST, PageBudget, PagedController, PagedExperts
from engines.pagedweight.formats import make_store
from engines.pagedweight.importance import Importance
from engines.runtime.copies import CopyEngine
from engines.runtime.transfer import TransferLedger

BITS = (16, 8, 4, 3, 2)


def _nbytes(elems: int, bits: int) -> int:
    return 0 if bits == 0 else elems * bits // 8 + (0 if bits == 16 else elems // 64 * 4)


def _sens(rng: random.Random) -> dict[int, float]:
    out, acc = {16: 0.0}, 0.0
    for b in BITS[1:]:
        acc += rng.random() ** rng.choice([1, 3])
        out[b] = acc
    return out


def _decision(d) -> tuple:
    def moves(ms):
        return [(m.key, m.from_bits, m.to_bits, m.bytes_moved, m.forced) for m in ms]
    return d.step, d.target, moves(d.moves), moves(d.cancelled), d.nbytes, d.cost, d.fits


def _run(seed: int, steps: int = 30) -> int:
    """One random run through both arbiters; returns how many steps had moves (so the test
    knows it exercised something)."""
    rng = random.Random(seed)
    n = rng.choice([5, 14, 30, 60])
    keys = [(i // 8, i % 8) for i in range(n)]
    elems = {k: rng.choice([1024, 2048, 4096]) for k in keys}
    sens = {k: _sens(rng) for k in keys}
    imp = {k: rng.random() + 0.01 for k in keys}
    low = {k: rng.choice([2, 2, 3, 4]) for k in keys}  # the widths offered start here (quality)
    leave = {k: rng.random() < 0.3 for k in keys}  # may leave the device (bits 0)
    shuffled = rng.random() < 0.2  # options not in increasing bytes: nothing may be cached

    factored = rng.random() < 0.5  # costs per unit of importance, weighed by `weights` (the controller's way)

    def options() -> tuple[dict, dict]:
        """(the reference's options, the fast arbiter's: the same, or factored)."""
        whole, per_unit = {}, {}
        for k in keys:
            opts = [Choice(0, 0, 20.0)] if leave[k] else []
            opts += [Choice(b, _nbytes(elems[k], b), sens[k][b]) for b in sorted(BITS) if b >= low[k]]
            if shuffled:
                rng.shuffle(opts)
            per_unit[k] = opts
            whole[k] = [Choice(o.bits, o.nbytes, imp[k] * o.cost) for o in opts]
        return whole, per_unit if factored else whole

    lo = sum(min(_nbytes(elems[k], b) for b in ((0,) if leave[k] else (low[k],))) for k in keys)
    hi = sum(_nbytes(elems[k], 16) for k in keys)
    floors = {k: 0 if leave[k] else low[k] for k in keys}
    initial = {k: rng.choice([b for b in BITS if b >= low[k]]) for k in keys}
    kw = dict(hysteresis=rng.choice([0.0, 0.02, 0.1]), min_residence_steps=rng.choice([0, 2, 5]),
              transition_bytes_per_step=rng.choice([None, hi // 20, 0]),
              transfer=rng.choice(["bitplane", "requantize"]), floors=floors, initial=initial)
    a, b = Arbiter(**kw), ref.Arbiter(**kw)
    shape, busy = 0, 0
    cap = int(rng.uniform(lo, hi))
    for step in range(steps):
        for k in keys:
            imp[k] *= rng.uniform(0.7, 1.4)
        cap = max(0, min(int(hi * 1.1), cap + int(rng.uniform(-0.15, 0.15) * (hi - lo))))
        if rng.random() < 0.1:  # a key's widths change (its quality floor rose): a new shape
            k = rng.choice(keys)
            if low[k] < 4 and all(m.key != k for m in a.inflight) and a.bits.get(k, 0) >= 4:
                low[k] = 4
                shape += 1
        opts, mine = options()
        weights = dict(imp) if factored else None
        try:
            db = b.plan(step, cap, opts)
        except (KeyError, ValueError) as exc:  # a state the reference refuses (e.g. a move from a width now
            with pytest.raises(type(exc)):  # under a raised floor): the fast one must refuse it too
                a.plan(step, cap, mine, shape=shape, weights=weights)
            return busy
        da = a.plan(step, cap, mine, shape=shape, weights=weights)
        assert _decision(da) == _decision(db), f"seed {seed} step {step}"
        busy += bool(da.moves)
        done = [i for i in range(len(da.moves)) if rng.random() < 0.8]
        gone = [i for i in range(len(da.moves)) if i not in done and rng.random() < 0.5]
        a.commit([da.moves[i] for i in done])
        b.commit([db.moves[i] for i in done])
        a.abort([da.moves[i] for i in gone])
        b.abort([db.moves[i] for i in gone])
        if rng.random() < 0.1:  # the quality feedback pins a key one width up
            k = rng.choice(keys)
            up = [w for w in BITS if w > max(a.floors.get(k, 0), low[k])]
            if up:
                w = min(up)
                assert a.raise_floor(k, w, step) == b.raise_floor(k, w, step)
        assert (a.bits, a.changed_at, a.target) == (b.bits, b.changed_at, b._target)
        assert [(m.key, m.to_bits) for m in a.inflight] == [(m.key, m.to_bits) for m in b.inflight]
    return busy


@pytest.mark.parametrize("seed", range(40))
def test_arbiter_decides_as_the_reference(seed):
    _run(seed)  # half the runs give the fast arbiter factored costs (weights x per-unit costs)


def test_the_random_runs_move_experts():
    assert sum(_run(seed, 10) > 0 for seed in range(10)) >= 8


def test_greedy_scans_match_the_reference_on_single_solves():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(2, 40)
        opts = {}
        for i in range(n):
            e, imp, s = rng.choice([512, 1024, 4096]), rng.random(), _sens(rng)
            opts[(0, i)] = [Choice(b, _nbytes(e, b), imp * s[b]) for b in sorted(BITS)]
            if rng.random() < 0.3:
                opts[(0, i)].insert(0, Choice(0, 0, imp * 15.0))
        lo = sum(o[0].nbytes for o in opts.values())
        hi = sum(o[-1].nbytes for o in opts.values())
        cap = int(rng.uniform(0.9 * lo, hi))
        got, want = fast.solve_greedy(opts, cap), ref.solve_greedy(opts, cap)
        assert (got.bits, got.nbytes, got.cost, got.fits) == (want.bits, want.nbytes, want.cost, want.fits)
        weights = {k: rng.random() + 0.01 for k in opts}
        whole = {k: [Choice(o.bits, o.nbytes, weights[k] * o.cost) for o in v] for k, v in opts.items()}
        got, want = fast.solve_greedy(opts, cap, weights=weights), ref.solve_greedy(whole, cap)
        assert (got.bits, got.nbytes, got.cost, got.fits) == (want.bits, want.nbytes, want.cost, want.fits)


def test_replan_every_runs_the_greedy_only_on_its_steps(monkeypatch):
    calls = []
    real = fast._greedy_pick
    monkeypatch.setattr(fast, "_greedy_pick", lambda *a, **k: calls.append(1) or real(*a, **k))
    keys = [(0, e) for e in range(20)]
    opts = {k: [Choice(b, _nbytes(2048, b), (1 + e) * _sens(random.Random(e))[b]) for b in sorted(BITS)]
            for e, k in enumerate(keys)}
    hi = sum(o[-1].nbytes for o in opts.values())
    arb = Arbiter(hysteresis=0.0, replan_every=4, initial=dict.fromkeys(keys, 8))
    replanned = []
    for step in range(14):
        cap = hi * 3 // 4 if step < 6 else hi // 2  # the capacity changes at step 6
        if step == 7:  # a pin moves a key up outside any plan: the bits stop fitting, capacity unchanged
            key = next(k for k in keys if arb.bits[k] < 16 and all(m.key != k for m in arb.inflight))
            assert arb.raise_floor(key, 16, step)
        before = len(calls)
        d = arb.plan(step, cap, opts)
        replanned += [step] * (len(calls) - before)
        assert d.fits and d.nbytes <= cap  # forced demotions run on every step
        assert any(m.forced for m in d.moves) == (step in (6, 7))  # 7: not a re-plan step
        arb.commit(d.moves)
    # Every 4 steps from the latest re-plan, and when the capacity changes (6).
    assert replanned == [0, 4, 6, 10]
    with pytest.raises(ValueError, match="replan_every"):
        Arbiter(replan_every=0)


def _controller(seed: int) -> PagedController:
    torch.manual_seed(seed)
    cpu = torch.device("cpu")
    widths = (16, 8, 4, 3, 2)
    stores = {(i, e): make_store("bitplanes", torch.randn(64, 32), torch.randn(32, 32), widths)
              for i in range(2) for e in range(4)}
    rng = random.Random(seed)
    sensitivity = {k: {b: 0.0 if b == 16 else rng.random() / b for b in widths} for k in stores}
    quality = {k: rng.choice([2, 3, 4]) for k in stores}
    floors = {k: rng.choice([0, quality[k]]) for k in stores}
    importance = Importance({0: 4, 1: 4}, 0.8, signal="tokens")
    backend = PagedWeightBackend(stores, CopyEngine(TransferLedger(cpu), cpu), cpu, importance)
    paged = PagedExperts(backend, widths, sensitivity, importance, quality, floors)
    cfg = SimpleNamespace(feedback_weight=0.5, feedback_threshold=0.05)
    ctrl = PagedController(cfg, paged, PageBudget(10**9, 0, 1, kv_on_device=False))
    ctrl.arbiter, ctrl.scheduler = Arbiter(floors=floors), None
    return ctrl


def _rebuilt(ctrl: PagedController) -> dict:
    """options() from scratch, as it was before the kept rows."""
    p, out = ctrl.paged, {}
    for key, store in ctrl.backend.stores.items():
        imp, sens = p.importance[key], p.sensitivity[key]
        widths = sorted((store.nbytes(b), b, b in store.exact_bits) for b in p.bit_widths if b >= p.quality[key])
        opts = [Choice(0, 0, imp * MISS_COST)] if p.floors[key] == 0 else []
        out[key] = opts + [Choice(b, n, imp * (0.0 if x else sens[b])) for n, b, x in widths]
    return out


@pytest.mark.parametrize("seed", range(5))
def test_kept_option_rows_equal_a_rebuild(seed):
    ctrl = _controller(seed)
    rng = random.Random(seed)
    keys = list(ctrl.backend.stores)
    last_shape = last_version = None
    for step in range(60):
        ctrl.engine_step = step
        for layer in (0, 1):
            if rng.random() < 0.8:
                ctrl.paged.importance.observe_counts(layer, [rng.randint(0, 5) for _ in range(4)])
        ctrl.paged.importance.end_step()
        if rng.random() < 0.3:  # measured errors: sensitivities move, a layer over the threshold pins
            layer = rng.choice((0, 1))
            sample = FeedbackSample()
            for k in rng.sample([k for k in keys if k[0] == layer], 2):
                sample.expert_error[k] = (rng.choice((8, 4, 3, 2)), rng.random() * 0.2)
            sample.layer_error[layer] = rng.random() * 0.1
            ctrl._apply_feedback(sample)
        got = ctrl.options()
        w = ctrl.paged.importance.values()
        assert list(got) == list(ctrl.backend.stores)  # the stores' order, whatever went stale
        assert {k: [Choice(o.bits, o.nbytes, w[k] * o.cost) for o in v] for k, v in got.items()} == _rebuilt(ctrl)
        shape = {k: [(o.bits, o.nbytes) for o in v] for k, v in got.items()}
        if last_shape is not None and shape != last_shape:
            assert ctrl.shape_version != last_version  # the arbiter's cache token moved with the shape
        last_shape, last_version = shape, ctrl.shape_version

"""The dummy engine's latency model and token stream, checked against hand-computed values."""

from __future__ import annotations

import time

import pytest

from engines.base import EngineRequest, InvalidRequestError
from engines.dummy import DummyConfig, DummyEngine


def drain(engine):
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step())
    return steps


def test_tokens_and_counts():
    engine = DummyEngine(DummyConfig(max_num_seqs=2, vocab_size=100))
    engine.start()
    for i, n in enumerate([3, 1, 2]):
        engine.add_request(EngineRequest(f"r{i}", (i + 1, 5), n))
    steps = drain(engine)
    # step 1: r0, r1 admitted (prefill 4 tokens), r1 done; step 2: r2 admitted, r0 decodes; ...
    assert [s.num_prefill_tokens for s in steps] == [4, 2, 0]
    assert [s.num_decode_tokens for s in steps] == [0, 1, 2]
    tokens = {}
    for s in steps:
        for o in s.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    # token k of a request = (sum(prompt) * 31 + 7k + 3) % vocab, skipping EOS (2)
    assert tokens["r0"] == [(6 * 31 + 7 * k + 3) % 100 for k in range(3)]
    assert len(tokens["r1"]) == 1 and len(tokens["r2"]) == 2


def test_latency_model_sleeps_at_least_the_modelled_time():
    engine = DummyEngine(DummyConfig(base_ms=5, prefill_ms_per_token=1, decode_ms_per_token=2))
    engine.start()
    engine.add_request(EngineRequest("a", tuple(range(10, 30)), 2))
    t0 = time.perf_counter()
    engine.step()  # 5 + 20 * 1 ms
    t1 = time.perf_counter()
    engine.step()  # 5 + 1 * 2 ms
    t2 = time.perf_counter()
    assert t1 - t0 >= 0.025 and t2 - t1 >= 0.007


def test_abort_reports_once():
    engine = DummyEngine(DummyConfig())
    engine.start()
    engine.add_request(EngineRequest("a", (1,), 10))
    engine.add_request(EngineRequest("b", (1,), 10))
    engine.step()
    engine.abort("a")
    engine.abort("zzz")  # unknown ids are ignored
    out = engine.step()
    assert [(o.request_id, o.finish_reason) for o in out.outputs if o.finished] == [("a", "abort")]
    assert all(o.request_id != "a" for s in drain(engine) for o in s.outputs)


def test_rejects_out_of_vocab():
    engine = DummyEngine(DummyConfig(vocab_size=10))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request(EngineRequest("a", (10,), 1))

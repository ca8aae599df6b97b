"""Engine protocol behaviour of the torch engines: abort, limits, info, static vs continuous batching."""

from __future__ import annotations

from functools import partial

import pytest
from tiny_models import CPU32

from engines.base import EngineRequest, InvalidRequestError
from engines.full import FullConfig, FullEngine
from engines.hf import HFEngine, HFEngineConfig
from engines.moe import MoEEngine, MoEEngineConfig
from engines.moegen.engine import MoEGenConfig, MoEGenEngine
from engines.runtime.engine import RuntimeEngine


def collect(engine, steps=None):
    tokens, finished, n = {}, {}, 0
    while engine.has_unfinished() and (steps is None or n < steps):
        for o in engine.step().outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finished[o.request_id] = o.finish_reason
        n += 1
    return tokens, finished


# moegen: KV in the host tier, every expert streamed through one slot (its most moving parts).
MOEGEN = partial(MoEGenConfig, budget_bytes=64 << 20, host_kv_gb=0.01, kv_placement="host", expert_slots=1,
                 resident_experts=0)


# full: paged experts under layer-major steps, the KV in the host tier.
FULL = partial(FullConfig, budget_bytes=64 << 20, host_kv_gb=0.01, kv_placement="host")


@pytest.mark.parametrize("engine_cls, cfg_cls", [(MoEEngine, MoEEngineConfig), (HFEngine, HFEngineConfig),
                                                 (MoEGenEngine, MOEGEN), (FullEngine, FULL)])
def test_abort_mid_decode(engine_cls, cfg_cls, checkpoints):
    folder = str(checkpoints("mixtral"))
    ref = engine_cls(cfg_cls(model=folder))
    with ref:
        ref.add_request(EngineRequest("keep", (5, 6, 7), 12, ignore_eos=True))
        expected, _ = collect(ref)
    engine = engine_cls(cfg_cls(model=folder))
    with engine:
        engine.add_request(EngineRequest("keep", (5, 6, 7), 12, ignore_eos=True))
        engine.add_request(EngineRequest("drop", (9, 9, 9, 9), 12, ignore_eos=True))
        first, _ = collect(engine, steps=3)
        engine.abort("drop")
        rest, finished = collect(engine)
        assert finished == {"drop": "abort", "keep": "length"}
        assert len(first["drop"]) == 3  # one token per step: the prefill's, then two decodes
        assert rest.get("drop", []) == []  # nothing after the abort
        assert first["keep"] + rest["keep"] == expected["keep"]
        if isinstance(engine, RuntimeEngine):
            assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks


def test_hf_engine_batches_statically(checkpoints):
    engine = HFEngine(HFEngineConfig(**CPU32, model=str(checkpoints("olmoe")), max_batch_size=2))
    with engine:
        for rid in ("a", "b", "c"):
            engine.add_request(EngineRequest(rid, (4, 5), 4, ignore_eos=True))
        order = []
        while engine.has_unfinished():
            out = engine.step()
            order.append(sorted(o.request_id for o in out.outputs))
    # a and b run as one batch of 4 iterations; c starts only after that batch is done.
    assert order[:4] == [["a", "b"]] * 4 and ["c"] in order[4:] and ["a", "b", "c"] not in order


def test_moe_engine_limits_and_info(checkpoints):
    engine = MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints("qwen3_moe")), max_model_len=64))
    with engine:
        info = engine.info()
        assert (info.architecture, info.device, info.dtype, info.max_model_len) == ("qwen3_moe", "cpu", "float32", 64)
        assert info.weight_bytes > 0 and info.kv_capacity_tokens >= 64
        with pytest.raises(InvalidRequestError, match="exceeds the limit of 64"):
            engine.add_request(EngineRequest("long", tuple(range(60)), 8))
        engine.add_request(EngineRequest("x", (1, 2), 2))
        with pytest.raises(InvalidRequestError, match="already in flight"):
            engine.add_request(EngineRequest("x", (1, 2), 2))
        tokens, finished = collect(engine)
        assert finished["x"] in ("length", "stop")


def test_step_reports_tokens_and_experts(checkpoints):
    engine = MoEEngine(MoEEngineConfig(**CPU32, model=str(checkpoints("mixtral"))))
    with engine:
        engine.add_request(EngineRequest("a", tuple(range(3, 13)), 3, ignore_eos=True))
        first = engine.step()
        second = engine.step()
    assert (first.num_prefill_tokens, first.num_decode_tokens) == (10, 0)
    assert (second.num_prefill_tokens, second.num_decode_tokens) == (0, 1)
    # 2 layers x 6 experts: a 10-token prefill with top-2 hits several experts per layer; one
    # decode token hits exactly top_k = 2 per layer.
    assert 4 < first.experts_hit <= 12 and second.experts_hit == 4
    assert first.h2d_bytes == 0 and first.d2h_bytes == 0  # CPU: nothing crosses a bus

"""Weights packed for MKL's GEMM (the `prepack` option, on by default on CPU float32) change no
number: the same prompt logits to the bit and the same tokens as with prepack off. Oracle: the
same engine with prepack=False (plain F.linear everywhere); packed bytes by hand from the demo
config."""

from __future__ import annotations

import pytest
import torch
from engine_runs import generate, random_requests
from tiny_models import CPU32

from engines.base import EngineRequest
from engines.registry import create_engine
from engines.runtime import cpu_attention, gemm

DEMO = "engines/demo_model"
DEMO_EXPERT = 3 * 128 * 64 * 4  # gate, up, down of one demo expert in float32
DEMO_HEAD = 1109 * 128 * 4

pytestmark = pytest.mark.skipif(not gemm.can_pack(torch.zeros(2, 2)), reason="torch without MKL")


def prompt_logits(name: str, **options) -> tuple[dict[str, torch.Tensor], dict]:
    engine = create_engine(name, {"model": DEMO, **CPU32, **options})
    engine.start()
    try:
        # 80-token prompts: their prefill gives every expert 16+ rows, so the packed path runs
        for i, start in enumerate((5, 300)):
            engine.add_request(EngineRequest(str(i), tuple(range(start, start + 80)), 2, ignore_eos=True,
                                             return_prompt_logits=True))
        got = {}
        while engine.has_unfinished():
            for o in engine.step().outputs:
                if o.prompt_logits is not None:
                    got[o.request_id] = o.prompt_logits
        return got, dict(engine.info().model_stats)
    finally:
        engine.stop()


@pytest.mark.parametrize("name,options,packed", [
    ("moe", {}, DEMO_HEAD + 2 * 4 * DEMO_EXPERT),  # every expert resident
    # moegen: the two resident experts are packed, the streamed ones are not
    ("moegen", {"budget_bytes": 64 << 20, "kv_placement": "device", "resident_experts": 2, "expert_slots": 1},
     DEMO_HEAD + 2 * DEMO_EXPERT),
])
def test_prepacked_weights_give_the_same_logits_to_the_bit(name, options, packed):
    on, stats_on = prompt_logits(name, **options)
    off, stats_off = prompt_logits(name, prepack=False, **options)
    assert stats_on["prepacked_bytes"] == packed and "prepacked_bytes" not in stats_off
    assert stats_on["cpu_attention_kernel"] == float(cpu_attention.available())  # which decode attention ran
    assert on.keys() == off.keys() == {"0", "1"}
    assert all(torch.equal(on[r], off[r]) for r in on)


def test_prepacked_moegen_tokens_equal_moe_without_packing():
    reqs = random_requests(1109, n=24, new=8, lo=20, hi=60)  # decode steps of 24 rows: packed head
    expected, _, _ = generate("moe", DEMO, reqs, prepack=False)
    got, _, info = generate("moegen", DEMO, reqs, budget_bytes=64 << 20, kv_placement="host", host_kv_gb=0.01)
    assert info.model_stats["prepacked_bytes"] > 0
    assert got == expected

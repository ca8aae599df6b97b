"""The expert seam: a wrapping ExpertBackend plugged into the `moe` engine through its public
recipe (`build`: the parts' expert backend wrapped) sees exactly the tokens transformers' router sends to each expert.

Oracle: transformers' Mixtral/OLMoE with output_router_logits=True on the same prompts; top-k of
each layer's router logits gives the (layer, expert) token counts.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny_models import CPU32, build_hf_model

from engines.base import EngineRequest
from engines.moe import MoEEngine, MoEEngineConfig
from engines.runtime.experts import ExpertBackend

PROMPTS = [list(range(20, 43)), [7, 8, 9, 10, 11, 12, 13], list(range(100, 164))]


class Counting(ExpertBackend):
    """Delegates to another backend; counts tokens per (layer, expert) on the way."""

    def __init__(self, inner: ExpertBackend) -> None:
        super().__init__()
        self.inner = inner
        self.tokens: Counter[tuple[int, int]] = Counter()

    def forward(self, layer, x, d):
        for e, n in enumerate(d.counts):
            self.tokens[layer, e] += n
        return self.inner.forward(layer, x, d)

    def layers(self):
        return self.inner.layers()

    def num_experts(self, layer):
        return self.inner.num_experts(layer)

    def expert_bytes(self, layer, expert):
        return self.inner.expert_bytes(layer, expert)

    def step_stats(self):
        return self.inner.step_stats()


class CountingEngine(MoEEngine):
    def build(self, cfg, loaded):
        parts = super().build(cfg, loaded)
        self.counting = parts.experts = Counting(parts.experts)
        return parts


@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_a_wrapping_backend_sees_the_routers_choices(arch, checkpoints):
    model = build_hf_model(arch)
    expected: Counter[tuple[int, int]] = Counter()
    top_k = model.config.num_experts_per_tok
    with torch.inference_mode():
        for p in PROMPTS:
            router_logits = model(input_ids=torch.tensor([p]), output_router_logits=True).router_logits
            for layer, logits in enumerate(router_logits):
                for e in torch.topk(logits.reshape(len(p), -1), top_k, dim=-1).indices.flatten().tolist():
                    expected[layer, e] += 1
    engine = CountingEngine(MoEEngineConfig(**CPU32, model=str(checkpoints(arch)), max_num_batched_tokens=128))
    steps = []
    with engine:
        # One step, one new token each: only the prompts run through the experts.
        for i, p in enumerate(PROMPTS):
            engine.add_request(EngineRequest(str(i), tuple(p), 1, ignore_eos=True))
        while engine.has_unfinished():
            steps.append(engine.step())
    assert engine.counting.tokens == expected
    # Weights a step reads, at float32: every dense parameter but the embedding table, plus
    # each (layer, expert) that ran (gate, up and down: 3 * D * I).
    cfg = model.config
    dense = sum(p.numel() * 4 for n, p in model.named_parameters() if "embed_tokens" not in n and ".experts." not in n)
    per_expert = 3 * cfg.hidden_size * cfg.intermediate_size * 4
    ran = [s for s in steps if s.num_prefill_tokens]
    assert len(ran) == 1 and ran[0].experts_hit == len(+expected)
    assert ran[0].weight_bytes_read == dense + len(+expected) * per_expert

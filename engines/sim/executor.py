"""The simulated executor: a step's expert choices from a routing source, the expert backend's
control path, and the step's duration from the cost model, by which the virtual clock moves.

It replaces compute only. The scheduler, KV blocks and prefix cache, the budget, and the
expert backend's residency decisions (offload's cache and copies) run as in a measured run,
on weights that are shapes on the meta device. Tokens: every sampled row gets one fixed
non-EOS id, so output lengths are the workload's (no tokens are computed).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engines.runtime.batch import StepBatch
from engines.runtime.executor import Executor, StepResult
from engines.runtime.experts import Dispatch, ExpertBackend
from engines.runtime.model import MoEModel
from engines.runtime.transfer import TransferLedger
from engines.sim.clock import VirtualClock
from engines.sim.cost import CostModel, ExpertRun, StepCost, StepWork

_NO_ROWS = torch.empty(0, dtype=torch.long)


@dataclass
class SimTotals:
    """Sums over the run's steps, for the engine's stats."""

    steps: int = 0
    seconds: float = 0.0
    roofline_s: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)


class SimExecutor(Executor):
    def __init__(self, model: MoEModel, ledger: TransferLedger, experts: ExpertBackend, routing: Any,
                 cost: CostModel, clock: VirtualClock, dense_bytes_read: int, copies_overlap: bool) -> None:
        super().__init__(model, ledger)
        cfg = model.config
        self.experts, self.routing, self.cost, self.clock = experts, routing, cost, clock
        self.dense_bytes_read, self.copies_overlap = dense_bytes_read, copies_overlap
        self.moe_layers = [i for i, moe in enumerate(cfg.moe_layers) if moe]
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.token = next(t for t in range(cfg.vocab_size) if t not in cfg.eos_token_ids)
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        if cfg.expert_bias:
            per_expert += 2 * cfg.moe_intermediate_size + cfg.hidden_size
        self.params_per_expert = per_expert
        self.kv_bytes_per_token = model.kv.block_bytes // model.kv.block_size
        self.last: StepCost | None = None
        self.totals = SimTotals()

    def execute(self, batch: StepBatch) -> StepResult:
        keys = [(c.seq.request.request_id, p) for c in batch.chunks for p in range(c.start, c.start + c.length)]
        counts = {layer: np.bincount(self.routing.route(layer, keys, self.num_experts, self.top_k).ravel(),
                                     minlength=self.num_experts).tolist() for layer in self.moe_layers}
        runs: list[ExpertRun] = []
        for k, layer in enumerate(self.moe_layers):
            layer_counts = counts[layer]
            upcoming = None
            if k + 1 < len(self.moe_layers):
                nxt = self.moe_layers[k + 1]
                upcoming = nxt, sorted((e for e, c in enumerate(counts[nxt]) if c), key=lambda e: -counts[nxt][e])
            self.experts.simulate(layer, Dispatch(_NO_ROWS, _NO_ROWS, layer_counts), upcoming)
            # Experts of a layer with the same tokens and stored bytes cost the same: one run each.
            alike = Counter((tokens, self.experts.expert_bytes(layer, e)) for e, tokens in enumerate(layer_counts)
                            if tokens)
            runs += [ExpertRun(layer, tokens, nbytes, 8 * nbytes / self.params_per_expert, count)
                     for (tokens, nbytes), count in alike.items()]
        moved = self.ledger.peek_step()
        work = StepWork(
            prefill=tuple((c.length, c.start) for c in batch.chunks[batch.num_decode:]),
            decode_contexts=tuple(c.start + 1 for c in batch.chunks[:batch.num_decode]),
            experts=tuple(runs), dense_bytes_read=self.dense_bytes_read,
            h2d_bytes=moved.h2d_bytes, d2h_bytes=moved.d2h_bytes, h2d_transfers=moved.h2d_transfers,
            d2h_transfers=moved.d2h_transfers, copies_overlap=self.copies_overlap,
            kv_bytes_per_token=self.kv_bytes_per_token, logit_rows=len(batch.sampled),
        )
        self.last = cost = self.cost.step(work)
        self.clock.advance(cost.seconds)
        t = self.totals
        t.steps, t.seconds, t.roofline_s = t.steps + 1, t.seconds + cost.seconds, t.roofline_s + cost.roofline_s
        for name, s in cost.parts.items():
            t.parts[name] = t.parts.get(name, 0.0) + s
        logits = torch.empty(batch.logit_rows.shape[0], 1, device="meta")
        return StepResult(logits, [self.token] * len(batch.sampled), counts)

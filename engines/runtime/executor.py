"""Executors: run a StepBatch through the model and choose the next tokens.

`Executor` is today's one: the whole flat batch through every layer in one forward, then
sampling. A layer-major executor (module-based batching) implements the same `execute` over
the model's public blocks. Nothing here touches sequences; the engine applies the result.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from engines.runtime.batch import SeqState, StepBatch
from engines.runtime.model import ForwardResult, MoEModel
from engines.runtime.sampling import sample
from engines.runtime.transfer import TransferLedger


@dataclass
class StepResult:
    logits: Tensor  # [S, V] float32 on the device, one row per batch.logit_rows entry
    tokens: list[int]  # one per batch.sampled entry, on the host
    expert_counts: dict[int, list[int]]  # MoE layer -> tokens routed to each expert
    experts_hit: int | None = None  # experts with tokens over the layers, where the executor counted them


class Executor:
    def __init__(self, model: MoEModel, ledger: TransferLedger) -> None:
        self.model, self.ledger = model, ledger

    def device_kv_bytes(self) -> int:
        """Device bytes the executor holds for KV kept in the host tier (a staging buffer); 0 here."""
        return 0

    def execute(self, batch: StepBatch) -> StepResult:
        return self.sample(batch, self.forward(batch))

    def forward(self, batch: StepBatch) -> ForwardResult:
        """The whole flat batch through every layer in one call (layer-major executors
        override this and keep the sampling)."""
        return self.model.forward(batch.token_ids, batch.positions, batch.attn, batch.logit_rows)

    def sample(self, batch: StepBatch, out: ForwardResult) -> StepResult:
        picked = [i for _, i in batch.sampled]
        # A decode step samples every logit row in order: no gathered copy of the logits then.
        rows = out.logits if picked == list(range(out.logits.shape[0])) else out.logits[picked]
        states: list[SeqState] = [c.seq.state for c, _ in batch.sampled]  # type: ignore[misc]
        params = [c.seq.request.sampling for c, _ in batch.sampled]
        # Copying the chosen ids back is the step's device sync: the work is done when it returns.
        tokens = self.ledger.to_host(sample(rows, params, [s.generator for s in states]), "tokens").tolist()
        return StepResult(out.logits, tokens, out.expert_counts)

"""`HostTierBackend`: full-precision routed experts kept in the host tier (pinned on CUDA) and
copied to device buffers when used; the base that engine offload's cache and moegen's
streaming ring share."""

from __future__ import annotations

from engines.runtime.copies import CopyEngine
from engines.runtime.experts import StackedBackend
from engines.runtime.weights import DenseExperts


class HostTierBackend(StackedBackend):
    """Full-precision experts kept in the host tier (`host`: MoE layer -> DenseExperts) and
    copied to device slots when used: what OffloadBackend and moegen's StreamingBackend share."""

    def __init__(self, experts: dict[int, DenseExperts], copies: CopyEngine) -> None:
        self.copies = copies
        self.host = {i: DenseExperts(copies.host(w.gate_up), copies.host(w.down)) for i, w in experts.items()}
        super().__init__(self.host)

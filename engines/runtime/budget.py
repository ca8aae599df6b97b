"""One device budget made of claims: each part of an engine states the least device memory it
holds ("dense weights", "one KV block", ...), `DeviceBudget` sums them, refuses a `--budget`
below that minimum in one line that names every part (and the fix a claim offers), and sizes
the KV pool from what the weights leave."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engines.base import EngineError
from engines.common.sizes import format_size
from engines.runtime.memory import KVSizing, kv_blocks_in_budget

# What a budget too small for experts held on the device should make the user try instead.
OFFLOAD_FIX = "engine offload keeps experts on the host and needs less"


@dataclass(frozen=True)
class Claim:
    """The least device memory one part needs; `fix` is what the user can do instead when the
    budget cannot hold it (said in the error)."""

    what: str
    nbytes: int
    fix: str | None = None


def budget_error(engine: str, budget: int, claims: Sequence[Claim], needed: int | None = None) -> EngineError:
    """`--budget` below an engine's minimum, stated claim by claim; with `needed` above the minimum
    (the weights its options keep on the device, e.g. offload's experts_per_layer, and one KV
    block), that first."""
    minimum = sum(c.nbytes for c in claims)
    fixes = "".join(f" ({c.fix})" for c in claims if c.fix)
    parts = " + ".join(f"{c.what} {format_size(c.nbytes)}" for c in claims) + fixes
    if needed is not None and needed > minimum:
        return EngineError(
            f"--budget {format_size(budget)} is too small for engine {engine} on this model with these options: "
            f"the weights they keep on the device and one KV block need {format_size(needed)} ({needed} bytes); "
            f"give a larger --budget or options that keep fewer weights on the device (the least the engine "
            f"takes is {format_size(minimum)} = {parts})")
    return EngineError(
        f"--budget {format_size(budget)} is too small for engine {engine} on this model: it needs at "
        f"least {format_size(minimum)} ({minimum} bytes) = " + parts
    )


class DeviceBudget:
    """`--budget` (None: unbounded) against the claims of an engine's parts."""

    def __init__(self, engine: str, budget_bytes: int | None, claims: Sequence[Claim]) -> None:
        self.engine, self.budget_bytes, self.claims = engine, budget_bytes, tuple(claims)

    @property
    def minimum(self) -> int:
        return sum(c.nbytes for c in self.claims)

    def parts(self) -> list[tuple[str, int]]:
        """(what, bytes) per claim: the smallest budget, part by part."""
        return [(c.what, c.nbytes) for c in self.claims]

    def check(self, needed: int | None = None) -> None:
        """Refuse a budget below `needed` (default: the minimum), naming every claim."""
        if self.budget_bytes is not None and self.budget_bytes < (self.minimum if needed is None else needed):
            raise budget_error(self.engine, self.budget_bytes, self.claims, needed)

    def kv_blocks(self, sizing: KVSizing, block_bytes: int, weights_beside: int) -> int:
        """KV blocks in what the budget leaves beside `weights_beside` device bytes of weights
        (at least one block must fit)."""
        assert self.budget_bytes is not None
        self.check(weights_beside + block_bytes)
        return kv_blocks_in_budget(sizing, block_bytes, self.budget_bytes - weights_beside)

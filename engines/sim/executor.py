"""The simulated executor: a step's expert choices from a routing source, the expert backend's
control path, and the step's duration from the cost model, by which the virtual clock moves.

It replaces compute only. The scheduler, KV blocks and prefix cache, the budget, and the
expert backend's residency decisions (offload's cache and copies) run as in a measured run,
on weights that are shapes on the meta device. Tokens: every sampled row gets one fixed
non-EOS id, so output lengths are the workload's (no tokens are computed).

Control time (`control_time = "measured"`, the default): the control code is real, so its time
is measured rather than modelled. A step's duration is the cost model's compute plus the CPU
time (this thread's) spent since the previous step was priced, outside the simulator's own
work (routing draws, pricing): the engine's bookkeeping after that step, the harness's loop
between steps, this step's controllers' hooks, scheduler and batch assembly, and the expert
backend's `simulate` calls (cache or residency decisions). After a step that leaves the engine
idle the count restarts at the next step's top, so a warm-up's teardown, a run's setup or an
idle wait for arrivals is never charged. It makes simulated times vary run to run with that
CPU time's noise; "off" gives compute only, deterministic.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engines.runtime.batch import StepBatch
from engines.runtime.executor import Executor, StepResult
from engines.runtime.experts import Dispatch, ExpertBackend, StackedBackend
from engines.runtime.model import MoEModel
from engines.runtime.shape import model_shape
from engines.runtime.transfer import TransferLedger
from engines.sim.ahead import AheadRouter, tally_layers
from engines.sim.clock import VirtualClock
from engines.sim.cost import CostModel, ExpertRun, StepCost, StepWork, executor_overhead_s

_NO_ROWS = torch.empty(0, dtype=torch.long)
_RUNS_LIMIT = 1 << 16  # ExpertRuns kept for reuse (_alike_runs)


@dataclass
class SimTotals:
    """Sums over the run's steps, for the engine's stats."""

    steps: int = 0
    seconds: float = 0.0
    roofline_s: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)


class SimExecutor(Executor):
    def __init__(self, model: MoEModel, ledger: TransferLedger, experts: ExpertBackend, routing: Any,
                 cost: CostModel, clock: VirtualClock, dense_bytes_read: int, copies_overlap: bool,
                 control_time: bool = True) -> None:
        super().__init__(model, ledger)
        cfg = model.config
        self.experts, self.routing, self.cost, self.clock = experts, routing, cost, clock
        self.dense_bytes_read, self.copies_overlap = dense_bytes_read, copies_overlap
        self.moe_layers = [i for i, moe in enumerate(cfg.moe_layers) if moe]
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.token = next(t for t in range(cfg.vocab_size) if t not in cfg.eos_token_ids)
        self.params_per_expert = model_shape(cfg, 1).expert_bytes  # at 1 byte per weight: its parameters
        self.kv_bytes_per_token = model.kv.block_bytes // model.kv.block_size
        self.last: StepCost | None = None
        self._layer_tuple = tuple(self.moe_layers)
        self.ahead = AheadRouter(routing, self._layer_tuple, self.num_experts, self.top_k) \
            if getattr(routing, "draws_ahead", False) and self.moe_layers else None
        # A backend whose `simulate` is ExpertBackend's only counts: it never reads `upcoming`.
        self._wants_upcoming = type(experts).simulate is not ExpertBackend.simulate
        self._scheme = getattr(experts, "dequant_scheme", "packed")  # how its quantized experts are stored
        # A backend that only counts, with one stored size per layer fixed at load (StackedBackend's
        # expert_bytes): its steps are priced from the counts matrix at once (`_counted_runs`).
        self._layer_bytes: np.ndarray | None = None
        self._size_groups: list[tuple[int, float, np.ndarray]] = []  # (bytes, bits, its layers' rows)
        if not self._wants_upcoming and type(experts).expert_bytes is StackedBackend.expert_bytes and self.moe_layers:
            self._layer_bytes = np.array([experts.expert_bytes(layer, 0) for layer in self.moe_layers], dtype=np.int64)
            self._size_groups = [(int(b), 8 * int(b) / self.params_per_expert, np.flatnonzero(self._layer_bytes == b))
                                 for b in np.unique(self._layer_bytes)]
        self.totals = SimTotals()
        self.profile = cost.profile if cost is not None else None  # a subclass pricing otherwise sets its own
        # keys of the profile's executor_overhead tables each step pays (engines/sim/cost.py
        # `executor_overhead_s`): the engine's `sim_overhead_keys`, set by the engine that builds this
        self.overhead_keys: tuple[str, ...] = ()
        self._logits: dict[int, torch.Tensor] = {}
        self._runs: dict[tuple[int, int], ExpertRun] = {}  # (tokens << 40 | bytes, count) -> its run
        self.control_time = control_time  # RuntimeConfig.control_time == "measured"
        self._mark: float | None = None  # thread time when the previous step was priced (None: idle since)
        self._control = 0.0  # the step's control seconds so far

    def overhead_assumptions(self) -> dict[str, Any]:
        """What the result folder records about the engine's parts' host time (`executor_overhead_s`)."""
        if not self.overhead_keys:
            return {"keys": [], "note": "engine moe's path: nothing beyond the priced modules and counted calls"}
        p = self.profile
        per_layer = getattr(p, "executor_overhead_s", None) or {}
        per_token = getattr(p, "executor_token_overhead_s", None) or {}
        sources = getattr(p, "sources", None) or {}
        return {"keys": list(self.overhead_keys),
                "per_layer_s": {k: float(per_layer.get(k, 0.0)) for k in self.overhead_keys},
                "per_layer_token_s": {k: float(per_token.get(k, 0.0)) for k in self.overhead_keys},
                "source": sources.get("executor_overhead_s", "not in the profile: 0 (the shipped GPU profiles price "
                                      "CUDA-graph serving: no host Python per layer)")}

    # -- control time (RuntimeEngine.step calls step_begin / step_end on a simulated run) ---------------
    def step_begin(self) -> bool:
        """The engine has work from now (a step begins, or a request is admitted while it was idle):
        its control time counts from here. True where it was idle until now."""
        if self._mark is None:
            self._mark = time.thread_time()
            return True
        return False

    def step_end(self, busy: bool) -> None:
        """`busy`: the engine has work left; if not, what happens before its next step is not its own."""
        if not busy:
            self._mark = None

    def begin(self) -> None:
        """At the top of execute: the control time since the previous step was priced (or this step began)."""
        now = time.thread_time()
        self._control = now - self._mark if self._mark is not None else 0.0

    def _timed(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` (the backend's decisions), its CPU time counted as control time."""
        t = time.thread_time()
        out = fn(*args)
        self._control += time.thread_time() - t
        return out

    def timed_simulate(self, layer: int, d: Dispatch, upcoming: tuple[int, list[int]] | None = None) -> None:
        """The backend's control path for one layer, its CPU time counted as control time."""
        self._timed(self.experts.simulate, layer, d, upcoming)

    def route_matrix(self, batch: StepBatch) -> np.ndarray:
        """Tokens per expert [MoE layers, E] for the step's rows: through `AheadRouter` for a source
        that draws requests' rows as chains (synthetic, uniform), else all layers in one `route_layers`
        call where the source has it, else one `route` call per layer (replay)."""
        if self.ahead is not None:
            return self.ahead.matrix(batch)
        keys = batch.row_keys()
        layers, e, k = self.moe_layers, self.num_experts, self.top_k
        route_layers = getattr(self.routing, "route_layers", None)
        if route_layers is not None:
            ids = route_layers(self._layer_tuple, keys, e, k).reshape(len(layers), -1)
        else:
            ids = np.stack([self.routing.route(layer, keys, e, k).ravel() for layer in layers]) if layers else \
                np.empty((0, 0), dtype=np.int64)
        return tally_layers(ids, e)

    def route_counts(self, batch: StepBatch) -> dict[int, list[int]]:
        """`route_matrix` as MoE layer -> tokens per expert (what StepResult carries)."""
        return dict(zip(self.moe_layers, self.route_matrix(batch).tolist()))

    def _counted_runs(self, matrix: np.ndarray) -> list[ExpertRun]:
        """A counting-only backend with one stored size per layer, all layers at once: the bytes of
        the experts that ran recorded, and one run per (tokens, stored bytes) over the step (an
        expert's cost does not depend on its layer)."""
        ran = matrix > 0
        self.experts.count_bytes(int(ran.sum(axis=1) @ self._layer_bytes))
        runs = []
        for nbytes, bits, rows in self._size_groups:  # usually one group: every layer stores one size
            m = matrix if len(self._size_groups) == 1 else matrix[rows]
            by_tokens = np.bincount(m[m > 0])
            tokens = np.flatnonzero(by_tokens)
            runs += [ExpertRun(-1, t, nbytes, bits, n, self._scheme)
                     for t, n in zip(tokens.tolist(), by_tokens[tokens].tolist())]
        return runs

    def _simulate_step(self, matrix: np.ndarray) -> np.ndarray | None:
        """The backend's `simulate_step` (timed as control when it makes decisions, as `simulate` is)."""
        if not self._wants_upcoming or not self.control_time:
            return self.experts.simulate_step(self.moe_layers, matrix)
        return self._timed(self.experts.simulate_step, self.moe_layers, matrix)

    def _alike_runs(self, matrix: np.ndarray, nbytes: np.ndarray) -> list[ExpertRun]:
        """One run per (tokens, stored bytes) over the step's experts that ran, in the order a
        layer-by-layer walk meets them first (the cost model sums the runs in that order)."""
        ran = matrix > 0
        # One int64 per (tokens, bytes): an expert's bytes fit 40 bits (1 TiB), its tokens the rest.
        keys = (matrix[ran].astype(np.int64) << 40) | nbytes[ran]
        alike, first, count = np.unique(keys, return_index=True, return_counts=True)
        order = np.argsort(first)
        mask = (1 << 40) - 1
        made = self._runs  # ExpertRun is frozen: one instance per (key, count) serves every step
        if len(made) > _RUNS_LIMIT:
            made.clear()
        runs = []
        for k, n in zip(alike[order].tolist(), count[order].tolist()):
            run = made.get((k, n))
            if run is None:
                run = made[(k, n)] = ExpertRun(-1, k >> 40, k & mask, 8 * (k & mask) / self.params_per_expert, n,
                                               self._scheme)
            runs.append(run)
        return runs

    def execute(self, batch: StepBatch) -> StepResult:
        self.begin()
        matrix = self.route_matrix(batch)
        counts = dict(zip(self.moe_layers, matrix.tolist()))
        experts, moe_layers = self.experts, self.moe_layers
        if self._layer_bytes is not None:  # counts only, one size per layer: every layer at once
            runs = self._counted_runs(matrix)
        elif (held := self._simulate_step(matrix)) is not None:  # the backend's every layer at once
            runs = self._alike_runs(matrix, held)
        else:
            alike: Counter = Counter()  # (tokens, stored bytes) -> experts over the step (cost is per such pair)
            # A backend with its own simulate makes decisions (offload's cache): timed as control.
            simulate = self.timed_simulate if self._wants_upcoming and self.control_time else experts.simulate
            n_moe = len(moe_layers)
            for k, layer in enumerate(moe_layers):
                layer_counts = counts[layer]
                upcoming = None
                if self._wants_upcoming and k + 1 < n_moe:
                    nxt = moe_layers[k + 1]
                    nc = counts[nxt]
                    upcoming = nxt, sorted((e for e, c in enumerate(nc) if c), key=lambda e: -nc[e])
                if self._wants_upcoming:
                    simulate(layer, Dispatch(_NO_ROWS, _NO_ROWS, layer_counts), upcoming)
                else:  # ExpertBackend.simulate only counts: skip building the Dispatch
                    experts.count_experts(layer, layer_counts)
                # Experts with the same tokens and stored bytes cost the same: one run each over the step.
                alike.update((tokens, experts.expert_bytes(layer, e)) for e, tokens in enumerate(layer_counts)
                             if tokens)
            runs = [ExpertRun(-1, tokens, nbytes, 8 * nbytes / self.params_per_expert, count, self._scheme)
                    for (tokens, nbytes), count in alike.items()]
        moved = self.ledger.peek_step()
        work = StepWork(
            prefill=tuple((c.length, c.start) for c in batch.chunks[batch.num_decode:]),
            decode_contexts=tuple(c.start + 1 for c in batch.chunks[:batch.num_decode]),
            experts=tuple(runs), dense_bytes_read=self.dense_bytes_read,
            h2d_bytes=moved.h2d_bytes, d2h_bytes=moved.d2h_bytes, h2d_transfers=moved.h2d_transfers,
            d2h_transfers=moved.d2h_transfers, copies_overlap=self.copies_overlap,
            kv_bytes_per_token=self.kv_bytes_per_token, logit_rows=len(batch.sampled),
            decode_groups=len(batch.attn.decodes),
        )
        return self.finish(batch, self.cost.step(work), counts, int(np.count_nonzero(matrix)))

    def finish(self, batch: StepBatch, cost: StepCost, counts: dict[int, list[int]],
               experts_hit: int | None = None) -> StepResult:
        """A priced step: the clock moves by its time, the totals add it; one fixed token per
        sampled row (no logits are computed: a meta row per logit row)."""
        if self.overhead_keys:  # the engine's parts' host time beyond the priced modules
            extra = executor_overhead_s(self.profile, self.overhead_keys, self.model.config.num_layers,
                                        sum(c.length for c in batch.chunks))
            if extra:
                cost = StepCost(cost.seconds + extra, {**cost.parts, "executor": extra}, cost.roofline_s)
        if self.control_time and self._control > 0.0:
            cost = StepCost(cost.seconds + self._control, {**cost.parts, "control": self._control}, cost.roofline_s)
        self._control = 0.0
        self.last = cost
        self.clock.advance(cost.seconds)
        t = self.totals
        t.steps, t.seconds, t.roofline_s = t.steps + 1, t.seconds + cost.seconds, t.roofline_s + cost.roofline_s
        for name, s in cost.parts.items():
            t.parts[name] = t.parts.get(name, 0.0) + s
        rows = batch.logit_rows.shape[0]
        logits = self._logits.get(rows)
        if logits is None:  # meta tensors hold no data: one per row count serves every step
            logits = self._logits[rows] = torch.empty(rows, 1, device="meta")
        result = StepResult(logits, [self.token] * len(batch.sampled), counts, experts_hit)
        self._mark = time.thread_time()
        return result

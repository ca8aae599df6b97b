"""Engine `pagedweight`: routed experts in pages whose bit widths change while serving,
arbitrated with the KV cache inside one device budget, with a quality feedback loop.

The `moe` runtime with three additions (engines/paged/):
- every expert's full-precision master and its quantized versions live in the host tier
  (`representation`: `bitplanes`, one 8-bit copy cut into planes, or `requantize`, one RTN
  copy per width); the device holds each expert at one of `bits` (16 = the master);
- before every step the arbiter (engines/paged/arbiter.py) sees the KV demand of the running
  and waiting requests, gives the weights what the budget leaves, and picks each expert's
  width to minimise importance x sensitivity(bits): importance is an EMA of the expert's
  routing mass (engines/paged/importance.py), sensitivity its measured output error at each
  width on calibration activations of every demo task (engines/paged/sensitivity.py, cached
  beside the model). Demotions that make room for KV come first; promotions copy pages
  asynchronously during the step and are committed at the next step boundary; hysteresis,
  a minimum residence time and a per-step transition budget stop thrashing;
- every `feedback_every` steps a sampled share of quantized rows is recomputed with the
  master: measured errors update the sensitivities, and a layer whose error exceeds
  `feedback_threshold` has its worst experts pinned one width higher (up to 16, the
  fallback), each such event recorded.
KV capacity follows what the weights leave; when even the floors leave too little, requests
wait or are preempted by the scheduler, never failed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.base import EngineError, StepOutput
from engines.moe import MoEEngine, MoEEngineConfig
from engines.paged.arbiter import Arbiter, Choice, solve_greedy
from engines.paged.backend import PagedWeightBackend
from engines.paged.importance import Importance, Key
from engines.runtime.copies import CopyEngine
from engines.runtime.experts import ExpertBackend
from engines.runtime.weights import DenseExperts

REPRESENTATIONS = ("bitplanes", "requantize")
MISS_COST = 10.0  # sensitivity of an expert not resident (fetched on demand at its lowest width)


@dataclass(frozen=True)
class PagedWeightConfig(MoEEngineConfig):
    representation: str = "bitplanes"  # bitplanes | requantize
    bits: str = "16,8,4,3,2"  # widths an expert may hold on the device (16 = full precision)
    floor_bits: int = 2  # no expert below this (0: experts may leave the device)
    # Quality floors: no expert at a width whose measured relative output error (its
    # sensitivity, squared error over squared output on calibration activations) exceeds this;
    # 0.01 is about 20 dB SNR, ~4-bit RTN on the demo model. None: any width down to floor_bits.
    max_expert_error: float | None = 0.01
    group_size: int = 32  # inputs per quantization group
    importance_decay: float = 0.9  # EMA of each expert's routing-mass share, per step
    hysteresis: float = 0.02  # an optional re-plan must lower the expected cost by this share
    min_residence_steps: int = 8  # steps an expert keeps a width before an optional change
    transition_bytes_per_step: int | None = None  # bytes of optional page moves per step; None: any
    kv_reserve_bytes: int | None = None  # KV room planned for at start; None: 25% of budget - dense
    feedback_every: int = 16  # steps between quality-feedback checks (0: off)
    feedback_share: float = 0.05  # share of each quantized expert's rows recomputed with the master
    feedback_threshold: float = 0.05  # a layer's relative error above this pins its worst experts up
    feedback_weight: float = 0.5  # how far a measurement moves the sensitivity estimate
    matrix_every: int = 16  # steps between rows of the (layer, expert) -> bits table
    calib_prompts: int = 24  # seeded random-token calibration prompts (models other than demo-language)
    calib_file: str | None = None  # JSON list of token-id prompts to calibrate on (the harness writes one)
    link_gbps: float | None = None  # CPU only: modelled host->device link (as engine offload)


class PagedWeightEngine(MoEEngine):
    name = "pagedweight"
    plain_experts_only = True  # its pages and precision tiers hold gate_up/down only
    config_cls = PagedWeightConfig
    float32_reference = False
    needs_calibration = True

    # -- loading -----------------------------------------------------------------------------------
    def build_experts(self, dense: dict[int, DenseExperts]) -> ExpertBackend:
        backend = self._paged_backend(dense)
        self._start_arbiter(backend)
        return backend

    def _paged_backend(self, dense: dict[int, DenseExperts]) -> PagedWeightBackend:
        """The experts' host-tier stores, their measured sensitivities and quality floors, and
        the backend over them (nothing on the device yet)."""
        from engines.paged.formats import make_store  # noqa: PLC0415
        from engines.paged.sensitivity import load_or_measure  # noqa: PLC0415
        from engines.quant.qweight import QuantFormatError  # noqa: PLC0415

        cfg: PagedWeightConfig = self.config  # type: ignore[assignment]
        if cfg.budget_bytes is None:
            raise EngineError(f"engine {self.name} needs a device budget (--budget SIZE)")
        if cfg.representation not in REPRESENTATIONS:
            raise EngineError(f"engine {self.name}: representation must be one of {', '.join(REPRESENTATIONS)}, "
                              f"got {cfg.representation!r}")
        self.bit_widths = self._parse_bits(cfg.bits, cfg.floor_bits)
        bound = cfg.max_expert_error
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound > 0):
            raise EngineError(f"engine {self.name}: max_expert_error must be a number > 0 (e.g. 0.01) or none, "
                              f"got {bound!r}")
        self.copies = CopyEngine(self.ledger, self.device, cfg.link_gbps)
        try:
            stores = {(i, e): make_store(cfg.representation, w.gate_up[e], w.down[e], self.bit_widths,
                                         cfg.group_size, self.copies.host)
                      for i, w in dense.items() for e in range(w.num_experts)}
        except QuantFormatError as exc:
            raise EngineError(f"engine {self.name}: {exc} (set group_size to one that divides it, "
                              "e.g. --set group_size=64)") from None
        self.sensitivity = {k: dict(v) for k, v in load_or_measure(
            self.checkpoint, dense, self.weights, cfg.representation, self.bit_widths, cfg.group_size,
            prompts=self._calibration_prompts(), device=self.device, dtype=self.dtype).items()}
        self.importance = Importance({i: w.num_experts for i, w in dense.items()}, cfg.importance_decay)
        self.quality = quality = {key: self._quality_floor(key) for key in stores}
        self.floors: dict[Key, int] = {key: max(cfg.floor_bits, q) if cfg.floor_bits else 0 for key, q in quality.items()}
        backend = PagedWeightBackend(stores, self.copies, self.device, self.importance, cfg.feedback_share, cfg.seed)
        backend.fetch_bits = dict(quality)  # an expert that left the device comes back at its quality floor
        if 0 in self.floors.values():
            backend.staging_bytes = backend.fetch_slots * backend.staging_slot_bytes()
        self.experts = backend
        return backend

    def _start_arbiter(self, backend: PagedWeightBackend) -> None:
        """Copy in the widths the budget allows at start and hand them to the arbiter."""
        cfg: PagedWeightConfig = self.config  # type: ignore[assignment]
        self._engine_step = 0
        self._events: list[dict[str, Any]] = []
        self._matrix: list[dict[str, Any]] = []
        initial = self._start_plan(backend)
        self.arbiter = Arbiter(hysteresis=cfg.hysteresis, min_residence_steps=cfg.min_residence_steps,
                               transition_bytes_per_step=cfg.transition_bytes_per_step,
                               transfer=lambda key, a, b: self._transfer(key, a, b), floors=self.floors,
                               initial=initial)

    def _quality_floor(self, key: Key) -> int:
        """The lowest width whose measured error is within max_expert_error (16 always is)."""
        bound = self.config.max_expert_error  # type: ignore[attr-defined]
        widths = [b for b in self.bit_widths if bound is None or b == 16 or self.sensitivity[key][b] <= bound]
        return min(widths)

    def _calibration_prompts(self) -> int | list[list[int]]:
        cfg: PagedWeightConfig = self.config  # type: ignore[assignment]
        if cfg.calib_file is None:
            return cfg.calib_prompts
        try:
            prompts = json.loads(Path(cfg.calib_file).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise EngineError(f"engine {self.name}: cannot read calib_file {cfg.calib_file}: {exc}") from None
        if not isinstance(prompts, list) or not all(isinstance(p, list) and all(isinstance(t, int) for t in p)
                                                    for p in prompts):
            raise EngineError(f"engine {self.name}: calib_file {cfg.calib_file} must hold a JSON list of "
                              "token-id lists")
        return prompts

    @staticmethod
    def _parse_bits(text: str, floor: int) -> tuple[int, ...]:
        try:
            bits = tuple(sorted({int(b) for b in text.split(",") if b.strip()}, reverse=True))
        except ValueError:
            raise EngineError(f"engine pagedweight: bits must be comma-separated integers, got {text!r}") from None
        bad = [b for b in bits if b not in (16, 8, 4, 3, 2)]
        if bad or 16 not in bits:
            raise EngineError(f"engine pagedweight: bits must include 16 and be among 16,8,4,3,2; got {text!r}")
        if floor not in (0, *bits):
            raise EngineError(f"engine pagedweight: floor_bits must be 0 or one of {bits}, got {floor}")
        return bits

    def _transfer(self, key: Key, from_bits: int, to_bits: int) -> int:
        return self.experts.stores[key].transfer_bytes(from_bits, to_bits)

    def _start_plan(self, backend: PagedWeightBackend) -> dict[Key, int]:
        """The widths at load: the best plan for the budget less a KV reserve, copied in now."""
        cfg: PagedWeightConfig = self.config  # type: ignore[assignment]
        free = cfg.budget_bytes - self._dense_device_bytes() - self._reserved_device_bytes()
        self._check_budget(sum(n for _, n in self.budget_minimum()))
        if self._kv_on_device():
            reserve = cfg.kv_reserve_bytes if cfg.kv_reserve_bytes is not None else free // 4
            reserve = min(max(reserve, self._kv_block_bytes()), free - self._floor_bytes())
        else:
            reserve = 0
        plan = solve_greedy(self._options(), free - reserve - backend.staging_bytes, self.floors)
        for key, bits in plan.bits.items():
            if bits:
                backend.start_move(key, bits)
        backend.commit()
        return dict(plan.bits)

    def _floor_bytes(self) -> int:
        """Every expert at its floor, plus the on-demand staging slots when a floor is 0."""
        backend: PagedWeightBackend = self.experts  # type: ignore[assignment]
        return backend.staging_bytes + sum(store.nbytes(self.floors[k]) if self.floors[k] else 0
                                           for k, store in backend.stores.items())

    def budget_minimum(self) -> list[tuple[str, int]]:
        cfg: PagedWeightConfig = self.config  # type: ignore[assignment]
        widths = sorted(set(self.floors.values()))
        slots = self.experts.fetch_slots  # type: ignore[attr-defined]
        floor = (f"every routed expert at its floor ({'/'.join(map(str, widths))} bits: floor_bits {cfg.floor_bits}, "
                 f"max_expert_error {cfg.max_expert_error})" if cfg.floor_bits else
                 "a staging slot for one expert fetched on demand at its quality floor" if slots == 1 else
                 f"{slots} staging slots for experts fetched on demand at their quality floor (one copies while "
                 "another computes)")
        return [("dense weights", self._dense_device_bytes()), (floor, self._floor_bytes()),
                ("one KV block", self._kv_block_bytes())]

    def _kv_on_device(self) -> bool:
        """Whether the KV cache competes with the expert pages inside the budget (it does here;
        engine full may keep it in the host tier)."""
        return True

    def _reserved_device_bytes(self) -> int:
        """Device bytes of the budget neither pages nor KV blocks may use (engine full: moegen's
        KV staging buffer); none here."""
        return 0

    def _weights_beside_kv(self) -> int:
        """The KV pool is as large as the budget allows with every expert at its floor; each
        step sets its capacity to what the weights leave then."""
        return self._dense_device_bytes() + self._floor_bytes()

    # -- the step ----------------------------------------------------------------------------------
    def _options(self) -> dict[Key, list[Choice]]:
        out = {}
        for key, store in self.experts.stores.items():
            imp = self.importance[key]
            # Never below the quality floor (with floor_bits 0 the floor in self.floors is 0:
            # the expert may leave the device, but not sit on it at a width over the bound).
            opts = [Choice(b, store.nbytes(b), imp * (0.0 if b == 16 else self.sensitivity[key][b]))
                    for b in self.bit_widths if b >= self.quality[key]]
            if self.floors[key] == 0:
                opts.append(Choice(0, 0, imp * MISS_COST))
            out[key] = opts
        return out

    def _kv_demand_blocks(self) -> int:
        """Blocks the running requests need to finish, plus what the queue would take next:
        waiting requests in admission order (the scheduler admits first come, first served)
        while they fit the pool as it is with every expert at its floor. A request that would
        not fit even then waits either way, so no expert is demoted for it."""
        alloc, sched = self.kv.allocator, self.scheduler
        need = sum(alloc.blocks_for(len(s.request.prompt_ids) + s.request.max_new_tokens) for s in sched.running)
        room = max(0, sched.max_num_seqs - len(sched.running))
        for s in list(sched.waiting)[:room]:
            more = alloc.blocks_for(len(s.request.prompt_ids) + s.request.max_new_tokens)
            if need + more > alloc.num_blocks:
                break
            need += more
        return need

    def step(self) -> StepOutput:
        self._check_started()
        cfg: PagedWeightConfig = self.config  # type: ignore[assignment]
        backend: PagedWeightBackend = self.experts  # type: ignore[assignment]
        committed = backend.commit()
        self.arbiter.commit([m for m in self.arbiter.inflight if any(c.key == m.key for c in committed)],
                            self._engine_step)
        block = self.kv.block_bytes
        # What the pages, the staging slots and (device placement) the KV blocks share.
        pages = cfg.budget_bytes - self._dense_device_bytes() - self._reserved_device_bytes()
        on_device = self._kv_on_device()
        kv_bytes = min(self._kv_demand_blocks(), self.kv.allocator.num_blocks) * block if on_device else 0
        decision = self.arbiter.plan(self._engine_step, max(0, pages - backend.staging_bytes - kv_bytes), self._options())
        if decision.cancelled:
            backend.cancel([m.key for m in decision.cancelled])
        moved = promotions = demotions = deferred = 0
        # What the pages may hold while moves are in flight: a promotion's new buffers exist
        # beside the version they replace until the commit, so one that would take the device
        # over the budget now waits (the arbiter plans it again next step). Cached KV blocks do
        # not count: lowering the KV capacity below drops them.
        room = pages - (self.kv.allocator.num_used * block if on_device else 0)
        used = backend.device_bytes()  # walked once; a promotion adds its new buffers
        for move in decision.moves:
            promote = move.to_bits > move.from_bits
            if promote and used + backend.move_bytes(move.key, move.to_bits) > room:
                self.arbiter.abort([move])
                deferred += 1
                continue
            started = backend.start_move(move.key, move.to_bits)
            used = used + started.nbytes if promote else backend.device_bytes()  # a demotion may free parts
            moved += started.nbytes
            promotions += promote
            demotions += move.to_bits < move.from_bits
            if started.handle is None:
                self.arbiter.commit([move], self._engine_step)
        if on_device:
            blocks = max(0, (pages - backend.device_bytes()) // block)
            self.kv.allocator.set_capacity(min(blocks, self.kv.allocator.num_blocks))
        backend.step_index = self._engine_step
        backend.feedback_due = cfg.feedback_every > 0 and self._engine_step % cfg.feedback_every == cfg.feedback_every - 1
        out = super().step()
        self.importance.end_step()
        extras = {**out.extras, **self._observe(decision.fits, moved, promotions, demotions), "deferred_promotions": deferred}
        self._engine_step += 1
        return dataclasses.replace(out, extras=extras)

    def _observe(self, fits: bool, moved: int, promotions: int, demotions: int) -> dict[str, float]:
        cfg: PagedWeightConfig = self.config  # type: ignore[assignment]
        backend: PagedWeightBackend = self.experts  # type: ignore[assignment]
        bits = {k: backend.bits(k) for k in backend.stores}
        extras: dict[str, float] = {"engine_step": self._engine_step, "mean_bits": sum(bits.values()) / len(bits),
                                    "promotions": promotions, "demotions": demotions, "move_bytes": moved,
                                    "floors_fit": int(fits)}
        for b in (*self.bit_widths, 0):
            extras[f"experts_at_{b}_bits"] = sum(v == b for v in bits.values())
        feedback = backend.take_feedback() if backend.feedback_due else None
        extras.update(feedback_checks=0, fallbacks=0)
        if feedback is not None and feedback.layer_error:
            extras.update(feedback_checks=1, feedback_error_max=max(feedback.layer_error.values()),
                          feedback_rows=feedback.rows, feedback_s=feedback.seconds, feedback_bytes=feedback.bytes)
            extras["fallbacks"] = self._apply_feedback(feedback)
        if self._engine_step % max(1, cfg.matrix_every) == 0:
            self._matrix += [{"engine_step": self._engine_step, "layer": k[0], "expert": k[1], "bits": b,
                              "importance": self.importance[k]} for k, b in bits.items()]
        return extras

    def _apply_feedback(self, sample) -> int:
        """Measured errors move the sensitivity estimates; a layer over the threshold has its
        experts that measured over it (or, if none alone, all it sampled) pinned one width up."""
        cfg: PagedWeightConfig = self.config  # type: ignore[assignment]
        backend: PagedWeightBackend = self.experts  # type: ignore[assignment]
        w = cfg.feedback_weight
        for key, (bits, err) in sample.expert_error.items():
            old = self.sensitivity[key][bits]
            self.sensitivity[key][bits] = (1 - w) * old + w * err
        pinned = 0
        for layer, err in sample.layer_error.items():
            if err <= cfg.feedback_threshold:
                continue
            sampled = {k: v for k, v in sample.expert_error.items() if k[0] == layer}
            worst = [k for k, (_, e) in sampled.items() if e > cfg.feedback_threshold] or list(sampled)
            for key in worst:
                bits = sampled[key][0]
                higher = min(b for b in self.bit_widths if b > bits)
                if self.floors[key] < higher:
                    self.floors[key] = higher
                    # Its quality floor rises with it (the widths it may hold, and fetch at).
                    self.quality[key] = max(self.quality[key], higher)
                    backend.fetch_bits[key] = max(backend.fetch_bits.get(key, 0), higher)
                    if self.arbiter.raise_floor(key, higher, self._engine_step):
                        backend.cancel([key])
                        backend.start_move(key, higher)
                    pinned += 1
                    self._events.append({"engine_step": self._engine_step, "layer": layer, "expert": key[1],
                                         "layer_error": err, "expert_error": sampled[key][1], "from_bits": bits,
                                         "floor_bits": higher})
        return pinned

    # -- results -----------------------------------------------------------------------------------
    def tables(self) -> dict[str, list[dict[str, Any]]]:
        usage = [{"layer": k[0], "expert": k[1], "tokens": n, "routing_mass": self.importance.total_mass[k]}
                 for k, n in sorted(self.importance.total_tokens.items())]
        return {"expert_bits": list(self._matrix), "expert_usage": usage, "fallbacks": list(self._events)}

    def _model_stats(self) -> dict[str, float]:
        stats = super()._model_stats()
        stats["bytes_per_expert"] = max(s.nbytes(16) for s in self.experts.stores.values())
        return stats

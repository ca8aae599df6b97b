"""Engine `pagedweight`: routed experts in pages whose bit widths change while serving,
arbitrated with the KV cache inside one device budget, with a quality feedback loop.

A recipe of runtime parts and this folder's: every expert's master and quantized versions in
the host tier (formats.py, `representation` bitplanes or requantize), a backend that holds each
on the device at one width (backend.py), and a controller (controller.py) whose arbiter
(arbiter.py) picks the widths every step from routing importance (importance.py) x measured
sensitivity (sensitivity.py) against the KV demand. Design and measurements: docs/pagedweight.md.

A gpt-oss MXFP4 folder is served from its own format: the widths an expert may hold are the
checkpoint's MXFP4 (`mxfp4`, 4.25 bits per weight, its master: the checkpoint holds nothing
finer) and lower ones quantized from its dequantized values (default `bits` "mxfp4,3,2"); 16
(dequantized MXFP4: more bytes, the same values) and 8 only when `bits` names them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from engines.base import EngineError
from engines.pagedweight.backend import PagedWeightBackend
from engines.pagedweight.controller import PageBudget, PagedController, PagedExperts
from engines.pagedweight.importance import SIGNALS, Importance
from engines.runtime.budget import OFFLOAD_FIX, Claim
from engines.runtime.copies import CopyEngine
from engines.runtime.engine import EngineParts, KVPool, Loaded, RuntimeConfig, RuntimeEngine, load_dense
from engines.runtime.mxfp4 import is_mxfp4
from engines.runtime.mxfp4_parts import Mxfp4Loaded, load_mxfp4

REPRESENTATIONS = ("bitplanes", "requantize")
DEFAULT_BITS = "16,8,4,3,2"
DEFAULT_MXFP4_BITS = "mxfp4,3,2"  # an MXFP4 checkpoint: its own width, then lower ones


@dataclass(frozen=True)
class PagedWeightConfig(RuntimeConfig):
    representation: str = "bitplanes"  # bitplanes | requantize
    # Widths an expert may hold on the device (16 = full precision; mxfp4 = an MXFP4 checkpoint's
    # own). None: 16,8,4,3,2, or mxfp4,3,2 on an MXFP4 checkpoint.
    bits: str | None = None
    floor_bits: int = 2  # no expert below this (0: experts may leave the device)
    # Quality floors: no expert at a width whose measured relative output error (its
    # sensitivity, squared error over squared output on calibration activations) exceeds this;
    # 0.01 is about 20 dB SNR, ~4-bit RTN on the demo model. None: any width down to floor_bits.
    max_expert_error: float | None = 0.01
    # Inputs per quantization group (32, 64 or 128); one that does not divide every expert input
    # width is replaced by the largest that does, or rows are padded to whole groups (see the notes).
    group_size: int = 32
    importance_decay: float = 0.9  # EMA of each expert's routing-mass share, per step
    # What an expert's importance is: "mass" (its share of the router's weights) or "tokens" (its
    # share of the token assignments). A simulated run has no routing weights: it uses tokens.
    importance_from: str = "mass"
    hysteresis: float = 0.02  # an optional re-plan must lower the expected cost by this share
    min_residence_steps: int = 8  # steps an expert keeps a width before an optional change
    # Steps between the arbiter's optional re-plans (its fresh greedy, the bulk of the control
    # code's CPU per step; a step whose page capacity changed re-plans too); forced demotions and
    # moves toward the adopted goal run every step. 1: every step (the decisions before the knob);
    # 4 measured harmless (docs/pagedweight.md, "Control cost per step").
    replan_every: int = 4
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
    # --simulate: where the experts' sensitivities come from (none are measured): a JSON file (a
    # table a measured run wrote, {"layer,expert": {"bits": err}} or {"bits": err}) or an inline
    # table "8:2e-5,4:0.008,3:0.03,2:0.11"; None: the bundled demo model's measured mean curve.
    sim_sensitivity: str | None = None



def parse_bits(text: str | None, floor: int, mxfp4: bool = False) -> tuple[int, ...]:
    """The widths `text` names, widest first. On an MXFP4 checkpoint (`mxfp4`) "mxfp4" (or 4,
    the same width) is its own and must be there; elsewhere 16 must be, and mxfp4 is refused."""
    from engines.pagedweight.formats import MXFP4, MXFP4_NAME  # noqa: PLC0415

    if text is None:
        text = DEFAULT_MXFP4_BITS if mxfp4 else DEFAULT_BITS
    words = [w.strip().lower() for w in str(text).split(",") if w.strip()]
    if MXFP4_NAME in words and not mxfp4:
        raise EngineError("engine pagedweight: bits names mxfp4, the width of gpt-oss MXFP4 checkpoints only; this "
                          "model's experts are full precision: use widths among 16,8,4,3,2")
    try:
        bits = tuple(sorted({MXFP4 if w == MXFP4_NAME else int(w) for w in words}, reverse=True))
    except ValueError:
        raise EngineError(f"engine pagedweight: bits must be comma-separated integers{' or mxfp4' if mxfp4 else ''}, "
                          f"got {text!r}") from None
    bad = [b for b in bits if b not in (16, 8, 4, 3, 2)]
    if mxfp4 and (bad or MXFP4 not in bits):
        raise EngineError(f"engine pagedweight: on an MXFP4 checkpoint bits must include mxfp4 (its own width) and be "
                          f"among 16,8,mxfp4,3,2 (16 and 8 only add bytes to its values), e.g. mxfp4,3,2; "
                          f"got {text!r}")
    if bad or 16 not in bits and not mxfp4:
        raise EngineError(f"engine pagedweight: bits must include 16 and be among 16,8,4,3,2; got {text!r}")
    if floor not in (0, *bits):
        raise EngineError(f"engine pagedweight: floor_bits must be 0 or one of {bits}, got {floor}")
    return bits


def bits_text(bits: tuple[int, ...], mxfp4: bool) -> str:
    """The widths as `bits` writes them (mxfp4 by name)."""
    from engines.pagedweight.formats import width_name  # noqa: PLC0415

    return ",".join(width_name(b, mxfp4) for b in bits)


def calibration_prompts(cfg: PagedWeightConfig, name: str) -> int | list[list[int]]:
    if cfg.calib_file is None:
        return cfg.calib_prompts
    try:
        prompts = json.loads(Path(cfg.calib_file).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineError(f"engine {name}: cannot read calib_file {cfg.calib_file}: {exc}") from None
    if not isinstance(prompts, list) or not all(isinstance(p, list) and all(isinstance(t, int) for t in p)
                                                for p in prompts):
        raise EngineError(f"engine {name}: calib_file {cfg.calib_file} must hold a JSON list of token-id lists")
    return prompts


def paged_experts(cfg: PagedWeightConfig, loaded: Loaded, name: str) -> PagedExperts:
    """The experts' host-tier stores, their measured sensitivities and quality floors, and the
    backend over them (nothing on the device yet). From an `Mxfp4Loaded` (an MXFP4 checkpoint)
    the stores hold its experts as stored (formats.Mxfp4Store) and `loaded.experts`, their
    dequantized values, are the master the calibration and the lower widths start from."""
    from engines.pagedweight.formats import Mxfp4Store, fit_group_size, make_store  # noqa: PLC0415
    from engines.pagedweight.sensitivity import load_or_measure  # noqa: PLC0415
    from engines.pagedweight.simulated import meta_stores, simulated_sensitivity  # noqa: PLC0415
    from engines.quant.qweight import QuantFormatError  # noqa: PLC0415

    if cfg.budget_bytes is None:
        raise EngineError(f"engine {name} needs a device budget (--budget SIZE)")
    if cfg.representation not in REPRESENTATIONS:
        raise EngineError(f"engine {name}: representation must be one of {', '.join(REPRESENTATIONS)}, "
                          f"got {cfg.representation!r}")
    mxfp4 = isinstance(loaded, Mxfp4Loaded)
    widths = parse_bits(cfg.bits, cfg.floor_bits, mxfp4)
    bound = cfg.max_expert_error
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound > 0):
        raise EngineError(f"engine {name}: max_expert_error must be a number > 0 (e.g. 0.01) or none, got {bound!r}")
    dense = loaded.experts
    notes: list[str] = []
    group_size = cfg.group_size
    exact = tuple(b for b in widths if b == 16 or mxfp4 and b == 4)  # the master's own values
    if any(b not in exact for b in widths):
        inputs = {n for w in dense.values() for n in (w.gate_up.shape[-1], w.down.shape[-1])}  # D and I
        try:  # the asked size, else one that fits every expert input width, said in the notes
            group_size, note = fit_group_size(cfg.group_size, sorted(inputs), cfg.representation)
        except QuantFormatError as exc:
            raise EngineError(f"engine {name}: {exc}") from None
        notes += [note] if note else []
    copies = CopyEngine(loaded.ledger, loaded.device, cfg.link_gbps)

    def store(i: int, e: int):
        if mxfp4:
            return Mxfp4Store(loaded.packed[i].expert(e), widths, cfg.representation, group_size, copies.host,
                              loaded.dtype)
        w = dense[i]
        biases = [None if b is None else b[e] for b in (w.gate_up_bias, w.down_bias)]
        return make_store(cfg.representation, w.gate_up[e], w.down[e], widths, group_size, copies.host,
                          gate_up_bias=biases[0], down_bias=biases[1], clamp=w.clamp)

    simulated = loaded.device.type == "meta"  # --simulate: shapes, no data
    keys = [(i, e) for i, w in dense.items() for e in range(w.num_experts)]
    signal = getattr(cfg, "importance_from", "mass")
    if signal not in SIGNALS:
        raise EngineError(f"engine {name}: importance_from must be one of {', '.join(SIGNALS)}, got {signal!r}")
    try:
        if simulated:  # the same format code on meta tensors, once per expert shape (formats.py's bytes)
            def signature(i: int, e: int) -> tuple:
                t = (loaded.packed[i].expert(e).tensors() if mxfp4 else
                     {"gate_up": dense[i].gate_up[e], "down": dense[i].down[e],
                      "gate_up_bias": None if dense[i].gate_up_bias is None else dense[i].gate_up_bias[e],
                      "down_bias": None if dense[i].down_bias is None else dense[i].down_bias[e]})
                return (*((k, None if v is None else (tuple(v.shape), v.dtype)) for k, v in sorted(t.items())),
                        dense[i].clamp)

            stores = meta_stores(keys, store, signature)
        else:
            stores = {key: store(*key) for key in keys}
    except QuantFormatError as exc:
        raise EngineError(f"engine {name}: {exc}") from None
    if simulated:
        table, note = simulated_sensitivity(getattr(cfg, "sim_sensitivity", None), keys, widths, exact,
                                            cfg.representation)
        notes.append(note)
        if signal != "tokens":
            signal = "tokens"
            notes.append("simulated: expert importance from routing token shares (importance_from tokens): a "
                         "simulated router gives choices, not routing weights")
    else:
        table = load_or_measure(loaded.checkpoint, dense, loaded.weights, cfg.representation, widths, group_size,
                                prompts=calibration_prompts(cfg, name), device=loaded.device, dtype=loaded.dtype,
                                exact=exact)
    sensitivity = {k: dict(v) for k, v in table.items()}
    importance = Importance({i: w.num_experts for i, w in dense.items()}, cfg.importance_decay, signal=signal)
    # The lowest width whose measured error is within max_expert_error (the master's always is).
    quality = {key: min(b for b in widths if bound is None or b in exact or sensitivity[key][b] <= bound)
               for key in stores}
    floors = {key: max(cfg.floor_bits, q) if cfg.floor_bits else 0 for key, q in quality.items()}
    backend = PagedWeightBackend(stores, copies, loaded.device, importance, cfg.feedback_share, cfg.seed, mxfp4)
    backend.fetch_bits = dict(quality)  # an expert that left the device comes back at its quality floor
    if 0 in floors.values():
        backend.staging_bytes = backend.fetch_slots * backend.staging_slot_bytes()
    if mxfp4:
        notes.append(f"routed experts served from the checkpoint's MXFP4 (4.25 bits per weight) as stored; widths "
                     f"{bits_text(widths, True)}, lower ones quantized from its dequantized values")
    return PagedExperts(backend, widths, sensitivity, importance, quality, floors, group_size, notes, mxfp4)


def floor_claim(cfg: PagedWeightConfig, paged: PagedExperts, fix: str | None = None) -> Claim:
    """The least the pages hold: every expert at its floor, or the on-demand staging slots."""
    from engines.pagedweight.formats import width_name  # noqa: PLC0415

    widths = sorted(set(paged.floors.values()))
    slots = paged.backend.fetch_slots
    names = "/".join(width_name(b, paged.mxfp4) for b in widths)
    what = (f"every routed expert at its floor ({names} bits: floor_bits {cfg.floor_bits}, "
            f"max_expert_error {cfg.max_expert_error})" if cfg.floor_bits else
            "a staging slot for one expert fetched on demand at its quality floor" if slots == 1 else
            f"{slots} staging slots for experts fetched on demand at their quality floor (one copies while "
            "another computes)")
    return Claim(what, paged.floor_bytes(), fix)


def paged_claims(cfg: PagedWeightConfig, paged: PagedExperts, dense: int, fix: str | None = None) -> list[Claim]:
    """The dense weights beside the pages' floor (the KV's claim is the placement's)."""
    return [Claim("dense weights", dense), floor_claim(cfg, paged, fix)]


def paged_stats(paged: PagedExperts) -> dict[str, float]:
    """bytes_per_expert: the largest expert at its widest offered version (the master's)."""
    return {"bytes_per_expert": max(s.nbytes(max(s.bits)) for s in paged.backend.stores.values())}


def simulated_config(cfg: PagedWeightConfig, loaded: Loaded) -> PagedWeightConfig:
    """The options as a simulated run (meta device) takes them: no quality feedback (it compares
    the experts' outputs with the master's, and a simulated run computes none)."""
    if loaded.device.type != "meta" or not cfg.feedback_every:
        return cfg
    return dataclasses.replace(cfg, feedback_every=0)


def simulated_notes(loaded: Loaded) -> list[str]:
    if loaded.device.type != "meta":
        return []
    return ["simulated: quality feedback off (it recomputes sampled rows with the master and compares outputs; "
            "a simulated run computes none), so no fallbacks; request_bits is empty (a simulated step's routing "
            "has no per-row choices) and expert_usage's routing_mass is 0 (no routing weights)"]


def paged_load(engine: RuntimeEngine, cfg: PagedWeightConfig) -> Loaded:
    """pagedweight's and full's load: an MXFP4 checkpoint's experts as stored and their
    dequantized values (for the calibration and the lower widths); any other folder dense."""
    opened = engine.open(cfg)
    return load_mxfp4(opened, dequantized=True) if is_mxfp4(opened.checkpoint.config) else load_dense(opened)


class PagedWeightEngine(RuntimeEngine):
    name = "pagedweight"
    config_cls = PagedWeightConfig
    needs_calibration = True
    simulates = True
    sim_overhead_keys = ("pagedweight",)

    def load(self, cfg: PagedWeightConfig) -> Loaded:
        return paged_load(self, cfg)

    def build(self, cfg: PagedWeightConfig, loaded: Loaded) -> EngineParts:
        cfg = simulated_config(cfg, loaded)
        self.paged = paged = paged_experts(cfg, loaded, self.name)
        block, dense = loaded.kv_block_bytes(cfg.block_size), loaded.dense_bytes
        claims = [*paged_claims(cfg, paged, dense, OFFLOAD_FIX), Claim("one KV block", block)]
        room = PageBudget(cfg.budget_bytes, dense, block, kv_reserve_bytes=cfg.kv_reserve_bytes)
        # The KV pool is as large as the budget allows with every expert at its floor; each
        # step sets its capacity to what the weights leave then.
        kv = KVPool(on_device=True, weights_beside=dense + paged.floor_bytes())
        self.controller = PagedController(cfg, paged, room)
        return EngineParts(paged.backend, claims, kv, copies=paged.backend.copies, controllers=[self.controller],
                           stats=lambda: paged_stats(paged), notes=[*paged.notes, *simulated_notes(loaded)],
                           config=dataclasses.replace(cfg, group_size=paged.group_size,
                                                      bits=bits_text(paged.bit_widths, paged.mxfp4)))

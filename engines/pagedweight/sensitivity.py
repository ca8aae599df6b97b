"""Offline sensitivity of every routed expert to its bit width, measured once and cached.

sensitivity[(layer, expert)][bits] = ||f_b(x) - f(x)||^2 / ||f(x)||^2 over the expert's
calibration inputs x: the rows the router really sends it when the full-precision model runs
the calibration prompts (one flat prefill through the runtime's own MoEModel with a recording
expert backend; every layer computes at full precision, so each expert is measured with the
rest of the model exact: the additive cost model the arbiter assumes). f is the master, f_b
the store's version (engines/pagedweight/formats.py), both evaluated in float32 with the
expert's exact biases and the model's SwiGLU (gpt-oss's clamped one); 16 bits is 0. On an
MXFP4 checkpoint the master is the dequantized MXFP4 (all the checkpoint holds): its own width
(`exact`: formats.MXFP4) is 0 too, and the lower widths are measured against it.
At most `max_rows` evenly spaced rows per expert are used (they span every prompt). An expert
that got no calibration rows gets its layer's mean at each width (listed under "filled").

Calibration prompts must cover every task the model serves (calibrating on one task once
cost closed-book knowledge). Engines do not read workloads, so task prompts come from the
caller as token ids (for the demo model: RAG recall, chat recall and closed-book questions,
built from workloads.demo.tasks); a count asks for seeded random-token prompts instead,
which the demo model refuses (see `calibration_set`).

The table is a JSON file under $PWBENCH_CACHE/sensitivity (or ~/.cache/pwbench/sensitivity),
named by a hash of the model folder (config and weight files by name, size, mtime), the
representation, group size, widths, the calibration token ids, max_rows, device type and dtype.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from engines.base import EngineError
from engines.common.demo import DEMO_MODEL_DIR
from engines.common.device import dtype_name
from engines.common.folders import cache_dir as pwbench_cache
from engines.pagedweight.formats import FULL, PAGED_BITS, make_store
from engines.quant.calibrate import random_prompts
from engines.runtime.attention import AttentionBatch, PrefillSegment
from engines.runtime.checkpoint import Checkpoint
from engines.runtime.config import ModelConfig
from engines.runtime.experts import (
    Dispatch,
    StackedBackend,
    grouped_swiglu,
    segments,
    swiglu,
)
from engines.runtime.kv_cache import PagedKVCache
from engines.runtime.model import MoEModel
from engines.runtime.transfer import TransferLedger
from engines.runtime.weights import DenseExperts, ModelWeights

SCHEMA = 2  # bump when the measurement changes: old tables then miss the cache (2: expert biases, clamp)
MAX_ROWS = 512
PROMPT_LEN = 256  # tokens per random calibration prompt (capped by the model's length)
BLOCK = 16  # KV block size of the calibration pass

Key = tuple[int, int]  # (layer, expert)
Table = dict[Key, dict[int, float]]


@dataclass(frozen=True)
class Calibration:
    """The prompts (token ids) and a description of where they came from (kept in the file)."""

    prompts: tuple[tuple[int, ...], ...]
    source: dict[str, object]

    @property
    def fingerprint(self) -> str:
        """sha256 of the token ids: two calibrations share a table exactly when they match."""
        h = hashlib.sha256()
        for p in self.prompts:
            h.update(json.dumps(p).encode())
        return h.hexdigest()[:16]


def is_demo_language(checkpoint: Checkpoint) -> bool:
    """A model trained by `pwbench demo train` (the bundled one, or a folder it wrote)."""
    path = checkpoint.path.resolve()
    return path == DEMO_MODEL_DIR.resolve() or (path / "training.json").is_file()


def calibration_set(checkpoint: Checkpoint, prompts: int | Sequence[Sequence[int]], seed: int = 0,
                        length: int = PROMPT_LEN) -> Calibration:
    """Given token-id prompts as they are, or `prompts` seeded random-token prompts of
    `length` tokens (never EOS). A demo-language model needs its task mix: a count raises."""
    cfg = checkpoint.config
    if isinstance(prompts, int):
        if is_demo_language(checkpoint):
            raise EngineError(
                f"{checkpoint.path} is a demo-language model: its sensitivities must be calibrated on the "
                "tasks it serves (RAG recall, chat recall and closed-book questions together), which engines "
                "cannot build (they do not read workloads); pass those prompts as token ids (prompts=[[...], ...])"
            )
        if prompts < 1:
            raise EngineError(f"sensitivity calibration needs at least one prompt, got {prompts}")
        n = min(length, cfg.max_position_embeddings)
        ids = random_prompts(cfg.vocab_size, prompts, n, seed, cfg.eos_token_ids)
        return Calibration(tuple(map(tuple, ids)), {"source": "random tokens", "samples": prompts, "length": n,
                                                    "seed": seed})
    given = tuple(tuple(int(t) for t in p) for p in prompts)
    if not given or not all(given):
        raise EngineError("sensitivity calibration needs at least one non-empty prompt")
    longest = max(map(len, given))
    if longest > cfg.max_position_embeddings:
        raise EngineError(f"a calibration prompt has {longest} tokens; the model takes at most "
                          f"{cfg.max_position_embeddings}")
    bad = next((t for p in given for t in p if not 0 <= t < cfg.vocab_size), None)
    if bad is not None:
        raise EngineError(f"calibration token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
    return Calibration(given, {"source": "given", "samples": len(given), "tokens": sum(map(len, given))})


# --- measuring --------------------------------------------------------------------------------


class _Recorder(StackedBackend):
    """The calibration pass's expert backend: hands each expert's routed rows to `measure`
    and returns the full-precision layer output."""

    def __init__(self, dense: Mapping[int, DenseExperts], measure: Callable[[int, int, Tensor], None]) -> None:
        super().__init__(dense)
        self.dense, self.measure = dense, measure

    def forward(self, layer: int, x: Tensor, d: Dispatch) -> Tensor:
        for e, rows in segments(d).items():
            self.measure(layer, e, x[d.token_index[rows]])
        return grouped_swiglu(x, d, self.dense[layer])


def _prefill_batch(config: ModelConfig, lengths: list[int], dtype: torch.dtype,
                   ledger: TransferLedger) -> tuple[PagedKVCache, AttentionBatch]:
    """Every prompt a prefill segment from position 0 with blocks of its own (correct with or
    without sliding windows; the cache is only written, never read across prompts)."""
    per_prompt = [-(-n // BLOCK) for n in lengths]
    kv = PagedKVCache.for_model(config, sum(per_prompt), BLOCK, dtype, ledger.device)
    slots: list[int] = []
    prefills, row, first = [], 0, 0
    for n, nb in zip(lengths, per_prompt):
        slots += range(first * BLOCK, first * BLOCK + n)
        prefills.append(PrefillSegment(row, n, 0, ledger.tensor(list(range(first, first + nb)), torch.long)))
        row, first = row + n, first + nb
    return kv, AttentionBatch(slots=ledger.tensor(slots, torch.long), num_decode=0, prefills=prefills)


def _spread(x: Tensor, max_rows: int) -> Tensor:
    """At most max_rows rows, evenly spaced: the flat batch is prompt after prompt, so a prefix
    would see only the first prompts (often one task)."""
    n = x.shape[0]
    if n <= max_rows:
        return x
    return x[torch.arange(max_rows, device=x.device) * n // max_rows]


@dataclass(frozen=True)
class Measured:
    table: Table
    rows: dict[Key, int]  # calibration rows measured per expert (after the cap)
    filled: tuple[Key, ...]  # experts with no rows: given their layer's mean
    tokens: int
    seconds: float


def measure(config: ModelConfig, dense: Mapping[int, DenseExperts], weights: ModelWeights, representation: str,
            bits: Sequence[int], group_size: int, calibration: Calibration, max_rows: int = MAX_ROWS,
            exact: Sequence[int] = (FULL,)) -> Measured:
    """Run the calibration prompts through the full-precision model and measure every expert's
    relative output error at each width in `bits` (see the module docstring); widths in `exact`
    are the master's own values (error 0)."""
    t0 = time.perf_counter()
    widths = tuple(sorted(set(bits), reverse=True))
    quantized = [b for b in widths if b not in exact]
    bad = [b for b in widths if b not in PAGED_BITS]
    if bad or not widths:
        raise EngineError(f"sensitivity: bits must be among {PAGED_BITS}, got {list(bits)}")
    table: Table = {}
    rows: dict[Key, int] = {}

    def record(layer: int, e: int, x: Tensor) -> None:
        w = dense[layer]
        x = _spread(x, max_rows).float()
        # The store quantizes the master in its own dtype (as the engine's does); both outputs
        # in float32 so the error is the quantization's, not the model dtype's rounding.
        # Biases (gpt-oss) stay exact in every version and the clamp is the model's: both
        # outputs are the expert's real SwiGLU, only the weights differ.
        biases = [None if b is None else b[e] for b in (w.gate_up_bias, w.down_bias)]
        store = make_store(representation, w.gate_up[e], w.down[e], quantized, group_size, gate_up_bias=biases[0],
                           down_bias=biases[1], clamp=w.clamp) if quantized else None
        ref = swiglu(x, w.gate_up[e].float(), w.down[e].float(), *(None if b is None else b.float() for b in biases),
                     w.clamp)
        norm = ref.pow(2).sum().clamp(min=1e-30)
        out = {b: 0.0 for b in widths if b in exact}
        for b in quantized:
            y = store.version(b).dense_forward(x)  # type: ignore[union-attr]
            out[b] = float((y - ref).pow(2).sum() / norm)
        table[(layer, e)] = out
        rows[(layer, e)] = x.shape[0]

    device, dtype = weights.embed.device, weights.embed.dtype
    ledger = TransferLedger(device)
    prompts = calibration.prompts
    kv, batch = _prefill_batch(config, [len(p) for p in prompts], dtype, ledger)
    model = MoEModel(config, weights, _Recorder(dense, record), kv, ledger)
    ids = ledger.tensor([t for p in prompts for t in p], torch.long)
    positions = ledger.tensor([j for p in prompts for j in range(len(p))], torch.long)
    model.forward(ids, positions, batch, ledger.tensor([ids.numel() - 1], torch.long))
    filled = _fill(table, dense, widths)
    return Measured(table, rows, filled, ids.numel(), time.perf_counter() - t0)


def _fill(table: Table, dense: Mapping[int, DenseExperts], widths: tuple[int, ...]) -> tuple[Key, ...]:
    """Experts the calibration never routed to get their layer's mean sensitivity per width."""
    missing = [(i, e) for i, w in dense.items() for e in range(w.num_experts) if (i, e) not in table]
    if not table:
        raise EngineError("sensitivity: the calibration prompts routed no token to any expert")
    for i, e in missing:
        measured = [v for (layer, _), v in table.items() if layer == i] or list(table.values())
        table[(i, e)] = {b: sum(v[b] for v in measured) / len(measured) for b in widths}
    return tuple(sorted(missing))


# --- the cache --------------------------------------------------------------------------------


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return pwbench_cache("sensitivity")


def cache_key(checkpoint: Checkpoint, representation: str, bits: Sequence[int], group_size: int,
              calibration: Calibration, max_rows: int, device: torch.device, dtype: torch.dtype,
              exact: Sequence[int] = (FULL,)) -> dict:
    """Everything the table depends on. Weight files are stamped by name, size and mtime (as the
    quantized-folder cache does): hashing gigabytes of safetensors at every start would cost
    more than measuring."""
    files = sorted({*checkpoint.key_files.values(), checkpoint.path / "config.json"})
    return {
        "schema": SCHEMA, "model": str(checkpoint.path.resolve()),
        "files": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files],
        "representation": representation, "group_size": group_size, "bits": sorted(set(bits), reverse=True),
        "calibration": calibration.fingerprint, "max_rows": max_rows, "device": device.type,
        "dtype": dtype_name(dtype),
        **({"exact": sorted(set(exact), reverse=True)} if tuple(exact) != (FULL,) else {}),
    }


def cache_file(root: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"{key['representation']}-{digest}.json"


def _write(path: Path, key: dict, calibration: Calibration, m: Measured) -> None:
    doc = {
        "key": key, "calibration": calibration.source, "tokens": m.tokens, "seconds": round(m.seconds, 3),
        "filled": [f"{i},{e}" for i, e in m.filled],
        "rows": {f"{i},{e}": n for (i, e), n in sorted(m.rows.items())},
        "sensitivity": {f"{i},{e}": {str(b): v for b, v in row.items()} for (i, e), row in sorted(m.table.items())},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)  # atomic: a concurrent start reads the old file or the new, never half


def _read(path: Path, key: dict, dense: Mapping[int, DenseExperts]) -> Table | None:
    """The cached table, or None when absent, unreadable, for another key, or incomplete."""
    try:
        doc = json.loads(path.read_text())
        if doc.get("key") != json.loads(json.dumps(key)):
            return None
        table = {tuple(map(int, k.split(","))): {int(b): float(v) for b, v in row.items()}
                 for k, row in doc["sensitivity"].items()}
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    widths = set(key["bits"])
    want = {(i, e) for i, w in dense.items() for e in range(w.num_experts)}
    if set(table) != want or any(set(row) != widths for row in table.values()):
        return None
    return table  # type: ignore[return-value]


def load_or_measure(checkpoint: Checkpoint, dense: Mapping[int, DenseExperts], weights: ModelWeights,
                    representation: str, bits: Sequence[int], group_size: int = 32, *,
                    prompts: int | Sequence[Sequence[int]] = 24, seed: int = 0, prompt_len: int = PROMPT_LEN,
                    max_rows: int = MAX_ROWS, device: torch.device | None = None, dtype: torch.dtype | None = None,
                    cache_dir: str | Path | None = None, exact: Sequence[int] = (FULL,)) -> Table:
    """{(layer, expert): {bits: relative output error}} for every routed expert and width in
    `bits` (those in `exact`, 16 by default: 0.0), read from the cache or measured now and
    written there. `dense` and `weights` are the full-precision model as loaded (on the device
    it runs on; an MXFP4 checkpoint's experts dequantized)."""
    device = device if device is not None else weights.embed.device
    dtype = dtype if dtype is not None else weights.embed.dtype
    calibration = calibration_set(checkpoint, prompts, seed, prompt_len)
    key = cache_key(checkpoint, representation, bits, group_size, calibration, max_rows, torch.device(device), dtype,
                    exact)
    path = cache_file(cache_root(cache_dir), key)
    table = _read(path, key, dense)
    if table is not None:
        return table
    m = measure(checkpoint.config, dense, weights, representation, bits, group_size, calibration, max_rows, exact)
    _write(path, key, calibration, m)
    return m.table


def load_or_measure_engine(engine, representation: str, bits: Sequence[int], group_size: int = 32,
                           **options) -> Table:
    """load_or_measure for a started `moe` engine serving full precision (its resident experts
    are the masters)."""
    experts = engine.experts
    if getattr(engine.config, "expert_bits", None) not in (None, FULL) or not hasattr(experts, "weights"):
        raise EngineError("sensitivity needs a started moe engine at full precision (no expert_bits)")
    dense = {i: experts.weights(i) for i in experts.layers()}
    if not all(isinstance(w, DenseExperts) for w in dense.values()):
        raise EngineError("sensitivity needs the engine's experts as full-precision DenseExperts")
    return load_or_measure(engine.checkpoint, dense, engine.weights, representation, bits, group_size,
                           device=engine.device, dtype=engine.dtype, **options)

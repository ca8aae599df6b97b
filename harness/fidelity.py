"""Quality per request against full precision, on what was served.

The reference answer to a request is the float32 `moe` reference engine's greedy output (up to EOS) for
the same prompt and length, computed one request at a time with no device budget (batch-size
independent numerics: the canonical answer). A run's request is compared with it token by
token: identical or not, where it first diverges, the share of positions that match, and for
requests that carry a task a *flip*: right in the reference and wrong here ("lost"), or the
reverse ("gained"). Runs are greedy (the harness sends no sampling parameters), so an exact
comparison is the right one; a sampled run would need distributions instead and is not
compared.

Reference outputs are cached in a folder (the suite's `reference/`), one JSON file per request
set, keyed by the model folder's identity and the requests' contents: every engine of a suite,
and every repeat, reuses one computation.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.base import EngineRequest
from harness.offline import cut_at_eos

REFERENCE_TEXT = "float32 moe reference on the CPU, no budget, greedy, one request at a time"
COLUMNS = ("correct", "ref_correct", "ref_identical", "ref_divergence", "ref_token_match", "flip")


@dataclass(frozen=True)
class OutputMatch:
    identical: bool
    divergence: int | None  # first position that differs; None when identical
    token_match: float  # matching positions / the longer output's length (1.0 for two empty outputs)


def compare_output(output: Sequence[int], reference: Sequence[int]) -> OutputMatch:
    a, b = list(output), list(reference)
    if a == b:
        return OutputMatch(True, None, 1.0)
    same = sum(x == y for x, y in zip(a, b))
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return OutputMatch(False, first, same / max(len(a), len(b)))


def answer_ids(ids: Sequence[int], eos_ids: Collection[int]) -> list[int]:
    """A request's answer, for comparison: its ids up to the first EOS. A request sent with
    ignore_eos (a trace's output length kept exact) generates past it, but the answer a user
    reads ends there."""
    return cut_at_eos(list(ids), eos_ids)


def _model_identity(model: str) -> dict[str, Any]:
    folder = Path(model)
    files = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
    return {"model": str(folder.resolve()),
            "files": [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in files]}


def cache_key(model: str, requests: Sequence[EngineRequest]) -> str:
    h = hashlib.sha256(json.dumps(_model_identity(model), sort_keys=True).encode())
    for r in requests:
        h.update(json.dumps([r.request_id, list(r.prompt_ids), r.max_new_tokens, r.ignore_eos]).encode())
    return h.hexdigest()[:20]


def reference_outputs(model: str, requests: Sequence[EngineRequest], cache: Path | None = None,
                      eos_ids: Collection[int] | None = None) -> dict[str, list[int]]:
    """request id -> the reference's greedy answer ids (cut at EOS; EOS ids default to the
    reference engine's own), from `cache` when it holds them."""
    from engines.registry import REFERENCE_ENGINE, REFERENCE_OPTIONS, create_engine  # noqa: PLC0415
    from harness.offline import run_offline  # noqa: PLC0415

    path = Path(cache) / f"{cache_key(model, requests)}.json" if cache is not None else None
    if path is not None and path.is_file():
        return {k: list(v) for k, v in json.loads(path.read_text())["outputs"].items()}
    engine = create_engine(REFERENCE_ENGINE, {"model": model, **REFERENCE_OPTIONS})
    engine.start()
    try:
        eos = set(engine.info().eos_token_ids) if eos_ids is None else set(eos_ids)
        out = {}
        for r in requests:
            done = run_offline(engine, [EngineRequest(r.request_id, tuple(r.prompt_ids), r.max_new_tokens,
                                                      ignore_eos=r.ignore_eos)])
            out[r.request_id] = answer_ids(done[r.request_id].output_ids, eos)
    finally:
        engine.stop()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"reference": REFERENCE_TEXT, "model": model, "outputs": out}))
        tmp.replace(path)
    return out


def request_columns(row: Mapping[str, Any], reference: Sequence[int] | None, eos_ids: Collection[int],
                    reference_text: str | None = None) -> dict[str, Any]:
    """The fidelity columns of one requests.parquet row. Unserved requests (an error, or no
    finish) and requests without a reference get None in every column: capacity is reported
    apart from quality. `reference_text` is the reference's decoded answer, for task flips."""
    from workloads.demo.tasks import score  # noqa: PLC0415

    out: dict[str, Any] = dict.fromkeys(COLUMNS)
    served = not row.get("error") and row.get("finish_s") is not None
    answer, text = row.get("answer"), row.get("output_text")
    if served and answer is not None and text is not None:
        out["correct"] = bool(score(text, answer))
    if not served or reference is None:
        return out
    match = compare_output(answer_ids(row.get("output_ids") or [], eos_ids), reference)
    out.update(ref_identical=match.identical, ref_divergence=match.divergence, ref_token_match=match.token_match)
    if out["correct"] is not None and reference_text is not None:
        out["ref_correct"] = bool(score(reference_text, answer))
        if out["ref_correct"] != out["correct"]:
            out["flip"] = "lost" if out["ref_correct"] else "gained"
    return out


def fidelity_summary(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Fidelity over the measured requests that were served and compared; None when none was."""
    rows = [r for r in rows if not r.get("warmup") and r.get("ref_identical") is not None]
    if not rows:
        return None
    identical = sum(bool(r["ref_identical"]) for r in rows)
    served_tasks = [r for r in rows if r.get("correct") is not None]
    return {
        "compared": len(rows),
        "identical": identical,
        "fidelity": identical / len(rows),
        "flips_lost": sum(r.get("flip") == "lost" for r in rows),
        "flips_gained": sum(r.get("flip") == "gained" for r in rows),
        "token_match_mean": sum(float(r["ref_token_match"]) for r in rows) / len(rows),
        "accuracy_served": (sum(bool(r["correct"]) for r in served_tasks) / len(served_tasks)
                            if served_tasks else None),
        "reference": REFERENCE_TEXT,
    }

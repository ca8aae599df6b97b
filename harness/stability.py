"""Output stability under load: the same prompts, answered greedily at three background loads,
compared with each other and with the full-precision reference.

A probe set (a few fixed prompts, fixed max_new_tokens) is answered `repeats` times at each
load: "idle" (each probe alone, a batch of one), "near capacity" (background traffic retimed
to the given capacity rate) and "above capacity" (`above` x that rate). Under load the probe
requests go through the run loop at evenly spread arrival times among the background
requests, repeat by repeat, so each repeat meets the traffic at another moment. Per load:
unique completions per probe, answers that differ from the reference (flips), for probes with
answers the right/wrong flips, and the first token where an answer leaves the reference. An
engine whose precision never changes (no `mean_bits` series, or one value) and still varies
shows batch-dependent numerics, which the finding says. Outputs are compared as answers, cut
at the first EOS even for probes that ignore it (harness/fidelity.py's `answer_ids`), the way
`reference_outputs` there cuts the reference.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engines.base import Engine, EngineInfo, EngineRequest
from harness.capacity import retime
from harness.errors import HarnessError
from harness.fidelity import answer_ids, compare_output
from harness.offline import run_offline
from harness.runner import Runner
from workloads.base import Request

LOADS = ("idle", "near capacity", "above capacity")


@dataclass(frozen=True)
class Probe:
    probe_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    answer: str | None = None  # the right answer's text, for probes that are tasks
    ignore_eos: bool = False

    def request(self, request_id: str | None = None) -> EngineRequest:
        """The greedy request for this probe (also what the reference is computed from)."""
        return EngineRequest(request_id or self.probe_id, self.prompt_ids, self.max_new_tokens,
                             ignore_eos=self.ignore_eos)


@dataclass(frozen=True)
class ProbeSet:
    probes: tuple[Probe, ...]
    decode: Callable[[list[int]], str] | None = None  # token ids -> text, for scoring task probes


def demo_probes(count: int = 8, seed: int = 0) -> ProbeSet:
    """Closed-book questions of the demo language ("question : the color of X" -> "red"): short
    prompts whose answers live in the weights, stopped at EOS, scored by exact match."""
    from workloads.demo.language import BOS_ID, demo_language  # noqa: PLC0415
    from workloads.demo.tasks import closed_book  # noqa: PLC0415

    lang = demo_language()
    sample = closed_book(random.Random(f"stability-{seed}"), count)
    probes = tuple(Probe(f"p{i}", (BOS_ID, *lang.encode(q)), len(a.split()) + 2, a)
                   for i, (q, a) in enumerate(sample.qa))
    return ProbeSet(probes, lang.decode)


def random_probes(vocab_size: int, special_ids: Sequence[int] = (), count: int = 8,
                  prompt_tokens: tuple[int, int] = (16, 48), max_new_tokens: int = 8, seed: int = 0) -> ProbeSet:
    """Seeded random-token prompts (no special ids) of `prompt_tokens` lengths, generating
    `max_new_tokens` tokens past any EOS (compared up to the first one): for models without a
    task language."""
    rng = random.Random(f"stability-{seed}")
    ids = [t for t in range(vocab_size) if t not in set(special_ids)]
    if not ids:
        raise HarnessError(f"stability probes: a vocabulary of {vocab_size} ids has none outside the special ids")
    probes = tuple(Probe(f"p{i}", tuple(rng.choice(ids) for _ in range(rng.randint(*prompt_tokens))),
                         max_new_tokens, ignore_eos=True) for i in range(count))
    return ProbeSet(probes)


def probes_for(model: str | None, info: EngineInfo, count: int = 8, seed: int = 0) -> ProbeSet:
    """Demo closed-book probes for a demo-language model, random-token probes otherwise."""
    from harness.demo_model import uses_demo_language  # noqa: PLC0415

    if uses_demo_language(model, info):
        return demo_probes(count, seed)
    return random_probes(info.vocab_size, info.eos_token_ids, count, seed=seed)


@dataclass(frozen=True)
class LoadStability:
    name: str
    rate: float  # background requests per second (0 at idle)
    unique_completions_mean: float
    probes_varying: int  # probes with more than one distinct output at this load
    flips: int  # answers (probe x repeat) that differ from the reference output
    first_divergence_min: int | None  # earliest token where any answer leaves the reference
    task_flips: int | None = None  # answers right where the reference is wrong, or the reverse
    bits: tuple[float, float] | None = None  # lowest and highest mean expert bits of the load's steps

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rate": self.rate, "unique_completions_mean": self.unique_completions_mean,
                "probes_varying": self.probes_varying, "flips": self.flips,
                "first_divergence_min": self.first_divergence_min}


@dataclass(frozen=True)
class Stability:
    probes: int
    repeats: int
    loads: tuple[LoadStability, ...]
    finding: str
    # load name -> probe id -> one output (token ids, cut at EOS) per repeat that finished
    outputs: dict[str, dict[str, list[list[int]]]] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"probes": self.probes, "repeats": self.repeats, "loads": [x.to_dict() for x in self.loads],
                "finding": self.finding}


def summarize_load(name: str, rate: float, outputs: Mapping[str, Sequence[Sequence[int]]],
                   reference: Mapping[str, Sequence[int]], answers: Mapping[str, str] | None = None,
                   decode: Callable[[list[int]], str] | None = None,
                   bits: tuple[float, float] | None = None) -> LoadStability:
    from workloads.demo.tasks import score  # noqa: PLC0415

    uniques = [len({tuple(o) for o in outs}) for outs in outputs.values()]
    positions = [compare_output(o, reference[pid]).divergence for pid, outs in outputs.items() for o in outs]
    flips = sum(p is not None for p in positions)
    task_flips = None
    if decode is not None and answers:
        task_flips = sum(score(decode(list(o)), answers[pid]) != score(decode(list(reference[pid])), answers[pid])
                         for pid, outs in outputs.items() if pid in answers for o in outs)
    return LoadStability(name, rate, sum(uniques) / len(uniques) if uniques else 0.0, sum(u > 1 for u in uniques),
                         flips, min((p for p in positions if p is not None), default=None), task_flips, bits)


def finding(loads: Sequence[LoadStability], outputs: Mapping[str, Mapping[str, Sequence[Sequence[int]]]],
            reference: Mapping[str, Sequence[int]], probes: int) -> str:
    """One sentence: whether answers moved with load, and whether precision did."""
    seen: dict[str, set[tuple[int, ...]]] = {}
    for per_probe in outputs.values():
        for pid, outs in per_probe.items():
            seen.setdefault(pid, set()).update(tuple(o) for o in outs)
    varying = sum(len(s) > 1 for s in seen.values())
    widths = [b for x in loads if x.bits is not None for b in x.bits]
    changed = bool(widths) and min(widths) < max(widths)
    flips = sum(x.flips for x in loads)
    earliest = min((x.first_divergence_min for x in loads if x.first_divergence_min is not None), default=None)
    if not varying and not flips:
        seen_bits = f" (mean expert bits {min(widths):g}-{max(widths):g})" if changed else ""
        return f"All {probes} probes gave the full-precision reference's output at every load and repeat{seen_bits}."
    if not varying:
        differ = sum(1 for pid, s in seen.items() if s and s != {tuple(reference[pid])})
        return (f"Every probe gave one output at every load, but {differ} of {probes} differ from the "
                f"full-precision reference at every load: a fixed precision difference, not a load effect.")
    if changed:
        return (f"{varying} of {probes} probes were answered differently as load changed the bit widths "
                f"({min(widths):g}-{max(widths):g} mean expert bits): {flips} answers differ from the full-precision "
                f"reference, the earliest at token {earliest}.")
    return (f"{varying} of {probes} probes were answered differently across loads or repeats although this "
            f"engine's precision did not change: batch-dependent numerics ({flips} answers differ from the "
            f"full-precision reference).")


def _bits(values: Sequence[float]) -> tuple[float, float] | None:
    return (min(values), max(values)) if values else None


def measure_stability(engine: Engine, probe_set: ProbeSet, reference: Mapping[str, Sequence[int]],
                      capacity_rps: float, background: Sequence[Request], repeats: int = 3, above: float = 1.5,
                      seed: int = 0, clock: Callable[[], float] = time.perf_counter,
                      sleep: Callable[[float], None] = time.sleep,
                      on_load: Callable[[LoadStability], None] | None = None) -> Stability:
    """Answer every probe `repeats` times at each of LOADS on the started `engine`, the
    background retimed to `capacity_rps` and `above` x it; `reference` maps probe ids to the
    full-precision greedy outputs. The prefix cache is emptied before each load."""
    probes = probe_set.probes
    if repeats < 1:
        raise HarnessError(f"--stability-repeats must be >= 1; got {repeats}")
    if not capacity_rps > 0:
        raise HarnessError(f"stability needs a capacity rate > 0 requests/s (--rate or --find-capacity); "
                           f"got {capacity_rps}")
    if not background:
        raise HarnessError("stability needs background requests for its loaded runs; give a workload with requests")
    missing = [p.probe_id for p in probes if p.probe_id not in reference]
    if missing:
        raise HarnessError(f"stability: no reference output for probe {missing[0]}; compute the reference for "
                           f"every probe")
    eos = tuple(engine.info().eos_token_ids)
    ref = {p.probe_id: answer_ids(reference[p.probe_id], eos) for p in probes}
    answers = {p.probe_id: p.answer for p in probes if p.answer is not None}
    outputs: dict[str, dict[str, list[list[int]]]] = {}
    loads = []
    for name, rate in zip(LOADS, (0.0, capacity_rps, capacity_rps * above)):
        engine.reset_prefix_cache()
        got: dict[str, list[list[int]]] = {p.probe_id: [] for p in probes}
        if rate == 0.0:
            bits: list[float] = []

            def on_step(out, bits=bits) -> None:
                if "mean_bits" in out.extras:
                    bits.append(float(out.extras["mean_bits"]))

            for r in range(repeats):
                for p in probes:
                    done = run_offline(engine, [p.request(f"probe-{p.probe_id}-idle-{r}")], on_step=on_step)
                    got[p.probe_id].append(answer_ids(next(iter(done.values())).output_ids, eos))
        else:
            traffic = [replace(b, request_id=f"bg-{b.request_id}") for b in retime(background, rate, seed)]
            span = max(b.arrival_s or 0.0 for b in traffic)
            items = [(r, p) for r in range(repeats) for p in probes]
            probe_requests = [Request(f"probe-{p.probe_id}-{r}", p.prompt_ids, p.max_new_tokens,
                                      arrival_s=span * (k + 0.5) / len(items), ignore_eos=p.ignore_eos)
                              for k, (r, p) in enumerate(items)]
            owner = {q.request_id: p.probe_id for q, (_, p) in zip(probe_requests, items)}
            requests = sorted([*traffic, *probe_requests], key=lambda q: q.arrival_s or 0.0)
            records = Runner(engine, requests, clock=clock, sleep=sleep).run()
            for rec in records.requests:
                if rec.request_id in owner and rec.error is None and rec.finish_s is not None:
                    got[owner[rec.request_id]].append(answer_ids(rec.output_ids, eos))
            bits = [float(s["x_mean_bits"]) for s in records.steps if "x_mean_bits" in s]
        outputs[name] = got
        load = summarize_load(name, rate, got, ref, answers, probe_set.decode, _bits(bits))
        loads.append(load)
        if on_load is not None:
            on_load(load)
    return Stability(len(probes), repeats, tuple(loads), finding(loads, outputs, ref, len(probes)), outputs)

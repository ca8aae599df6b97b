"""Quality against the full-precision model, no labels needed.

On a fixed seeded prompt set, both the engine under test and the float32 `moe` reference
return teacher-forced logits at every position; we report the mean per-token KL divergence
KL(reference || engine), the top-1 agreement, and each side's perplexity. For the demo model
the prompts are held-out demo-language text (so perplexity means something); for any other
model they are seeded random token sequences (KL and agreement still do).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch

from engines.base import Engine, EngineRequest
from harness.offline import run_offline


@dataclass(frozen=True)
class Quality:
    prompts: int
    tokens: int
    kl_mean: float  # nats per token, KL(reference || engine)
    top1_agreement: float
    perplexity: float
    reference_perplexity: float
    prompt_source: str

    def to_dict(self) -> dict:
        return asdict(self)


def quality_prompts(vocab_size: int, count: int = 16, length: int = 256, seed: int = 7) -> tuple[list[list[int]], str]:
    """Held-out demo text when the vocabulary is the demo language's, else random ids."""
    from workloads.demo.language import BOS_ID, demo_language  # noqa: PLC0415
    from workloads.demo.tasks import chat_recall, rag_recall  # noqa: PLC0415

    lang = demo_language()
    rng = random.Random(seed)
    if vocab_size == len(lang.vocab):
        prompts = []
        for i in range(count):
            make = rag_recall if i % 2 == 0 else chat_recall
            sample = make(rng, 8, length - 20)
            prompts.append([BOS_ID, *lang.encode(f"{sample.prompt} {sample.answer}")][:length])
        return prompts, "demo-language text (held-out RAG and chat)"
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)], "seeded random token ids"


def prompt_logits(engine: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    done = run_offline(engine, [EngineRequest(f"q{i}", tuple(ids), 1, ignore_eos=True, return_prompt_logits=True)
                                for i, ids in enumerate(prompts)])
    return [done[f"q{i}"].prompt_logits.float() for i in range(len(prompts))]


def compare(test: list[torch.Tensor], reference: list[torch.Tensor], prompts: list[list[int]], source: str) -> Quality:
    kl_sum, agree, nll, ref_nll, n = 0.0, 0, 0.0, 0.0, 0
    for t, r, ids in zip(test, reference, prompts):
        t, r = t[:-1].log_softmax(-1), r[:-1].log_softmax(-1)  # the last row predicts beyond the text
        targets = torch.tensor(ids[1:])[:, None]
        kl_sum += float((r.exp() * (r - t)).sum())
        agree += int((t.argmax(-1) == r.argmax(-1)).sum())
        nll -= float(t.gather(1, targets).sum())
        ref_nll -= float(r.gather(1, targets).sum())
        n += len(ids) - 1
    return Quality(len(prompts), n, kl_sum / n, agree / n, float(torch.exp(torch.tensor(nll / n))),
                   float(torch.exp(torch.tensor(ref_nll / n))), source)


def measure_quality(engine: Engine, reference: Engine, count: int = 16, length: int = 256) -> Quality:
    """Both engines started; the prompts fit both engines' max_model_len and KV capacity."""
    info = engine.info()
    # Prompts fit the engine's model length and its KV cache (a small --budget leaves little).
    fits = min(info.max_model_len, info.kv_capacity_tokens or info.max_model_len) - 1
    prompts, source = quality_prompts(info.vocab_size, count, min(length, fits))
    return compare(prompt_logits(engine, prompts), prompt_logits(reference, prompts), prompts, source)

"""`pwbench demo train`: train the bundled demo MoE model (Mixtral architecture) from scratch.

Recipe (what trials on these 2-core CPUs showed; see README "The demo model"):
  - one loss per step, the mean over every answer token of every stream, so dense streams
    carry the early learning; four streams: copy, pairs recall ("pairs : k1 v1 ... recall : k3
    v3 k1 v1 ..."; every recalled value is a target and only a content lookup solves it),
    recall in the demo formats at the current curriculum level (plus replay of easier
    levels), and closed-book questions (from `book_from_level` on; from the start by default,
    since memorising the fact table needs every step it can get);
  - facts read "the color of X red ." and questions are clozes ("question : the color of X"),
    so recall is the single-token lookup X -> next token (formats needing two tokens of
    context, or naming X twice, stayed at chance);
  - the curriculum grows facts and context when held-out recall at the current level reaches
    `advance_at`. Trials that did not work: copy alone (the model copies by position, which
    does not transfer to recall), and per-stream mean losses (the sparse recall loss
    swamped the others).
Deterministic from the seed for a fixed step count (time is never a stopping criterion).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from workloads.demo.language import ATTRIBUTES, BOS_ID, EOS_ID, PAD_ID, build_tokenizer, demo_language
from workloads.demo.tasks import Sample, chat_recall, closed_book, copy_task, rag_recall

# (facts min, facts max, tokens min, tokens max) per curriculum level.
LEVELS: tuple[tuple[int, int, int, int], ...] = (
    (2, 8, 30, 90),
    (4, 12, 90, 220),
    (8, 20, 200, 420),
    (12, 28, 380, 700),
    (16, 36, 500, 1000),
    (16, 48, 700, 1400),
)


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 7000
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    experts: int = 4
    top_k: int = 2
    expert_intermediate: int = 256
    max_position: int = 2048
    lr: float = 1e-3
    warmup: int = 50
    decay_frac: float = 0.2  # cosine decay over the last fraction of steps
    # Tokens per step of each stream.
    copy_tokens: int = 1536
    pairs_tokens: int = 1536
    retrieval_tokens: int = 6144
    level0_retrieval_tokens: int = 1536
    book_tokens: int = 1536
    book_from_level: int = 0  # curriculum level at which closed-book questions join the mix
    questions_per_context: int = 4
    same_entity_share: float = 0.0  # > 0 needs two-token lookups (entity + attribute)
    advance_at: float = 0.9
    eval_every: int = 50
    eval_samples: int = 48
    aux_loss_coef: float = 0.02


def encode(sample: Sample) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 mask of the answer tokens (+EOS) the loss is taken on."""
    lang = demo_language()
    ids, mask = [BOS_ID] + lang.encode(sample.context), []
    mask = [0] * len(ids)
    for question, answer in sample.qa:
        q, a = lang.encode(question), lang.encode(answer) + [EOS_ID]
        ids += q + a
        mask += [0] * len(q) + [1] * len(a)
    return ids, mask


def collate(batch: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    target = torch.zeros((len(batch), width), dtype=torch.bool)
    for i, (seq, mask) in enumerate(batch):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        target[i, : len(seq)] = torch.tensor(mask, dtype=torch.bool)
    return ids, attn, target


def retrieval_sample(rng: random.Random, level: int, cfg: TrainConfig, questions: int) -> Sample:
    fmin, fmax, tmin, tmax = LEVELS[level]
    make = rag_recall if rng.random() < 0.5 else chat_recall
    share = cfg.same_entity_share if level >= 2 else 0.0
    return make(rng, rng.randint(fmin, fmax), rng.randint(tmin, tmax), questions, share)


def fill(make: Callable[[], Sample], budget: int) -> list[tuple[list[int], list[int]]]:
    out, used = [], 0
    while used < budget:
        out.append(encode(make()))
        used += len(out[-1][0])
    return out


def build_model(cfg: TrainConfig):
    from transformers import MixtralConfig, MixtralForCausalLM  # noqa: PLC0415

    lang = demo_language()
    mc = MixtralConfig(
        vocab_size=len(lang.vocab), hidden_size=cfg.hidden, intermediate_size=cfg.expert_intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        num_local_experts=cfg.experts, num_experts_per_tok=cfg.top_k, max_position_embeddings=cfg.max_position,
        tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, router_aux_loss_coef=cfg.aux_loss_coef,
    )
    torch.manual_seed(cfg.seed)
    return MixtralForCausalLM(mc)


def pairs_recall(rng: random.Random, n: int) -> Sample:
    """Training-only warm-up task: n key-value pairs, then every key again in shuffled order."""
    lang = demo_language()
    values = [v for vs in ATTRIBUTES.values() for v in vs]
    keys = rng.sample(lang.rag_entities, n)
    vals = [rng.choice(values) for _ in keys]
    order = rng.sample(range(n), n)
    context = "pairs : " + " ".join(f"{k} {v}" for k, v in zip(keys, vals)) + " . recall :"
    return Sample("pairs", context, tuple((keys[i], vals[i]) for i in order))


def forward_loss(model, batch, aux_coef: float) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(summed cross-entropy over answer tokens, their count, router load-balancing loss)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: PLC0415

    ids, attn, target = collate(batch)
    out = model.model(input_ids=ids, attention_mask=attn, output_router_logits=True)
    # Predict token t+1 at position t: the hidden state before each answer token.
    pick = target[:, 1:]
    logits = model.lm_head(out.last_hidden_state[:, :-1][pick])
    ce = F.cross_entropy(logits, ids[:, 1:][pick], reduction="sum")
    aux = load_balancing_loss_func(out.router_logits, model.config.num_local_experts, model.config.num_experts_per_tok, attn)
    return ce, int(pick.sum()), aux_coef * aux


@torch.no_grad()
def answer_accuracy(model, samples: list[Sample]) -> float:
    """Teacher-forced: share of samples whose first answer (+EOS) is predicted exactly."""
    correct = 0
    for i in range(0, len(samples), 16):
        chunk = [(encode(s)) for s in samples[i : i + 16]]
        firsts = []
        for ids, mask in chunk:  # keep only the first question's answer
            start = mask.index(1)
            end = start + mask[start:].index(0) if 0 in mask[start:] else len(mask)
            firsts.append((ids[:end], [0] * start + [1] * (end - start)))
        ids, attn, target = collate(firsts)
        hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
        pred = model.lm_head(hidden[:, :-1]).argmax(-1)
        ok = (pred == ids[:, 1:]) | ~target[:, 1:]
        correct += int(ok.all(dim=1).sum())
    return correct / len(samples)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    decay_start = int(cfg.steps * (1 - cfg.decay_frac))
    if step < decay_start:
        return cfg.lr
    progress = (step - decay_start) / max(1, cfg.steps - decay_start)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(cfg: TrainConfig, out_dir: Path, log: Callable[[str], None] = print) -> dict:
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    model = build_model(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    eval_rng = random.Random(cfg.seed + 10_000)
    eval_sets = {lvl: [retrieval_sample(eval_rng, lvl, cfg, 1) for _ in range(cfg.eval_samples)] for lvl in range(len(LEVELS))}
    book_eval = closed_book(random.Random(cfg.seed + 20_000), 256)
    book_eval = [Sample("closed_book", "", (qa,)) for qa in book_eval.qa]
    copy_eval = [copy_task(eval_rng, eval_rng.randint(6, 24)) for _ in range(64)]
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)  # once; checkpoints rewrite only the weights and training.json
    level, curve, t0 = 0, [], time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        # Replay: a quarter of retrieval samples come from easier levels.
        def retrieval() -> Sample:
            lvl = rng.randint(0, level) if rng.random() < 0.25 else level
            return retrieval_sample(rng, lvl, cfg, cfg.questions_per_context)

        streams = {
            "copy": fill(lambda: copy_task(rng, rng.randint(6, 24)), cfg.copy_tokens),
            "pairs": fill(lambda: pairs_recall(rng, rng.randint(4, 12)), cfg.pairs_tokens),
            "retrieval": fill(retrieval, cfg.level0_retrieval_tokens if level == 0 else cfg.retrieval_tokens),
        }
        if level >= cfg.book_from_level:
            streams["book"] = fill(lambda: closed_book(rng, 8), cfg.book_tokens)
        parts = {name: forward_loss(model, batch, cfg.aux_loss_coef) for name, batch in streams.items()}
        targets = sum(n for _, n, _ in parts.values())
        loss = sum(ce for ce, _, _ in parts.values()) / targets + sum(aux for _, _, aux in parts.values())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            model.eval()
            point = {
                "step": step + 1,
                "minutes": round((time.perf_counter() - t0) / 60, 2),
                "level": level,
                **{f"loss_{name}": round(ce.item() / max(1, n), 4) for name, (ce, n, _) in parts.items()},
                "retrieval_acc": answer_accuracy(model, eval_sets[level]),
                "top_level_acc": answer_accuracy(model, eval_sets[len(LEVELS) - 1]),
                "closed_book_acc": answer_accuracy(model, book_eval),
                "copy_acc": answer_accuracy(model, copy_eval),
            }
            model.train()
            curve.append(point)
            log(json.dumps(point))
            if point["retrieval_acc"] >= cfg.advance_at and level < len(LEVELS) - 1:
                level += 1
            _save(model, out_dir, cfg, curve, level, t0, final=False)
    model.eval()
    return _save(model, out_dir, cfg, curve, level, t0, final=True)


def _save(model, out_dir: Path, cfg: TrainConfig, curve: list, level: int, t0: float, final: bool) -> dict:
    """Checkpoint after every evaluation, so an interrupted run still leaves a usable model."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    report = {"config": asdict(cfg), "curve": curve, "final_level": level, "complete": final,
              "minutes": round((time.perf_counter() - t0) / 60, 2)}
    (out_dir / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    return report

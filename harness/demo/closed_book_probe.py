"""Where closed-book facts live, in isolation: train the demo architecture on closed-book
questions alone and watch what 2-bit RTN experts do to them (docs/demo_model.md).

    python -m harness.demo.closed_book_probe [--names two] [--intermediate 64] [--steps 3000]

--names one: 400 one-word names (RAG entity words) x 4 attributes = 1,600 facts, which the
names' own embeddings can hold; two: the demo language's 6,400 facts about 1,600 two-word
names, where only the pair identifies a fact. Every 250 steps it prints teacher-forced
accuracy on (up to) 1,600 of the facts at full precision, with 2-bit RTN experts per row
and in groups of 32, and with each layer's experts zeroed. 24 sequences of 8 questions per
step, AdamW lr 1e-3 with the demo schedule; about 1 minute per 1,000 steps at 64-wide
experts on 2 cores.
"""

from __future__ import annotations

import argparse
import random

import torch

from harness.demo.probe import expert_probes
from harness.demo.train import TrainConfig, build_model, encode, forward_loss, lr_at
from workloads.demo.language import ATTRIBUTES, demo_language
from workloads.demo.tasks import Sample, _question


def fact_table(names: str) -> dict[tuple[str, str], str]:
    lang = demo_language()
    if names == "two":
        return dict(lang.book_facts)
    rng = random.Random(1)
    return {(entity, attr): rng.choice(ATTRIBUTES[attr])
            for entity in lang.rag_entities[:400] for attr in rng.sample(list(ATTRIBUTES), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", choices=("one", "two"), default="two")
    parser.add_argument("--intermediate", type=int, default=64, help="expert intermediate size")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    args = parser.parse_args()
    facts = fact_table(args.names)
    keys = sorted(facts)
    qa = {k: (_question(k[0], k[1], "answer"), facts[k]) for k in keys}
    held = [Sample("closed_book", "", (qa[k],)) for k in random.Random(9).sample(keys, min(1600, len(keys)))]
    cfg = TrainConfig(expert_intermediate=args.intermediate)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    rng = random.Random(1)
    print(f"{len(facts)} facts, {args.names}-word names, experts {args.intermediate} wide, weight "
          f"decay {args.weight_decay}")
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.lr, args.steps, cfg.warmup, cfg.decay_frac)
        batch = [encode(Sample("closed_book", "", tuple(qa[k] for k in rng.sample(keys, 8)))) for _ in range(24)]
        ce, count, aux = forward_loss(model, batch, cfg.aux_loss_coef)
        opt.zero_grad()
        (ce / count + aux).backward()
        opt.step()
        if (step + 1) % 250 == 0 or step + 1 == args.steps:
            model.eval()
            probes = expert_probes(model, held)
            model.train()
            print(f"step {step + 1:>5}  loss {ce.item() / count:.3f}  "
                  + "  ".join(f"{k} {v:.1%}" for k, v in probes.items()), flush=True)


if __name__ == "__main__":
    main()

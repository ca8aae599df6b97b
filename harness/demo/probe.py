"""Where a demo model's recall and knowledge live: the probes behind docs/demo_model.md.

    python -m harness.demo.probe [--model DIR] [--theta 1e6]

Prints, teacher-forced on seeded examples (transformers' MixtralForCausalLM, float32):
  - recall by number of facts and context length (half RAG, half chat; 64 examples each),
    which separates "too long" from "too many facts to tell apart";
  - the same with every fact of a prompt about one attribute ("the color of X red ." for
    all X): only the entity then tells the facts apart, so a model that matches the question's
    attribute to a value of that kind, instead of looking the entity up, falls to about
    1 / facts;
  - closed-book accuracy (512 facts) with the routed experts changed: layer 0's or layer 1's
    experts zeroed, 2-bit RTN per row (no groups) and group 32.
`--theta` overrides the RoPE theta before measuring (what raising theta alone does).
"""

from __future__ import annotations

import argparse
import random

import torch

from engines.common.demo import demo_model_path
from harness.demo.train import answer_accuracy, set_rope_theta
from workloads.demo.tasks import Sample, chat_recall, closed_book, rag_recall

GRID = ((4, 128), (4, 512), (4, 1024), (8, 64), (16, 110), (32, 210), (16, 512), (32, 1024))
ONE_ATTRIBUTE_GRID = ((4, 64), (8, 64), (16, 512), (32, 1024))


def recall_grid(model, grid=GRID, attributes: tuple[str, ...] | None = None,
                examples: int = 64) -> dict[tuple[int, int], float]:
    out = {}
    for facts, tokens in grid:
        rng = random.Random(5)
        samples = [(rag_recall if i % 2 == 0 else chat_recall)(rng, facts, tokens, 1, attributes=attributes)
                   for i in range(examples)]
        out[(facts, tokens)] = answer_accuracy(model, samples)
    return out


@torch.no_grad()
def expert_probes(model, facts: list[Sample] | None = None) -> dict[str, float]:
    """Closed-book accuracy (512 seeded facts unless given) as the routed experts change."""
    from engines.quant.rtn import rtn_fake_quantize

    facts = facts or [Sample("closed_book", "", (qa,)) for qa in closed_book(random.Random(5), 512).qa]
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    layers = [layer.mlp.experts for layer in model.model.layers]

    def zero(i: int) -> None:
        layers[i].down_proj.zero_()

    def rtn(group: int | None) -> None:
        for ex in layers:
            for w in (ex.gate_up_proj, ex.down_proj):
                w.copy_(rtn_fake_quantize(w, 2, group or w.shape[-1]))

    changes = {"full precision": lambda: None,
               **{f"layer {i} experts zeroed": (lambda i=i: zero(i)) for i in range(len(layers))},
               "2-bit RTN per row": lambda: rtn(None), "2-bit RTN group 32": lambda: rtn(32)}
    out = {}
    for name, change in changes.items():
        change()
        out[name] = answer_accuracy(model, facts)
        model.load_state_dict(saved)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(demo_model_path()))
    parser.add_argument("--theta", type=float, default=None, help="RoPE theta to measure with instead of the model's")
    args = parser.parse_args()
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    if args.theta:
        set_rope_theta(model, args.theta)
    print(f"model {args.model}, RoPE theta {model.config.rope_parameters['rope_theta']:g}")
    for (facts, tokens), acc in recall_grid(model).items():
        print(f"recall  {facts:>2} facts in {tokens:>4} tokens: {acc:6.1%}")
    for (facts, tokens), acc in recall_grid(model, ONE_ATTRIBUTE_GRID, ("color",)).items():
        print(f"recall  {facts:>2} facts in {tokens:>4} tokens, all about one attribute: {acc:6.1%}")
    for name, acc in expert_probes(model).items():
        print(f"closed book, {name}: {acc:6.1%}")


if __name__ == "__main__":
    main()

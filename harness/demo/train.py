"""`pwbench demo train`: train a bundled demo MoE model from scratch.

Two architectures (`arch`), one recipe, named presets (`PRESETS`, `--preset`): `demo`, the
Mixtral model in engines/demo_model (the defaults below), and `demo-fine`, a DeepSeek-V3
model in engines/demo_fine_model (MLA, a dense first layer, one shared and 16 fine-grained
routed experts, top-4 group-limited sigmoid routing). For DeepSeek-V3 the routers are
balanced as its paper does (arXiv 2412.19437, 2.1.2): after every step each expert's
e_score_correction_bias moves by `bias_update_rate` toward the layer's mean load, plus a
sequence-wise balance loss weighted by `aux_loss_coef`; transformers' model gives no router
outputs to train on, so forward hooks on the routers (`RouterTap`) record their choices.
`curriculum_steps` ends the curriculum a fixed number of steps after the circuit phase.

Recipe (what trials on these 2-core CPUs showed; see docs/demo_model.md):
  - First the lookup circuit, on its own (`circuit_batch`): token-level copy, key-value recall
    and a "skip" task (x r x: the target is the token two back) over random words, until
    held-out 8-pair key-value recall reaches `circuit_until` (1,100 steps in the shipped run). The skip
    task makes a previous-token head worth having by itself; key-value recall then needs only
    a head that matches the current token against it. Together with a shared direction added
    to every token embedding at init (`embed_offset`: without attention biases, a RoPE head
    needs one to attend by position), this is what made the lookup form. Before it, every
    model we trained matched the question's attribute to a value of that kind instead of
    looking the entity up: recall fell to chance when all facts shared one attribute.
  - Then the curriculum, one loss per step (the mean over every answer token of every stream):
    copy, pairs recall ("pairs : k1 v1 ... recall : k3 v3 k1 v1 ..."), recall in the demo
    formats at the current level (plus replay of easier levels), and closed-book questions
    (from `book_from_level` on; from the start by default). The level (facts and context
    length) rises when held-out recall at the current level reaches `advance_at`.
    Closed book is 6,400 facts about two-word names (workloads/demo/language.py); it is the
    slowest stream (93% at step 3,500 of the shipped run, 100% at 4,000).
  - Facts read "the color of X red ." and questions are clozes ("question : the color of X"),
    so recall is the single-token lookup X -> next token.
Then a short long-context stage (`long_steps`, 200): recall at 200-1,400 tokens with 8
questions per context, and closed-book questions asked after unrelated RAG or chat context,
which is how the workloads ask them when a prompt holds no complete fact (it taught the
model with one-word names: 1 of 17 right in `rag_long` before, 17 of 17 after; the shipped
model, with two-word names, stays near 15%). It can also
change RoPE theta (`long_rope_theta`): raising 1e4 to 1e6, as Code Llama extended Llama 2's
context (arXiv 2308.12950), lifted the previous model, which never left the first curriculum
level, from 2% to 32% recall at 512-1,024 tokens; the shipped model keeps 1e4.
Deterministic from the seed for a fixed step count and thread count (time is never a stopping
criterion; one thread and two gave the same curve through step 1,200, then differed in the
fourth digit).
`train(..., start_from=DIR)` runs only the long-context stage on a finished curriculum
checkpoint with the same curriculum settings, which is what the from-scratch run does after
its curriculum.
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

from harness.errors import HarnessError
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


ARCHS = ("mixtral", "deepseek_v3")


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 2  # the shipped model's; see docs/demo_model.md for seeds 0 and 1
    steps: int = 4000
    arch: str = "mixtral"  # or "deepseek_v3" (MLA, shared expert, grouped sigmoid routing)
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2  # mixtral only (MLA's keys and values come from one latent per token)
    experts: int = 4  # routed experts per MoE layer
    top_k: int = 2
    expert_intermediate: int = 64
    # deepseek_v3 only: dense first layers (first_k_dense_replace) and their MLP width, shared
    # experts (each expert_intermediate wide), group-limited routing, MLA dimensions (q_lora_rank
    # 0: a full-rank query projection), the routed output's scale, and the auxiliary-loss-free
    # balancing rate (e_score_correction_bias moves by this much per step, arXiv 2412.19437 2.1.2).
    dense_layers: int = 1
    dense_intermediate: int = 256
    shared_experts: int = 1
    n_group: int = 4
    topk_group: int = 2
    kv_lora_rank: int = 32
    q_lora_rank: int = 0
    qk_nope_dim: int = 16
    qk_rope_dim: int = 16
    v_head_dim: int = 32
    routed_scaling: float = 2.5
    bias_update_rate: float = 1e-3
    max_position: int = 2048
    lr: float = 1e-3
    warmup: int = 50
    decay_frac: float = 0.2  # cosine decay over the last fraction of steps
    # Tokens per step of each stream.
    copy_tokens: int = 1536
    pairs_tokens: int = 1536
    retrieval_tokens: int = 6144
    level0_retrieval_tokens: int = 1536
    book_tokens: int = 2048
    embed_offset: float = 1.0  # a direction shared by all token embeddings, in units of one's norm
    # First phase: token-level copy, key-value recall and skip (circuit_batch) until held-out
    # 8-pair key-value recall reaches circuit_until, or for at most circuit_max_steps.
    circuit_until: float = 0.9
    circuit_max_steps: int = 3000
    circuit_sequences: int = 32  # per task per step
    # > 0: the curriculum stage ends this many steps after the circuit phase does (steps is then
    # only an upper bound), so its length does not depend on when the lookup forms.
    curriculum_steps: int = 0
    book_from_level: int = 0  # curriculum level at which closed-book questions join the mix
    questions_per_context: int = 4
    same_entity_share: float = 0.0  # > 0 needs two-token lookups (entity + attribute)
    advance_at: float = 0.9
    eval_every: int = 50
    eval_samples: int = 48
    aux_loss_coef: float = 0.02  # mixtral: switch load-balancing loss; deepseek_v3: sequence-wise balance loss
    # Long-context stage, after the curriculum (fields named long_* / book_in_context_*).
    long_steps: int = 200
    long_rope_theta: float = 1e4  # unchanged; 1e6 extended the previous model's context
    long_lr: float = 1e-3
    long_min_level: int = 2  # recall contexts drawn from levels long_min_level..last
    long_questions_per_context: int = 8
    long_retrieval_tokens: int = 6144
    book_in_context_tokens: int = 1536  # closed-book questions after 30-700 tokens of unrelated context

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise HarnessError(f"demo train option arch={self.arch!r} is unknown; use one of {', '.join(ARCHS)}")
        if self.arch == "deepseek_v3":  # before anything is written
            _check_deepseek(self)

    def curriculum_fields(self) -> dict:
        """The settings that determine the curriculum stage's weights (evaluation settings do too:
        the level advances on held-out accuracy at each evaluation)."""
        return {k: v for k, v in asdict(self).items() if not k.startswith(("long_", "book_in_context_"))}


# The bundled models' settings over TrainConfig's defaults (`pwbench demo train --preset NAME`).
PRESETS: dict[str, dict] = {
    "demo": {},  # engines/demo_model: Mixtral, 2 layers x 4 experts, top-2
    "demo-fine": {  # engines/demo_fine_model: DeepSeek-V3, fine-grained experts (docs/demo_model.md)
        "arch": "deepseek_v3", "layers": 3, "dense_layers": 1, "experts": 16, "top_k": 4, "n_group": 4,
        "topk_group": 2, "shared_experts": 1, "expert_intermediate": 32, "dense_intermediate": 256,
        # A 64-dim KV latent and 32 no-RoPE query/key dims: with 32 and 16 the lookup had not formed
        # by step 1,200 (8-pair recall 11%); with these it formed at step 550 (docs/demo_model.md).
        "kv_lora_rank": 64, "q_lora_rank": 0, "qk_nope_dim": 32, "qk_rope_dim": 16, "v_head_dim": 32,
        "aux_loss_coef": 1e-4,
        # Sized to what one thread on a shared 2-core machine allows in a session: the curriculum
        # ends 2,000 steps after the circuit phase (`steps` only bounds it; the circuit phase's
        # learning rate is flat below it), half the recall tokens per step, smaller held-out sets,
        # no long-context stage (docs/demo_model.md has what that costs).
        "steps": 6000, "circuit_max_steps": 3000, "curriculum_steps": 2000, "retrieval_tokens": 3072,
        "eval_samples": 32, "long_steps": 0,
    },
}


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
    lang = demo_language()
    common = dict(vocab_size=len(lang.vocab), hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                  num_attention_heads=cfg.heads, num_experts_per_tok=cfg.top_k,
                  max_position_embeddings=cfg.max_position,
                  tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if cfg.arch == "deepseek_v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        _check_deepseek(cfg)
        mc = DeepseekV3Config(
            **common, num_key_value_heads=cfg.heads, intermediate_size=cfg.dense_intermediate,
            moe_intermediate_size=cfg.expert_intermediate, n_routed_experts=cfg.experts,
            n_shared_experts=cfg.shared_experts, n_group=cfg.n_group, topk_group=cfg.topk_group,
            first_k_dense_replace=cfg.dense_layers, kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank or None,
            qk_nope_head_dim=cfg.qk_nope_dim, qk_rope_head_dim=cfg.qk_rope_dim, v_head_dim=cfg.v_head_dim,
            routed_scaling_factor=cfg.routed_scaling, norm_topk_prob=True,
            num_nextn_predict_layers=0,  # no multi-token-prediction layer (transformers' default says 1)
        )
        model_cls = DeepseekV3ForCausalLM
    elif cfg.arch == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        mc = MixtralConfig(**common, intermediate_size=cfg.expert_intermediate, num_key_value_heads=cfg.kv_heads,
                           num_local_experts=cfg.experts, router_aux_loss_coef=cfg.aux_loss_coef)
        model_cls = MixtralForCausalLM
    else:
        raise HarnessError(f"demo train option arch={cfg.arch!r} is unknown; use one of {', '.join(ARCHS)}")
    torch.manual_seed(cfg.seed)
    model = model_cls(mc)
    if cfg.embed_offset:
        # Neither Mixtral's attention nor MLA has biases, and RMSNorm no shift, so with RoPE a head
        # can only attend by relative position (the previous-token head that recall composes with)
        # once its inputs share a constant direction (a point made in C. Wendler's note on RoPE,
        # wendlerc.github.io/notes/rope.html). At init they do not. In the trial replica, the
        # lookup formed in ~500 steps with this offset and the skip task, and not in 1,500
        # steps with either alone. Every row gets the same vector, so through the tied output
        # layer it adds the same amount to every token's logit and favours none.
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        direction = torch.randn(cfg.hidden, generator=gen)
        scale = cfg.embed_offset * mc.initializer_range * cfg.hidden ** 0.5
        with torch.no_grad():
            model.model.embed_tokens.weight += scale * direction / direction.norm()
    return model


def _check_deepseek(cfg: TrainConfig) -> None:
    """Group-limited routing needs equal groups of at least two experts (a group's score is its
    top two) and enough experts in the chosen groups for top_k."""
    if cfg.n_group < 1 or cfg.experts % cfg.n_group or cfg.experts // cfg.n_group < 2:
        raise HarnessError(f"demo train: experts={cfg.experts} must split into n_group={cfg.n_group} equal groups "
                           f"of at least 2; pick n_group dividing experts")
    if not 1 <= cfg.topk_group <= cfg.n_group or cfg.topk_group * (cfg.experts // cfg.n_group) < cfg.top_k:
        raise HarnessError(f"demo train: topk_group={cfg.topk_group} groups of {cfg.experts // cfg.n_group} experts "
                           f"cannot hold top_k={cfg.top_k}; raise topk_group (at most n_group={cfg.n_group})")
    if not 0 <= cfg.dense_layers < cfg.layers:
        raise HarnessError(f"demo train: dense_layers={cfg.dense_layers} must leave a MoE layer among "
                           f"layers={cfg.layers}")


def model_class(arch: str):
    from transformers import DeepseekV3ForCausalLM, MixtralForCausalLM

    return DeepseekV3ForCausalLM if arch == "deepseek_v3" else MixtralForCausalLM


class RouterTap:
    """Forward hooks on every DeepSeek-V3 router (`mlp.gate`, a DeepseekV3TopkRouter, which returns
    (router_logits, topk_weights, topk_indices)): in training mode each call's logits and top-k
    choices are kept for the balance loss, and the step's per-expert token counts for the bias
    update. transformers' model returns no router outputs for this architecture's training path."""

    def __init__(self, model):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.gates = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.records: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.loads = [torch.zeros(g.e_score_correction_bias.numel()) for g in self.gates]
        for i, gate in enumerate(self.gates):
            gate.register_forward_hook(lambda module, _args, out, i=i: self._keep(module, i, out))

    def _keep(self, module, i: int, out) -> None:
        if module.training:
            self.records.append((i, out[0], out[2]))

    def take(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        records, self.records = self.records, []
        return records


def router_tap(model) -> RouterTap:
    if getattr(model, "_pwbench_router_tap", None) is None:
        model._pwbench_router_tap = RouterTap(model)
    return model._pwbench_router_tap


def sequence_balance_loss(logits: torch.Tensor, chosen: torch.Tensor, attn: torch.Tensor, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (arXiv 2412.19437 eq. 17-19) before its weight:
    per sequence, sum_i f_i P_i, f_i = E / (K T) * tokens routed to expert i, P_i = mean over the
    sequence of expert i's normalized sigmoid score; 1 when balanced; averaged over sequences.
    logits (B*T, E), chosen (B*T, K) expert ids, attn (B, T) with 0 on padding."""
    b, t = attn.shape
    e = logits.shape[-1]
    scores = logits.view(b, t, e).sigmoid()
    probs = scores / scores.sum(-1, keepdim=True)
    mask = attn.unsqueeze(-1).to(probs.dtype)  # B T 1
    tokens = mask.sum(1)  # B 1
    routed = F.one_hot(chosen.view(b, t, -1), e).sum(2).to(probs.dtype)  # B T E
    f = e / top_k * (routed * mask).sum(1) / tokens
    p = (probs * mask).sum(1) / tokens
    return (f * p).sum(-1).mean()


@torch.no_grad()
def update_router_bias(tap: RouterTap, rate: float) -> None:
    """Auxiliary-loss-free balancing: after each step, raise the bias of every expert that got
    fewer tokens than the layer's mean and lower it for those that got more, by `rate`."""
    for gate, load in zip(tap.gates, tap.loads):
        gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        load.zero_()


def pairs_recall(rng: random.Random, n: int) -> Sample:
    """Training-only warm-up task: n key-value pairs, then every key again in shuffled order."""
    lang = demo_language()
    values = [v for vs in ATTRIBUTES.values() for v in vs]
    keys = rng.sample(lang.rag_entities, n)
    vals = [rng.choice(values) for _ in keys]
    order = rng.sample(range(n), n)
    context = "pairs : " + " ".join(f"{k} {v}" for k, v in zip(keys, vals)) + " . recall :"
    return Sample("pairs", context, tuple((keys[i], vals[i]) for i in order))


def circuit_batch(rng: random.Random, sequences: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    """The first phase's tasks, as token ids and answer masks over random words (every word of
    the vocabulary alike, no sentence format):
      copy   w1 .. wn . w1 .. wn          (n = 8-30; targets: the second copy)
      kv     k1 v1 .. kn vn ? ki vi ? ..  (n = 2-8, every key asked once in random order)
      skip   x r x r' y r'' y ..          (8-20 words; target: the token two back)
    Skip is solved by a previous-token head alone; kv needs that head plus a head that matches
    the current token against it (the lookup every recall task uses). With skip and the
    embedding offset (build_model) the lookup formed in ~500 steps in a replica of the issue's
    trial and at step 1,100 in the shipped run; with either alone it did not form."""
    words = _circuit_words()
    dot = demo_language().token_to_id["."]

    def copy() -> tuple[list[int], list[int]]:
        w = [rng.choice(words) for _ in range(rng.randint(8, 30))]
        return [BOS_ID, *w, dot, *w], [0] * (len(w) + 2) + [1] * len(w)

    def skip() -> tuple[list[int], list[int]]:
        ids, mask = [BOS_ID], [0]
        for _ in range(rng.randint(8, 20)):
            x = rng.choice(words)
            ids += [x, rng.choice(words), x, rng.choice(words)]
            mask += [0, 0, 1, 0]
        return ids, mask

    return {"copy": [copy() for _ in range(sequences)],
            "kv": [kv_recall_ids(rng, rng.randint(2, 8)) for _ in range(sequences)],
            "skip": [skip() for _ in range(sequences)]}


def _circuit_words() -> range:
    lang = demo_language()
    return range(lang.token_to_id["system"], len(lang.vocab))  # every word, no specials/punctuation


def kv_recall_ids(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    """n random key-value word pairs, then "? key value" for every key in random order."""
    words, ask = _circuit_words(), demo_language().token_to_id["?"]
    keys, values = rng.sample(words, n), [rng.choice(words) for _ in range(n)]
    ids = [BOS_ID, *(t for pair in zip(keys, values) for t in pair)]
    mask = [0] * len(ids)
    for i in rng.sample(range(n), n):
        ids += [ask, keys[i], values[i]]
        mask += [0, 0, 1]
    return ids, mask


@torch.no_grad()
def token_accuracy(model, batch: list[tuple[list[int], list[int]]]) -> float:
    """Teacher-forced share of target tokens predicted exactly."""
    ids, attn, target = collate(batch)
    pred = model(input_ids=ids, attention_mask=attn).logits[:, :-1].argmax(-1)
    hit = (pred == ids[:, 1:]) & target[:, 1:]
    return round(hit.sum().item() / target[:, 1:].sum().item(), 4)


def forward_loss(model, batch, aux_coef: float) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(summed cross-entropy over answer tokens, their count, router load-balancing loss)."""
    ids, attn, target = collate(batch)
    deepseek = model.config.model_type == "deepseek_v3"
    if deepseek:
        tap = router_tap(model)
        tap.take()
        out = model.model(input_ids=ids, attention_mask=attn)
    else:
        out = model.model(input_ids=ids, attention_mask=attn, output_router_logits=True)
    # Predict token t+1 at position t: the hidden state before each answer token.
    pick = target[:, 1:]
    logits = model.lm_head(out.last_hidden_state[:, :-1][pick])
    ce = F.cross_entropy(logits, ids[:, 1:][pick], reduction="sum")
    if deepseek:
        records = tap.take()
        k, keep = model.config.num_experts_per_tok, attn.reshape(-1).bool()
        for i, _, chosen in records:  # the step's load per expert, padding excluded
            tap.loads[i] += torch.bincount(chosen[keep].reshape(-1), minlength=tap.loads[i].numel()).float()
        aux = sum(sequence_balance_loss(lg, ch, attn, k) for _, lg, ch in records) / max(1, len(records))
    else:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        aux = load_balancing_loss_func(out.router_logits, model.config.num_local_experts,
                                       model.config.num_experts_per_tok, attn)
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


def lr_at(step: int, lr: float, steps: int, warmup: int, decay_frac: float) -> float:
    """Linear warm-up, constant, then cosine decay to 5% over the last `decay_frac` of steps."""
    if step < warmup:
        return lr * (step + 1) / warmup
    decay_start = int(steps * (1 - decay_frac))
    if step < decay_start:
        return lr
    progress = (step - decay_start) / max(1, steps - decay_start)
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(cfg: TrainConfig, out_dir: Path, log: Callable[[str], None] = print, start_from: Path | None = None) -> dict:
    """The curriculum stage, then the long-context stage; or only the latter from `start_from`."""
    t0 = time.perf_counter()
    if start_from is not None and cfg.long_steps <= 0:
        raise HarnessError("--from runs only the long-context stage, and long_steps is 0; "
                           "give it steps, e.g. --set long_steps=200")
    loaded = _load_curriculum(cfg, start_from) if start_from is not None else None  # check before writing
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)  # once; checkpoints rewrite only the weights and training.json
    model, curve, level = loaded or _curriculum(cfg, out_dir, log, t0)
    if cfg.long_steps > 0:
        curve = curve + _long_context(model, cfg, out_dir, log, curve, level, t0)
    model.eval()
    return _save(model, out_dir, cfg, curve, level, t0, final=True)


def _load_curriculum(cfg: TrainConfig, folder: Path):
    path = Path(folder) / "training.json"
    if not path.is_file():
        raise HarnessError(f"{folder} has no training.json; --from needs a folder written by `pwbench demo train`")
    try:
        report = json.loads(path.read_text())
        config, curve, level = report["config"], report["curve"], report["final_level"]
    except (ValueError, KeyError, TypeError) as exc:
        raise HarnessError(f"{path} is not a `pwbench demo train` report ({exc!r}); train from scratch") from None
    defaults = TrainConfig().curriculum_fields()  # a report from before a field existed ran with its default
    differ = sorted(k for k, v in cfg.curriculum_fields().items() if config.get(k, defaults[k]) != v)
    if differ:
        raise HarnessError(f"{path}: curriculum settings differ from this run's ({', '.join(differ)}); "
                           f"pass the same --set values or train from scratch")
    if any(p.get("stage") == "long_context" for p in curve):
        raise HarnessError(f"{folder} already went through the long-context stage; pass a curriculum "
                           f"checkpoint (a run with --set long_steps=0)")
    if not curve or curve[-1]["step"] != _curriculum_end(cfg, curve):
        raise HarnessError(f"{path}: the curriculum stage did not finish ({_curriculum_end(cfg, curve)} steps); "
                           f"train from scratch")
    try:
        model = model_class(cfg.arch).from_pretrained(folder, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise HarnessError(f"{folder}: cannot load the curriculum model ({exc}); train from scratch") from None
    return model, curve, level


def _curriculum_end(cfg: TrainConfig, curve: list[dict]) -> int:
    """The step the curriculum stage ends at: `steps`, or with `curriculum_steps` that many after
    the last circuit-phase point (the phase ends at an evaluation)."""
    circuit = [p["step"] for p in curve if p.get("phase") == "circuit"]
    if not cfg.curriculum_steps or (cfg.circuit_max_steps > 0 and not circuit):
        return cfg.steps
    return min(cfg.steps, (circuit[-1] if circuit else 0) + cfg.curriculum_steps)


def _curriculum(cfg: TrainConfig, out_dir: Path, log: Callable[[str], None], t0: float):
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    model = build_model(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    eval_rng = random.Random(cfg.seed + 10_000)
    eval_sets = {lvl: [retrieval_sample(eval_rng, lvl, cfg, 1) for _ in range(cfg.eval_samples)]
                 for lvl in range(len(LEVELS))}
    book_eval = _book_eval(cfg)
    copy_eval = [copy_task(eval_rng, eval_rng.randint(6, 24)) for _ in range(64)]
    kv_rng = random.Random(cfg.seed + 30_000)
    kv_eval = [kv_recall_ids(kv_rng, 8) for _ in range(64)]
    level, curve, circuit = 0, [], cfg.circuit_max_steps > 0
    end = cfg.steps if circuit or not cfg.curriculum_steps else min(cfg.steps, cfg.curriculum_steps)
    step = -1
    while step + 1 < end:
        step += 1
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.lr, end, cfg.warmup, cfg.decay_frac)
        # Replay: a quarter of retrieval samples come from easier levels.
        def retrieval() -> Sample:
            lvl = rng.randint(0, level) if rng.random() < 0.25 else level
            return retrieval_sample(rng, lvl, cfg, cfg.questions_per_context)

        if circuit:
            streams = circuit_batch(rng, cfg.circuit_sequences)
        else:
            streams = {
                "copy": fill(lambda: copy_task(rng, rng.randint(6, 24)), cfg.copy_tokens),
                "pairs": fill(lambda: pairs_recall(rng, rng.randint(4, 12)), cfg.pairs_tokens),
                "retrieval": fill(retrieval, cfg.level0_retrieval_tokens if level == 0 else cfg.retrieval_tokens),
            }
            if level >= cfg.book_from_level:
                streams["book"] = fill(lambda: closed_book(rng, 8), cfg.book_tokens)
        parts = _step(model, opt, streams, cfg)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == end:
            head = {"step": step + 1, "minutes": round((time.perf_counter() - t0) / 60, 2), "level": level,
                    **({"phase": "circuit"} if circuit else {})}
            point = _measure(model, head, parts, {
                "retrieval_acc": eval_sets[level], "top_level_acc": eval_sets[len(LEVELS) - 1],
                "closed_book_acc": book_eval, "copy_acc": copy_eval}, {"kv8_acc": kv_eval})
            curve.append(point)
            log(json.dumps(point))
            if circuit:
                circuit = point["kv8_acc"] < cfg.circuit_until and step + 1 < cfg.circuit_max_steps
                if not circuit and cfg.curriculum_steps:
                    end = min(cfg.steps, step + 1 + cfg.curriculum_steps)
            elif point["retrieval_acc"] >= cfg.advance_at and level < len(LEVELS) - 1:
                level += 1
            _save(model, out_dir, cfg, curve, level, t0, final=False)
    return model, curve, level


def _book_eval(cfg: TrainConfig) -> list[Sample]:
    """256 closed-book questions, one per sample (both stages track the same set)."""
    return [Sample("closed_book", "", (qa,)) for qa in closed_book(random.Random(cfg.seed + 20_000), 256).qa]


def _measure(model, head: dict, parts: dict[str, tuple], sets: dict[str, list[Sample]],
             token_sets: dict[str, list[tuple[list[int], list[int]]]] | None = None) -> dict:
    """One learning-curve point: `head`, the step's loss per stream, accuracy on each held-out set
    (`sets`: first answer exact; `token_sets`: share of target tokens), all in eval mode."""
    model.eval()
    point = {**head, **{f"loss_{name}": round(ce.item() / max(1, n), 4) for name, (ce, n, _) in parts.items()},
             **{key: answer_accuracy(model, samples) for key, samples in sets.items()},
             **{key: token_accuracy(model, batch) for key, batch in (token_sets or {}).items()}}
    model.train()
    return point


def _step(model, opt, streams: dict[str, list], cfg: TrainConfig) -> dict[str, tuple]:
    """One optimizer step on the mean loss over every answer token of every stream (deepseek_v3:
    then the routers' bias update from the step's expert loads)."""
    parts = {name: forward_loss(model, batch, cfg.aux_loss_coef) for name, batch in streams.items()}
    targets = sum(n for _, n, _ in parts.values())
    loss = sum(ce for ce, _, _ in parts.values()) / targets + sum(aux for _, _, aux in parts.values())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if model.config.model_type == "deepseek_v3":
        update_router_bias(router_tap(model), cfg.bias_update_rate)
    return parts


def book_in_context(rng: random.Random, questions: int, cfg: TrainConfig) -> Sample:
    """Closed-book questions after 30-700 tokens of RAG or chat context about other entities
    (the context's facts use RAG entities, the questions book entities, so they never clash)."""
    context = retrieval_sample(rng, rng.randint(0, 3), cfg, 1).context
    return Sample("closed_book", context, closed_book(rng, questions).qa)


def set_rope_theta(model, theta: float) -> None:
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_theta": theta}
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)  # the architecture's own class


def _long_context(model, cfg: TrainConfig, out_dir: Path, log: Callable[[str], None], done: list, level: int,
                  t0: float) -> list[dict]:
    set_rope_theta(model, cfg.long_rope_theta)
    model.train()
    rng = random.Random(cfg.seed + 1)  # independent of how much randomness the curriculum drew
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.long_lr, betas=(0.9, 0.95), weight_decay=0.0)
    eval_rng = random.Random(cfg.seed + 30_000)
    recall_eval = []
    for i in range(cfg.eval_samples):  # the evaluation's shape: 512-1024 tokens, one fact per 32
        n_tokens = eval_rng.randint(512, 1024)
        make = rag_recall if i % 2 == 0 else chat_recall
        recall_eval.append(make(eval_rng, n_tokens // 32, n_tokens, 1))
    book_eval = _book_eval(cfg)
    book_ctx_eval = [book_in_context(eval_rng, 1, cfg) for _ in range(cfg.eval_samples)]
    copy_eval = [copy_task(eval_rng, eval_rng.randint(6, 24)) for _ in range(64)]
    last = len(LEVELS) - 1

    def long_recall() -> Sample:
        fmin, fmax, tmin, tmax = LEVELS[rng.randint(cfg.long_min_level, last)]
        make = rag_recall if rng.random() < 0.5 else chat_recall
        return make(rng, rng.randint(fmin, fmax), rng.randint(tmin, tmax), cfg.long_questions_per_context)

    curve: list[dict] = []
    base = done[-1]["step"] if done else cfg.steps  # where the curriculum ended
    for step in range(cfg.long_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.long_lr, cfg.long_steps, cfg.warmup, 0.5)
        streams = {
            "copy": fill(lambda: copy_task(rng, rng.randint(6, 24)), cfg.copy_tokens),
            "pairs": fill(lambda: pairs_recall(rng, rng.randint(4, 12)), cfg.pairs_tokens),
            "retrieval": fill(long_recall, cfg.long_retrieval_tokens),
            "retrieval_short": fill(lambda: retrieval_sample(rng, 0, cfg, cfg.questions_per_context),
                                    cfg.level0_retrieval_tokens),
            "book": fill(lambda: closed_book(rng, 8), cfg.book_tokens),
            "book_in_context": fill(lambda: book_in_context(rng, 4, cfg), cfg.book_in_context_tokens),
        }
        parts = _step(model, opt, streams, cfg)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.long_steps:
            head = {"stage": "long_context", "step": base + step + 1,
                    "minutes": round((time.perf_counter() - t0) / 60, 2)}
            point = _measure(model, head, parts, {
                "recall_512_1024_acc": recall_eval, "closed_book_acc": book_eval,
                "closed_book_in_context_acc": book_ctx_eval, "copy_acc": copy_eval})
            curve.append(point)
            log(json.dumps(point))
            _save(model, out_dir, cfg, done + curve, level, t0, final=False)
    return curve


def _save(model, out_dir: Path, cfg: TrainConfig, curve: list, level: int, t0: float, final: bool) -> dict:
    """Checkpoint after every evaluation, so an interrupted run still leaves a usable model."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    report = {"config": asdict(cfg), "curve": curve, "final_level": level, "complete": final,
              "minutes": round((time.perf_counter() - t0) / 60, 2)}
    (out_dir / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    return report

"""DemoTaskSynthesizer: demo-language prompts with a scorable question, on a trace's shape.

Each block's words are a function of its id only (same id -> same words, so prefix and
passage reuse survive), generated in the format the demo model was trained on: passages of
fact and filler sentences for RAG, "remember that ..." and small-talk turns for chats. The
last 6 tokens are overwritten with a question about one fact stated exactly once in the
prompt (task rag_recall / chat_recall); a prompt with no complete fact asks a closed-book
question instead (RAG traffic where retrieval found nothing; 7 tokens, the names have two
words), and so does a direct question (a request whose only block is its question): then the
prompt is that question alone. Token 0 is BOS.
"""

from __future__ import annotations

import random
from collections import Counter
from functools import lru_cache

from workloads.base import TaskInfo
from workloads.demo.language import ATTRIBUTES, BOS_ID, demo_language
from workloads.demo.tasks import RAG_SYSTEM, _fact_sentence, _filler, _question
from workloads.synth import Prompt, RequestSkeleton

QUESTION_TOKENS = 6  # "question : the A of E" (chats: "user : the A of E"); closed book 7 (two-word E)
FACT_EVERY = 4  # one fact sentence per this many sentences (about one fact per 30 tokens)

Fact = tuple[str, str, str]


class DemoTaskSynthesizer:
    def __init__(self, seed: int, style: str) -> None:
        if style not in ("rag", "chat"):
            raise ValueError(f"style must be 'rag' or 'chat', got {style!r}")
        self.seed, self.style = seed, style
        self.table = demo_language().token_to_id

    def synthesize(self, skeleton: RequestSkeleton) -> Prompt:
        words: list[str] = ["<s>"]
        facts: list[tuple[int, int, Fact]] = []  # (start, end) word offsets of complete facts
        spans = skeleton.spans()
        kinds = skeleton.block_kinds or ("",) * len(spans)
        lengths = skeleton.block_lengths or (skeleton.block_tokens,) * len(spans)
        for block, span, kind, full in zip(skeleton.blocks, spans, kinds, lengths):
            block_words, block_facts = _block(self.seed, self.style, kind, block, full)
            base = len(words)
            words += block_words[:span]
            facts += [(base + a, base + b, f) for a, b, f in block_facts if b <= span]
        rng = random.Random(f"{self.seed}-request-{skeleton.index}")
        while len(words) < skeleton.input_tokens:  # the request's own tokens after the blocks
            words += _filler(rng).split()
        words = words[: skeleton.input_tokens]
        keep = len(words) - QUESTION_TOKENS
        usable = [f for a, b, f in facts if b <= keep]
        counts = Counter((e, a) for e, a, _ in usable)
        unique = [f for f in usable if counts[(f[0], f[1])] == 1]
        if tuple(kinds) == ("question",):  # a direct question (rag_long --direct-share): no context
            words, unique = ["<s>"], []
        if unique and keep > 0:
            entity, attr, value = rng.choice(unique)
            task = "rag_recall" if self.style == "rag" else "chat_recall"
        else:
            (entity, attr), value = _book_fact(rng)
            task = "closed_book"
        question = _question(entity, attr, "assistant" if task == "chat_recall" else "answer").split()
        if len(words) > len(question):
            words[-len(question):] = question
        else:  # too short for context: the whole prompt is the question
            words = ["<s>", *question]
        ids = tuple(BOS_ID if w == "<s>" else self.table[w] for w in words)
        return Prompt(ids, TaskInfo(task, value))


def _book_fact(rng: random.Random) -> tuple[tuple[str, str], str]:
    facts = demo_language().book_facts
    key = rng.choice(sorted(facts))
    return key, facts[key]


@lru_cache(maxsize=4096)
def _block(seed: int, style: str, kind: str, block: int, length: int) -> tuple[list[str], list[tuple[int, int, Fact]]]:
    """The words of block `block` (at its full length) and where its complete facts are."""
    rng = random.Random(f"{seed}-{style}-{block}")
    lang = demo_language()
    words: list[str] = []
    facts: list[tuple[int, int, Fact]] = []
    if style == "rag" and kind in ("sys_prompt", "system"):
        words += RAG_SYSTEM.split()
    elif style == "rag" and kind in ("passage", "web_search"):
        words += ["passage", ":"]
    while len(words) < length:
        with_fact = kind not in ("sys_prompt", "system", "question") and rng.randrange(FACT_EVERY) == 0
        if with_fact:
            attr = rng.choice(list(ATTRIBUTES))
            fact = (rng.choice(lang.rag_entities), attr, rng.choice(ATTRIBUTES[attr]))
            sentence = fact_text = _fact_sentence(*fact)
        else:
            sentence = _filler(rng)
        if style == "chat" or kind == "history":
            sentence = (f"user : remember that {sentence} assistant : ok ." if with_fact
                        else f"user : {sentence} assistant : i see .")
        start = len(words)
        words += sentence.split()
        if with_fact:
            offset = 4 if sentence.startswith("user : remember") else 0
            facts.append((start + offset, start + offset + len(fact_text.split()), fact))
    return words[:length], facts

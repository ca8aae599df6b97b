"""Seeded generators of the demo tasks and their exact-match scorer.

  rag_recall   system prompt + passages of facts and filler; the question's answer is stated
               in exactly one passage sentence; every other fact is a distractor
  chat_recall  a multi-turn chat where early user turns state facts and a later turn asks
  closed_book  a question about the fixed fact table, no context: the answer is in the weights
  copy         "repeat : w1 .. wn . answer :" -> "w1 .. wn" (control: broken vs weak model)

Facts read "the color of X red ." and questions are clozes, "question : the color of X" ->
"red" (in chats "user : the color of X").
A Sample is a context plus one or more (question, answer) pairs; training packs several
questions after one context, evaluation and workloads use the first. Text is space-separated
words of the demo language, so word count = token count (plus BOS).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from workloads.demo.language import (
    ATTRIBUTES,
    FILLER_EXTRA,
    FILLER_PLACES,
    FILLER_SUBJECTS,
    FILLER_VERBS,
    demo_language,
)

TASKS = ("rag_recall", "chat_recall", "closed_book", "copy")
RAG_SYSTEM = "system : answer the question using the passages ."


@dataclass(frozen=True)
class Sample:
    task: str
    context: str
    qa: tuple[tuple[str, str], ...]  # (question ending in "answer :" / "assistant :", answer)
    num_facts: int = 0

    @property
    def prompt(self) -> str:
        """The evaluation prompt: context and the first question."""
        return f"{self.context} {self.qa[0][0]}".strip()

    @property
    def answer(self) -> str:
        return self.qa[0][1]


def score(output: str, answer: str) -> bool:
    """Exact match of the generated words (up to EOS) against the answer."""
    return " ".join(output.split()) == " ".join(answer.split())


def _fact_sentence(entity: str, attr: str, value: str) -> str:
    # The value right after the entity: recall is then the single-token lookup (entity -> next
    # token) that the copy task's induction circuit performs. With "... of E is V", the
    # lookup needed two tokens of context ("E is") and stayed at chance in a trial.
    return f"the {attr} of {entity} {value} ."


def _question(entity: str, attr: str, closing: str) -> str:
    """The question is a cloze, "question : the color of X" -> "red": X then occurs once before
    (in its fact, followed by the value), the lookup an induction circuit does. A question that
    names X and then repeats it ("what is the color of X ? answer : the color of X") points
    that circuit at the question's own X, and recall stayed at chance in a trial."""
    return f"{'question' if closing == 'answer' else 'user'} : the {attr} of {entity}"


def _filler(rng: random.Random) -> str:
    """An 8-word sentence with no fact in it."""
    extra = rng.choice(FILLER_EXTRA)
    return f"the {rng.choice(FILLER_SUBJECTS)} {rng.choice(FILLER_VERBS)} {extra} in the {rng.choice(FILLER_PLACES)} ."


def _facts(rng: random.Random, n: int, same_entity_share: float,
           attributes: tuple[str, ...] | None = None) -> list[tuple[str, str, str]]:
    """n facts with distinct (entity, attribute); a share of them reuse an earlier entity with
    another attribute, so a question must match entity and attribute, not the entity alone.
    `attributes` restricts the attributes drawn (one attribute: only the entity tells facts apart)."""
    lang = demo_language()
    attrs = list(attributes or ATTRIBUTES)
    entities = rng.sample(lang.rag_entities, n)
    facts: list[tuple[str, str, str]] = []
    used: set[tuple[str, str]] = set()
    for i in range(n):
        entity = entities[i]
        if facts and rng.random() < same_entity_share:
            entity = rng.choice(facts)[0]
        free = [a for a in attrs if (entity, a) not in used] or attrs
        attr = rng.choice(free)
        if (entity, attr) in used:
            entity, attr = entities[i], rng.choice(attrs)
        used.add((entity, attr))
        facts.append((entity, attr, rng.choice(ATTRIBUTES[attr])))
    return facts


def rag_recall(rng: random.Random, num_facts: int, target_tokens: int, num_questions: int = 1,
               same_entity_share: float = 0.0, attributes: tuple[str, ...] | None = None) -> Sample:
    facts = _facts(rng, num_facts, same_entity_share, attributes)
    sentences = [_fact_sentence(*f) for f in facts]
    fixed = len(RAG_SYSTEM.split()) + 6 * num_facts + 6  # facts + the 6-token question
    num_passages = max(1, min(8, num_facts // 3 + rng.randint(0, 2)))
    budget = target_tokens - fixed - 2 * num_passages
    sentences += [_filler(rng) for _ in range(max(0, budget // 8))]
    rng.shuffle(sentences)
    cuts = sorted(rng.sample(range(1, len(sentences)), min(num_passages - 1, len(sentences) - 1)))
    passages = [sentences[a:b] for a, b in zip([0, *cuts], [*cuts, len(sentences)])]
    context = " ".join([RAG_SYSTEM] + ["passage : " + " ".join(p) for p in passages])
    asked = rng.sample(facts, min(num_questions, len(facts)))
    qa = tuple((_question(e, a, "answer"), v) for e, a, v in asked)
    return Sample("rag_recall", context, qa, num_facts)


def chat_recall(rng: random.Random, num_facts: int, target_tokens: int, num_questions: int = 1,
                same_entity_share: float = 0.0, attributes: tuple[str, ...] | None = None) -> Sample:
    facts = _facts(rng, num_facts, same_entity_share, attributes)
    turns = [f"user : remember that {_fact_sentence(*f)} assistant : ok ." for f in facts]
    fixed = 14 * num_facts + 6  # 14-token fact turns + the 6-token question
    turns += [f"user : {_filler(rng)} assistant : i see ." for _ in range(max(0, (target_tokens - fixed) // 15))]
    # Facts come early: shuffle, then move the fact turns into the first half of the chat.
    rng.shuffle(turns)
    fact_turns = [t for t in turns if t.startswith("user : remember")]
    chit = [t for t in turns if not t.startswith("user : remember")]
    head = len(chit) // 2
    early = fact_turns + chit[:head]
    rng.shuffle(early)
    context = " ".join(early + chit[head:])
    asked = rng.sample(facts, min(num_questions, len(facts)))
    qa = tuple((_question(e, a, "assistant"), v) for e, a, v in asked)
    return Sample("chat_recall", context, qa, num_facts)


def closed_book(rng: random.Random, num_questions: int = 1) -> Sample:
    facts = demo_language().book_facts
    keys = rng.sample(sorted(facts), num_questions)
    return Sample("closed_book", "", tuple((_question(e, a, "answer"), facts[(e, a)]) for e, a in keys))


def copy_task(rng: random.Random, length: int, num_questions: int = 1) -> Sample:
    lang = demo_language()
    pool = lang.rag_entities + lang.book_name_words + FILLER_SUBJECTS + FILLER_PLACES
    qa = []
    for _ in range(num_questions):
        words = " ".join(rng.choice(pool) for _ in range(length))
        qa.append((f"repeat : {words} . answer :", words))
    return Sample("copy", "", tuple(qa))


def make_sample(task: str, rng: random.Random, num_facts: int = 16, target_tokens: int = 512,
                num_questions: int = 1, same_entity_share: float = 0.0) -> Sample:
    """One sample of any task by name (the workloads' entry point)."""
    if task == "rag_recall":
        return rag_recall(rng, num_facts, target_tokens, num_questions, same_entity_share)
    if task == "chat_recall":
        return chat_recall(rng, num_facts, target_tokens, num_questions, same_entity_share)
    if task == "closed_book":
        return closed_book(rng, num_questions)
    if task == "copy":
        return copy_task(rng, max(2, min(16, num_facts)), num_questions)
    raise ValueError(f"unknown demo task {task!r}; known: {', '.join(TASKS)}")

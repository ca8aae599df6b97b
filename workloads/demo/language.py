"""The demo language: a fixed word-level vocabulary, attributes with their values, entity
pools and the closed-book fact table, all derived deterministically from one seed.

Everything the demo model knows is defined here, so the tokenizer, the training data, the
workloads and the evaluation agree by construction. No torch; `tokenizers` only in
`build_tokenizer`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

LANGUAGE_SEED = 20261129
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

STRUCTURE = (
    ": . ? , system user assistant passage question answer what is the of remember that ok "
    "repeat using passages i see and a in was this"
).split()

# Eight attributes, each with its own value words (real words keep outputs readable).
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "color": tuple("red blue green yellow purple orange black white brown pink gray gold "
                   "silver violet teal maroon".split()),
    "city": tuple("paris rome tokyo lima cairo oslo delhi quito dakar hanoi perth kyiv riga sofia tunis accra".split()),
    "job": tuple("baker pilot nurse farmer lawyer painter miner tailor chef judge poet sailor "
                 "barber clerk coder mason".split()),
    "pet": tuple("cat dog parrot rabbit turtle hamster lizard goat pony ferret snake mouse duck frog owl pig".split()),
    "food": tuple("rice bread pasta soup salad curry tofu cheese beans noodles pizza tacos "
                  "sushi dumplings pie stew".split()),
    "sport": tuple("tennis soccer hockey rugby boxing golf cricket chess rowing skiing fencing judo "
                   "diving archery polo karate".split()),
    "metal": tuple("iron copper zinc tin lead nickel cobalt chrome bronze brass steel titanium platinum "
                   "mercury lithium cadmium".split()),
    "tree": tuple("oak pine birch maple cedar willow elm ash beech palm spruce fir yew alder aspen larch".split()),
}

# Filler: sentences built from these words carry no facts the questions ask about.
FILLER_SUBJECTS = tuple("report market weather river team council museum garden festival bridge library harbor "
                        "school village station forest".split())
FILLER_VERBS = tuple("grew opened closed changed moved started ended improved declined rested "
                     "returned arrived stayed waited".split())
FILLER_PLACES = tuple("north south east west center coast valley hills island plain border capital".split())
FILLER_TIMES = tuple("today yesterday recently later early monday friday spring summer autumn winter".split())
FILLER_EXTRA = tuple("near after before during quietly slowly again also very".split())

NUM_RAG_ENTITIES = 800
# Closed-book entities have two-word names, a first and a last name (40 x 40 = 1,600 names),
# each fact about the pair: no single word's embedding can hold a fact, so the experts must
# (with one-word names the facts sat in the name embeddings, and 2-bit experts lost none).
NUM_BOOK_FIRST_NAMES = 40
NUM_BOOK_LAST_NAMES = 40
BOOK_ATTRIBUTES_PER_ENTITY = 4  # 1,600 x 4 = 6,400 closed-book facts


@dataclass(frozen=True)
class Language:
    vocab: tuple[str, ...]  # index = token id
    rag_entities: tuple[str, ...]  # names used in passages and chats (facts given in context)
    book_entities: tuple[str, ...]  # "first last" names whose facts live only in the weights
    book_name_words: tuple[str, ...]  # the first and last names they are made of
    book_facts: dict[tuple[str, str], str]  # (entity, attribute) -> value

    @property
    def token_to_id(self) -> dict[str, int]:
        return _index(self.vocab)

    def encode(self, text: str) -> list[int]:
        """Whitespace word split; every word must be in the vocabulary (the demo tasks only use these)."""
        table = self.token_to_id
        return [table.get(w, UNK_ID) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.vocab[i] for i in ids if i not in (PAD_ID, BOS_ID, EOS_ID))


@lru_cache(maxsize=None)
def _index(vocab: tuple[str, ...]) -> dict[str, int]:
    return {w: i for i, w in enumerate(vocab)}


def _pseudo_words(rng: random.Random, count: int, taken: set[str]) -> list[str]:
    onsets = "b c d f g h j k l m n p r s t v w z br dr gr kl pl st tr sk sn".split()
    vowels = "a e i o u ai ou ea".split()
    codas = ["", "", "n", "r", "l", "k", "s", "m", "x", "th"]
    words: list[str] = []
    while len(words) < count:
        n = rng.choice((2, 2, 3))
        w = "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(n)) + rng.choice(codas)
        if w not in taken:
            taken.add(w)
            words.append(w)
    return words


@lru_cache(maxsize=1)
def demo_language() -> Language:
    rng = random.Random(LANGUAGE_SEED)
    words: list[str] = list(SPECIALS) + STRUCTURE + list(ATTRIBUTES)
    for values in ATTRIBUTES.values():
        words += values
    words += FILLER_SUBJECTS + FILLER_VERBS + FILLER_PLACES + FILLER_TIMES + FILLER_EXTRA
    if len(set(words)) != len(words):
        raise AssertionError("demo vocabulary has duplicate words")
    taken = set(words)
    rag = _pseudo_words(rng, NUM_RAG_ENTITIES, taken)
    names = _pseudo_words(rng, NUM_BOOK_FIRST_NAMES + NUM_BOOK_LAST_NAMES, taken)
    firsts, lasts = names[:NUM_BOOK_FIRST_NAMES], names[NUM_BOOK_FIRST_NAMES:]
    book = [f"{first} {last}" for first in firsts for last in lasts]
    attrs = list(ATTRIBUTES)
    facts: dict[tuple[str, str], str] = {}
    for entity in book:
        for attr in rng.sample(attrs, BOOK_ATTRIBUTES_PER_ENTITY):
            facts[(entity, attr)] = rng.choice(ATTRIBUTES[attr])
    return Language(tuple(words + rag + names), tuple(rag), tuple(book), tuple(names), facts)


def build_tokenizer(out_dir: Path) -> None:
    """Write tokenizer.json (+ tokenizer_config.json) loadable by `tokenizers` and AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    lang = demo_language()
    tok = Tokenizer(models.WordLevel(dict(lang.token_to_id), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(list(SPECIALS))
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": 2048,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

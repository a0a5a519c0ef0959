"""The built-in synthetic corpus: short documents about a small generated world, with a known loss floor.

A world (`make_world(seed)`) is a set of made-up entities ("zorvak"), each with one value per attribute
(color, job, pet, home, age). Documents (`synthetic_documents(world, seed, n_docs)`) are drawn from five
kinds: facts, arithmetic, copy, agreement and count. Everything is lowercase ASCII, so byte and BPE
tokenizers agree on the text, and every kind has cheap probes for evaluation (`ddiloco.posttrain.tasks`).
Every random choice has a known probability and can be read back from the text, so `entropy_floor` gives
the cross-entropy an ideal model that knows the world reaches, in nats per token. Generation is pure,
seeded Python: about 10 MB of text in a few seconds.

Design notes (examples of each kind, the floor's assumptions): docs/internals.md, "The synthetic corpus".
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from ddiloco.data.tokenizer import ByteTokenizer, Tokenizer

logger = logging.getLogger(__name__)

ATTRIBUTE_VALUES: dict[str, tuple[str, ...]] = {
    "color": (
        "red",
        "blue",
        "green",
        "teal",
        "amber",
        "violet",
        "gray",
        "white",
        "black",
        "pink",
        "gold",
        "brown",
    ),
    "job": (
        "baker",
        "pilot",
        "farmer",
        "doctor",
        "sailor",
        "singer",
        "miner",
        "tailor",
        "judge",
        "potter",
        "weaver",
        "guard",
    ),
    "pet": ("cat", "dog", "owl", "fox", "goat", "crow", "frog", "horse", "snake", "mole", "hare", "crab"),
    "home": (
        "ashford",
        "northwick",
        "stonebay",
        "redmoor",
        "eastmere",
        "highcliff",
        "lakeview",
        "oakridge",
        "westport",
        "coldharbor",
        "brightwater",
        "elmstead",
    ),
    "age": tuple(str(a) for a in range(20, 80)),
}
FACT_TEMPLATES = (
    "the {attribute} of {entity} is {value}.",
    "{entity}'s {attribute} is {value}.",
    "q: what is the {attribute} of {entity}? a: {value}.",
)
AGREEMENT_NOUNS = ("dog", "cat", "bird", "tree", "car", "boat", "lamp", "door", "key", "book", "king", "girl")
AGREEMENT_PREPOSITIONS = ("near", "behind", "beside")
AGREEMENT_ADJECTIVES = (
    "happy",
    "old",
    "small",
    "red",
    "quiet",
    "tall",
    "new",
    "wet",
    "cold",
    "loud",
    "dark",
    "big",
)
LETTERS = "abcdefghijklmnopqrstuvwxyz"
DOC_KINDS: dict[str, float] = {
    "facts": 0.4,
    "arithmetic": 0.15,
    "copy": 0.15,
    "agreement": 0.15,
    "count": 0.15,
}

_ONSETS = tuple("b d f g k l m n p r s t v z br dr kr st th zh".split())
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("n", "r", "k", "s", "l", "x")


@dataclass(frozen=True)
class SyntheticWorld:
    """The facts every document is consistent with; rebuilt exactly by make_world(seed, n_entities)."""

    seed: int
    """Seed the world was drawn from."""
    entities: tuple[str, ...]
    """Entity names, unique lowercase words that clash with no other word of the corpus."""
    attributes: dict[str, tuple[str, ...]]
    """Attribute -> its possible values (the distractors of a multiple-choice probe)."""
    facts: dict[str, dict[str, str]]
    """Entity -> attribute -> value."""

    def value(self, entity: str, attribute: str) -> str:
        return self.facts[entity][attribute]

    def fact_items(self) -> list[tuple[str, str, str]]:
        """All (entity, attribute, value) triples in a fixed order."""
        return [(e, a, self.facts[e][a]) for e in self.entities for a in self.attributes]

    def fact_prompt(self, entity: str, attribute: str) -> tuple[str, str]:
        """A completion probe in the corpus's first template: ("the color of zorvak is", " teal")."""
        prompt = FACT_TEMPLATES[0].format(attribute=attribute, entity=entity, value="").rstrip(" .")
        return prompt, " " + self.facts[entity][attribute]


def _name(rng: random.Random) -> str:
    n_syllables = 2 if rng.random() < 0.7 else 3
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n_syllables)]
    if rng.random() < 0.6:
        parts.append(rng.choice(_CODAS))
    return "".join(parts)


def make_world(seed: int, n_entities: int = 64) -> SyntheticWorld:
    """A world of n_entities entities, each with one uniformly drawn value per attribute."""
    if n_entities < 1:
        raise ValueError(f"n_entities must be at least 1, got {n_entities}")
    rng = random.Random(f"ddiloco-world:{seed}")
    reserved = {w for values in ATTRIBUTE_VALUES.values() for w in values}
    reserved |= set(ATTRIBUTE_VALUES) | set(AGREEMENT_NOUNS) | {n + "s" for n in AGREEMENT_NOUNS}
    reserved |= (
        set(AGREEMENT_ADJECTIVES) | set(AGREEMENT_PREPOSITIONS) | {"copy", "reverse", "count", "the", "is"}
    )
    entities: list[str] = []
    seen: set[str] = set()
    while len(entities) < n_entities:
        name = _name(rng)
        if name not in seen and name not in reserved:
            seen.add(name)
            entities.append(name)
    facts = {e: {a: rng.choice(values) for a, values in ATTRIBUTE_VALUES.items()} for e in entities}
    return SyntheticWorld(seed=seed, entities=tuple(entities), attributes=dict(ATTRIBUTE_VALUES), facts=facts)


class _Generator:
    """Draws documents; every draw adds its -log p to self.nll."""

    def __init__(self, world: SyntheticWorld, seed: int) -> None:
        self.world = world
        self.rng = random.Random(f"ddiloco-docs:{world.seed}:{len(world.entities)}:{seed}")
        self.nll = 0.0
        self.kinds = tuple(DOC_KINDS)
        self.kind_table = _table(tuple(DOC_KINDS.values()))
        self.op_table = _table((0.5, 0.25, 0.25))  # +, -, *
        self.attributes = tuple(world.attributes)

    def uniform(self, n: int) -> int:
        """An index in [0, n), uniformly."""
        self.nll += math.log(n)
        return int(self.rng.random() * n)

    def pick(self, seq: Sequence[str]) -> str:
        return seq[self.uniform(len(seq))]

    def categorical(self, table: tuple[tuple[float, ...], tuple[float, ...]]) -> int:
        """An index drawn with the probabilities `_table` was built from."""
        cdf, nlls = table
        u = self.rng.random()
        i = 0
        while i < len(cdf) - 1 and u >= cdf[i]:
            i += 1
        self.nll += nlls[i]
        return i

    def document(self) -> str:
        return getattr(self, "_" + self.kinds[self.categorical(self.kind_table)])()

    def _facts(self) -> str:
        entity = self.pick(self.world.entities)
        facts = self.world.facts[entity]
        n = 1 + self.uniform(4)
        remaining = list(self.attributes)
        sentences = []
        for _ in range(n):
            attribute = remaining.pop(self.uniform(len(remaining)))  # without replacement
            template = FACT_TEMPLATES[self.uniform(len(FACT_TEMPLATES))]
            sentences.append(template.format(attribute=attribute, entity=entity, value=facts[attribute]))
        return " ".join(sentences)

    def _arithmetic(self) -> str:
        lines = []
        for _ in range(1 + self.uniform(3)):
            op = self.categorical(self.op_table)
            if op == 0:
                a, b = self.uniform(100), self.uniform(100)
                lines.append(f"{a}+{b}={a + b}")
            elif op == 2:
                a = self.uniform(100)
                b = self.uniform(a + 1)
                lines.append(f"{a}-{b}={a - b}")
            else:
                a, b = self.uniform(13), self.uniform(13)
                lines.append(f"{a}*{b}={a * b}")
        return "\n".join(lines)

    def _copy(self) -> str:
        lines = []
        for _ in range(1 + self.uniform(3)):
            s = "".join(self.pick(LETTERS) for _ in range(3 + self.uniform(6)))
            if self.uniform(2) == 0:
                lines.append(f"copy: {s} -> {s}.")
            else:
                lines.append(f"reverse: {s} -> {s[::-1]}.")
        return "\n".join(lines)

    def _agreement(self) -> str:
        sentences = []
        for _ in range(1 + self.uniform(3)):
            subject, plural = self.pick(AGREEMENT_NOUNS), self.uniform(2) == 1
            attractor, attractor_plural = self.pick(AGREEMENT_NOUNS), self.uniform(2) == 1
            preposition, adjective = self.pick(AGREEMENT_PREPOSITIONS), self.pick(AGREEMENT_ADJECTIVES)
            s = subject + "s" if plural else subject
            a = attractor + "s" if attractor_plural else attractor
            verb = "are" if plural else "is"
            sentences.append(f"the {s} {preposition} the {a} {verb} {adjective}.")
        return " ".join(sentences)

    def _count(self) -> str:
        lines = []
        for _ in range(1 + self.uniform(3)):
            start, n = self.uniform(50), 3 + self.uniform(6)
            lines.append("count: " + " ".join(str(start + i) for i in range(n)) + ".")
        return "\n".join(lines)


def _table(probs: tuple[float, ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(cumulative probabilities, -log p) of a categorical distribution."""
    if abs(sum(probs) - 1.0) > 1e-9 or min(probs) <= 0:
        raise ValueError(f"probabilities must be positive and sum to 1, got {probs}")
    return tuple(itertools.accumulate(probs)), tuple(-math.log(p) for p in probs)


def _generate(world: SyntheticWorld, seed: int, n_docs: int) -> tuple[list[str], float]:
    if n_docs < 0:
        raise ValueError(f"n_docs must be >= 0, got {n_docs}")
    gen = _Generator(world, seed)
    docs = [gen.document() for _ in range(n_docs)]
    return docs, gen.nll


def synthetic_documents(world: SyntheticWorld, seed: int, n_docs: int) -> list[str]:
    """n_docs documents consistent with world; the same (world, seed) always gives the same list."""
    return _generate(world, seed, n_docs)[0]


def entropy_floor(world: SyntheticWorld, seed: int, n_docs: int, tokenizer: Tokenizer) -> float:
    """Information content of synthetic_documents(world, seed, n_docs) per token, in nats (see module doc)."""
    docs, nll = _generate(world, seed, n_docs)
    if not docs:
        raise ValueError("entropy_floor needs n_docs >= 1")
    if isinstance(tokenizer, ByteTokenizer):
        n_tokens = sum(len(d.encode("utf-8")) for d in docs)
    else:
        n_tokens = sum(len(ids) for ids in tokenizer.encode_batch(docs))
    n_tokens += len(docs)  # one <eos> after every document
    return nll / n_tokens

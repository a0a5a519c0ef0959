"""Synthetic corpus: determinism, consistency with its world, an independently recomputed entropy floor,
and a tiny GPT that learns from it."""

import math
import re

import pytest
import torch

from ddiloco.data.loader import ShardLoader, tokenize_corpus
from ddiloco.data.synthetic import (
    AGREEMENT_ADJECTIVES,
    AGREEMENT_NOUNS,
    AGREEMENT_PREPOSITIONS,
    DOC_KINDS,
    FACT_TEMPLATES,
    entropy_floor,
    make_world,
    synthetic_documents,
)
from ddiloco.data.tokenizer import ByteTokenizer, train_bpe
from ddiloco.model.gpt import configure_optimizer, gpt_config, init_model

torch.set_num_threads(1)

FACT_RE = re.compile(
    r"the (\w+) of (\w+) is (\w+)\.|(\w+)'s (\w+) is (\w+)\.|q: what is the (\w+) of (\w+)\? a: (\w+)\."
)
AGREE_RE = re.compile(r"the (\w+) (\w+) the (\w+) (is|are) (\w+)\.")
ARITH_RE = re.compile(r"(\d+)([+*-])(\d+)=(\d+)")
COPY_RE = re.compile(r"(copy|reverse): ([a-z]+) -> ([a-z]+)\.")
COUNT_RE = re.compile(r"count: ([\d ]+)\.")


@pytest.fixture(scope="module")
def world():
    return make_world(7, n_entities=32)


def kind_of(doc: str) -> str:
    if doc.startswith(("copy:", "reverse:")):
        return "copy"
    if doc.startswith("count:"):
        return "count"
    if doc[0].isdigit():
        return "arithmetic"
    if doc.startswith("the ") and doc.split()[1].rstrip("s") in AGREEMENT_NOUNS:
        return "agreement"
    return "facts"


def reference_nll(doc: str, world) -> float:
    """-log p(doc), recovered from the text alone (so it also proves every choice is readable from it)."""
    kind = kind_of(doc)
    nll = -math.log(DOC_KINDS[kind]) + math.log(4 if kind == "facts" else 3)  # kind, then number of items
    if kind == "facts":
        sentences = FACT_RE.findall(doc)
        assert " ".join(_fact_text(m) for m in sentences) == doc
        entities = {m[1] or m[3] or m[7] for m in sentences}
        assert len(entities) == 1
        nll += math.log(len(world.entities))
        for i, m in enumerate(sentences):
            attribute, entity, value = (m[0], m[1], m[2]) if m[0] else (m[4], m[3], m[5]) if m[3] else m[6:9]
            assert world.value(entity, attribute) == value  # the model is credited with knowing the world
            nll += math.log(len(world.attributes) - i) + math.log(len(FACT_TEMPLATES))
    elif kind == "arithmetic":
        for line in doc.split("\n"):
            a, op, b, c = ARITH_RE.fullmatch(line).groups()
            a, b, c = int(a), int(b), int(c)
            assert c == {"+": a + b, "-": a - b, "*": a * b}[op]
            nll += {
                "+": math.log(2) + 2 * math.log(100),
                "-": math.log(4) + math.log(100) + math.log(a + 1),
            }.get(op, math.log(4) + 2 * math.log(13))
    elif kind == "copy":
        for line in doc.split("\n"):
            op, s, out = COPY_RE.fullmatch(line).groups()
            assert out == (s if op == "copy" else s[::-1])
            nll += math.log(2) + math.log(6) + len(s) * math.log(26)
    elif kind == "agreement":
        sentences = AGREE_RE.findall(doc)
        assert " ".join(f"the {s} {p} the {a} {v} {j}." for s, p, a, v, j in sentences) == doc
        for subject, prep, attractor, verb, adjective in sentences:
            assert verb == ("are" if subject.endswith("s") else "is")
            assert prep in AGREEMENT_PREPOSITIONS and adjective in AGREEMENT_ADJECTIVES
            assert attractor.rstrip("s") in AGREEMENT_NOUNS
            nll += 3 * math.log(12) + 2 * math.log(2) + math.log(3)
    else:
        for line in doc.split("\n"):
            numbers = [int(x) for x in COUNT_RE.fullmatch(line).group(1).split()]
            assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
            nll += math.log(50) + math.log(6)
    return nll


def _fact_text(m: tuple[str, ...]) -> str:
    if m[0]:
        return FACT_TEMPLATES[0].format(attribute=m[0], entity=m[1], value=m[2])
    if m[3]:
        return FACT_TEMPLATES[1].format(entity=m[3], attribute=m[4], value=m[5])
    return FACT_TEMPLATES[2].format(attribute=m[6], entity=m[7], value=m[8])


def test_world_deterministic(world):
    again = make_world(7, n_entities=32)
    assert again == world
    assert len(set(world.entities)) == 32
    assert make_world(8, n_entities=32).entities != world.entities
    assert world.fact_items()[0] == (world.entities[0], "color", world.facts[world.entities[0]]["color"])
    prompt, answer = world.fact_prompt(world.entities[0], "pet")
    assert prompt == f"the pet of {world.entities[0]} is" and answer == " " + world.value(
        world.entities[0], "pet"
    )


def test_documents_deterministic_and_seeded(world):
    a = synthetic_documents(world, seed=1, n_docs=300)
    assert a == synthetic_documents(world, seed=1, n_docs=300)
    assert a[:100] == synthetic_documents(world, seed=1, n_docs=100)  # a prefix of a longer run
    assert a != synthetic_documents(world, seed=2, n_docs=300)
    assert a != synthetic_documents(make_world(8, n_entities=32), seed=1, n_docs=300)
    assert all(d and d.isascii() and d == d.lower() for d in a)


def test_documents_consistent_and_floor_recomputed(world):
    docs = synthetic_documents(world, seed=3, n_docs=3000)
    assert {kind_of(d) for d in docs} == set(DOC_KINDS)
    nll = sum(reference_nll(d, world) for d in docs)
    n_tokens = sum(len(d.encode()) for d in docs) + len(docs)
    floor = entropy_floor(world, seed=3, n_docs=3000, tokenizer=ByteTokenizer())
    assert floor == pytest.approx(nll / n_tokens, rel=1e-9)
    assert 0.2 < floor < math.log(258)


def test_facts_appear_in_text(world):
    text = "\n".join(synthetic_documents(world, seed=4, n_docs=5000))
    seen = {(e, a, v) for e, a, v in world.fact_items() if f"the {a} of {e} is {v}." in text}
    assert len(seen) > 0.8 * len(world.fact_items())


def test_floor_under_bpe(world):
    docs = synthetic_documents(world, seed=5, n_docs=2000)
    bpe = train_bpe(docs, 400)
    byte_floor = entropy_floor(world, 5, 2000, ByteTokenizer())
    bpe_floor = entropy_floor(world, 5, 2000, bpe)
    n_bytes, n_bpe = (tokenize_corpus(docs, t).numel() for t in (ByteTokenizer(), bpe))
    assert bpe_floor == pytest.approx(byte_floor * n_bytes / n_bpe)  # same information, fewer tokens
    assert byte_floor < bpe_floor < math.log(bpe.vocab_size)


def test_tiny_gpt_learns_the_corpus():
    world = make_world(0, n_entities=16)
    tokens = tokenize_corpus(synthetic_documents(world, 0, 3000), ByteTokenizer())
    loader = ShardLoader(tokens, batch_size=16, seq_len=64, seed=0)
    model = init_model(gpt_config("tiny", vocab_size=258, block_size=64), seed=0)
    opt = configure_optimizer(model, lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(200):
        x, y = loader.next_batch()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    late = sum(losses[-20:]) / 20
    assert losses[0] == pytest.approx(math.log(258), abs=0.1)
    assert late < 0.5 * losses[0]
    assert late > entropy_floor(world, 0, 3000, ByteTokenizer())

"""Downstream tasks: item construction and scoring (exact match by greedy generation, multiple choice by
summed log-likelihood).

On the synthetic corpus (`synthetic_tasks`) the tasks probe the run's world with an evaluation seed: fact
recall (`fact_mc`, `fact_em`), `arithmetic`, `copy`, `agreement` and `count`. On a user corpus
(`cloze_tasks`) they are cloze items from held-out text: the next word after ~24 words, against 3 other
words. Every prompt starts with <eos>, as every training document does. Exact match: a greedy continuation
that starts with the answer and then does not go on with a letter or digit. Multiple choice: the highest
summed log-probability, ties split so that a uniform model scores chance exactly. Scoring takes any module
whose forward(idx) returns logits or (logits, loss); everything is deterministic given the seed.

Design notes (the task table, what each task measures): docs/internals.md, "Downstream tasks".
"""

from __future__ import annotations

import logging
import random
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ddiloco.data.synthetic import AGREEMENT_NOUNS, AGREEMENT_PREPOSITIONS, LETTERS, SyntheticWorld
from ddiloco.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MC_CHOICES = 4
CLOZE_CONTEXT_WORDS = 24


@dataclass(frozen=True, slots=True)
class TaskItem:
    """One probe. Multiple choice when `choices` is non-empty (the answer is one of them), else exact match."""

    task: str
    """Name of the task the item belongs to."""
    prompt: str
    """Text the model continues (without the leading <eos>, which scoring adds)."""
    answer: str
    """The correct continuation."""
    choices: tuple[str, ...] = ()
    """Candidate continuations for multiple choice; empty for exact match."""
    chat: bool = False
    """An instruction: the prompt is a user turn, in the tokenizer's chat template when it has one."""

    @property
    def metric(self) -> str:
        return "multiple_choice" if self.choices else "exact_match"


# --- task construction ---------------------------------------------------------------------------------------
def _rng(seed: int, name: str) -> random.Random:
    return random.Random(f"ddiloco-tasks:{seed}:{name}")


def _shuffled(rng: random.Random, xs: Sequence[str]) -> tuple[str, ...]:
    out = list(xs)
    rng.shuffle(out)
    return tuple(out)


def fact_choices(world: SyntheticWorld, entity: str, attribute: str, rng: random.Random) -> tuple[str, ...]:
    """The right value and MC_CHOICES - 1 other values of the attribute, in a seeded order, each with a space."""
    value = world.value(entity, attribute)
    others = sorted(v for v in world.attributes[attribute] if v != value)
    return _shuffled(rng, [" " + v for v in [value, *rng.sample(others, MC_CHOICES - 1)]])


def _sample_facts(world: SyntheticWorld, rng: random.Random, n: int) -> list[tuple[str, str, str]]:
    items = world.fact_items()
    return rng.sample(items, min(n, len(items)))


def random_word(rng: random.Random, lo: int = 5, hi: int = 8) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def arithmetic_problem(rng: random.Random) -> tuple[str, str]:
    """("17+25=", "42"), with the corpus's mix of operators and ranges."""
    u = rng.random()
    if u < 0.5:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"{a}+{b}=", str(a + b)
    if u < 0.75:
        a = rng.randrange(100)
        b = rng.randrange(a + 1)
        return f"{a}-{b}=", str(a - b)
    a, b = rng.randrange(13), rng.randrange(13)
    return f"{a}*{b}=", str(a * b)


def agreement_problem(rng: random.Random) -> tuple[str, bool]:
    """("the dogs near the cat", plural?) with an attractor noun of random number."""
    subject, attractor = rng.choice(AGREEMENT_NOUNS), rng.choice(AGREEMENT_NOUNS)
    plural, attractor_plural = rng.random() < 0.5, rng.random() < 0.5
    s = subject + "s" if plural else subject
    a = attractor + "s" if attractor_plural else attractor
    return f"the {s} {rng.choice(AGREEMENT_PREPOSITIONS)} the {a}", plural


def synthetic_tasks(world: SyntheticWorld, seed: int, n_items: int) -> dict[str, list[TaskItem]]:
    """The built-in task suite for a synthetic run: n_items per task (fewer for facts if the world is small)."""
    tasks: dict[str, list[TaskItem]] = {}
    rng = _rng(seed, "fact_mc")
    tasks["fact_mc"] = [
        TaskItem("fact_mc", world.fact_prompt(e, a)[0], " " + v, fact_choices(world, e, a, rng))
        for e, a, v in _sample_facts(world, rng, n_items)
    ]
    rng = _rng(seed, "fact_em")
    tasks["fact_em"] = [
        TaskItem("fact_em", *world.fact_prompt(e, a)) for e, a, _ in _sample_facts(world, rng, n_items)
    ]
    rng = _rng(seed, "arithmetic")
    tasks["arithmetic"] = [TaskItem("arithmetic", *arithmetic_problem(rng)) for _ in range(n_items)]
    rng = _rng(seed, "copy")
    copies = []
    for i in range(n_items):
        w = random_word(rng)
        copies.append(
            TaskItem("copy", f"copy: {w} ->", " " + w)
            if i % 2 == 0
            else TaskItem("copy", f"reverse: {w} ->", " " + w[::-1])
        )
    tasks["copy"] = copies
    rng = _rng(seed, "agreement")
    agreement = []
    for _ in range(n_items):
        prompt, plural = agreement_problem(rng)
        answer = " are" if plural else " is"
        agreement.append(TaskItem("agreement", prompt, answer, _shuffled(rng, [" are", " is"])))
    tasks["agreement"] = agreement
    rng = _rng(seed, "count")
    counts = []
    for _ in range(n_items):
        start, n = rng.randrange(50), rng.randint(3, 6)
        counts.append(
            TaskItem("count", "count: " + " ".join(str(start + i) for i in range(n)), f" {start + n}")
        )
    tasks["count"] = counts
    return tasks


_WORD = re.compile(r"[A-Za-z]{3,}")


def cloze_tasks(texts: Sequence[str], seed: int, n_items: int) -> dict[str, list[TaskItem]]:
    """Multiple-choice cloze from held-out text: which word comes next, against 3 held-out distractors."""
    words_by_doc = [t.split() for t in texts]
    vocabulary = sorted({w for ws in words_by_doc for w in ws if _WORD.fullmatch(w)})
    positions = [
        (d, i)
        for d, ws in enumerate(words_by_doc)
        for i in range(4, len(ws))
        if _WORD.fullmatch(ws[i])  # a whole word (no punctuation) as the answer
    ]
    if len(vocabulary) < MC_CHOICES or not positions:
        log.warning("held-out text is too short for cloze items (%d candidate words)", len(vocabulary))
        return {"cloze": []}
    rng = _rng(seed, "cloze")
    items = []
    for d, i in rng.sample(positions, min(n_items, len(positions))):
        ws = words_by_doc[d]
        answer = ws[i]
        distractors: set[str] = set()
        while len(distractors) < MC_CHOICES - 1:
            w = rng.choice(vocabulary)
            if w.lower() != answer.lower():
                distractors.add(w)
        choices = _shuffled(rng, [" " + w for w in [answer, *sorted(distractors)]])
        items.append(
            TaskItem("cloze", " ".join(ws[max(0, i - CLOZE_CONTEXT_WORDS) : i]), " " + answer, choices)
        )
    return {"cloze": items}


# --- scoring -------------------------------------------------------------------------------------------------
def _logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx)
    return (out[0] if isinstance(out, tuple) else out).float()  # (B, T, V)


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _block_size(model: nn.Module, default: int = 1 << 30) -> int:
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "block_size", default))


def encode_prompt(tokenizer: Tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """<eos> + prompt; an instruction (`chat`) as the tokenizer gives instructions (`chat_prompt_ids`)."""
    return tokenizer.chat_prompt_ids(prompt) if chat else [tokenizer.eos_id, *tokenizer.encode(prompt)]


@torch.no_grad()
def choice_logprobs(
    model: nn.Module,
    tokenizer: Tokenizer,
    queries: Sequence[tuple[str, Sequence[str]]],
    batch_size: int = 64,
    chat: Sequence[bool] | None = None,
) -> list[list[float]]:
    """For each (prompt, choices): the summed log-probability of each choice's tokens given <eos> + prompt.

    All (prompt, choice) sequences are scored in batches, right-padded: padding comes after every scored
    position, so under a causal model it changes nothing.
    """
    device, block = _device(model), _block_size(model)
    seqs: list[list[int]] = []
    spans: list[int] = []
    for q, (prompt, choices) in enumerate(queries):
        ctx = encode_prompt(tokenizer, prompt, bool(chat and chat[q]))
        for c in choices:
            cont = tokenizer.encode(c)
            if not cont:
                raise ValueError(f"choice {c!r} encodes to no tokens")
            seqs.append((ctx + cont)[-block - 1 :])  # the model sees at most block_size tokens
            spans.append(len(cont))
    flat: list[float] = []
    for lo in range(0, len(seqs), batch_size):
        chunk = seqs[lo : lo + batch_size]
        width = max(len(s) for s in chunk)
        idx = torch.full((len(chunk), width), tokenizer.pad_id, dtype=torch.long)  # (N, W)
        for i, s in enumerate(chunk):
            idx[i, : len(s)] = torch.tensor(s)
        idx = idx.to(device)
        logp = F.log_softmax(_logits(model, idx[:, :-1]), dim=-1)  # (N, W-1, V)
        for i, s in enumerate(chunk):
            n = spans[lo + i]
            pos = torch.arange(len(s) - 1 - n, len(s) - 1, device=device)  # positions predicting the choice
            flat.append(float(logp[i, pos, idx[i, pos + 1]].sum()))
    out, k = [], 0
    for _, choices in queries:
        out.append(flat[k : k + len(choices)])
        k += len(choices)
    return out


def mc_credit(scores: Sequence[float], correct: int, tol: float = 1e-6) -> float:
    """1 if the correct choice scores best alone, 1/k if it ties with k-1 others, else 0."""
    best = max(scores)
    tied = [i for i, s in enumerate(scores) if s >= best - tol]
    return 1.0 / len(tied) if correct in tied else 0.0


def exact_match(generated: str, answer: str) -> bool:
    """The continuation starts with the answer, and the answer is not the start of a longer word/number."""
    if not generated.startswith(answer):
        return False
    rest = generated[len(answer) :]
    return not rest or not rest[0].isalnum()


@torch.no_grad()
def greedy_continuations(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    max_new_tokens: Sequence[int],
    chat: Sequence[bool] | None = None,
) -> list[str]:
    """Greedy continuation of each prompt (after <eos>), stopping at <eos>. Prompts of equal token length
    are batched together, so no padding ever enters the context."""
    device, block = _device(model), _block_size(model)
    encoded = [encode_prompt(tokenizer, p, bool(chat and chat[i]))[-block:] for i, p in enumerate(prompts)]
    groups: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        groups[len(ids)].append(i)
    out: list[str] = [""] * len(prompts)
    for _, members in sorted(groups.items()):
        idx = torch.tensor([encoded[i] for i in members], dtype=torch.long, device=device)  # (B, T)
        steps = max(max_new_tokens[i] for i in members)
        new = torch.empty(len(members), 0, dtype=torch.long, device=device)
        for _ in range(steps):
            nxt = _logits(model, idx[:, -block:])[:, -1, :].argmax(dim=-1)  # (B,)
            idx = torch.cat([idx, nxt[:, None]], dim=1)
            new = torch.cat([new, nxt[:, None]], dim=1)
            if bool((new == tokenizer.eos_id).any(dim=1).all()):
                break
        for row, i in enumerate(members):
            ids = new[row, : max_new_tokens[i]].tolist()
            if tokenizer.eos_id in ids:
                ids = ids[: ids.index(tokenizer.eos_id)]
            out[i] = tokenizer.decode(ids)
    return out


@torch.no_grad()
def score_items(model: nn.Module, tokenizer: Tokenizer, items: Sequence[TaskItem]) -> list[float]:
    """Credit in [0, 1] per item (exact match: 0/1; multiple choice: see `mc_credit`)."""
    was_training = model.training
    model.eval()
    credits: list[float] = [0.0] * len(items)
    em = [i for i, it in enumerate(items) if not it.choices]
    if em:
        gens = greedy_continuations(
            model,
            tokenizer,
            [items[i].prompt for i in em],
            [len(tokenizer.encode(items[i].answer)) + 2 for i in em],
            [items[i].chat for i in em],
        )
        for i, g in zip(em, gens, strict=True):
            credits[i] = float(exact_match(g, items[i].answer))
    mc = [i for i, it in enumerate(items) if it.choices]
    for i in mc:
        if items[i].answer not in items[i].choices:
            raise ValueError(f"item {items[i]} lists choices that do not include its answer")
    scores = choice_logprobs(
        model, tokenizer, [(items[i].prompt, items[i].choices) for i in mc], chat=[items[i].chat for i in mc]
    )
    for i, sc in zip(mc, scores, strict=True):
        credits[i] = mc_credit(sc, items[i].choices.index(items[i].answer))
    model.train(was_training)
    return credits


def evaluate_tasks(
    model: nn.Module, tokenizer: Tokenizer, tasks: dict[str, list[TaskItem]]
) -> dict[str, dict[str, float | int | str]]:
    """{task: {accuracy, n, metric}} for every non-empty task."""
    results: dict[str, dict[str, float | int | str]] = {}
    for name in sorted(tasks):
        items = tasks[name]
        if not items:
            continue
        credits = score_items(model, tokenizer, items)
        results[name] = {"accuracy": sum(credits) / len(credits), "n": len(items), "metric": items[0].metric}
    return results

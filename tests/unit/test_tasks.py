"""Downstream task metrics on models whose answers are known: an oracle scores 100%, a uniform model chance."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddiloco.data.synthetic import make_world
from ddiloco.data.tokenizer import ByteTokenizer
from ddiloco.model.gpt import GPTConfig, init_model
from ddiloco.posttrain.tasks import (
    TaskItem,
    cloze_tasks,
    encode_prompt,
    evaluate_tasks,
    exact_match,
    mc_credit,
    score_items,
    synthetic_tasks,
)

TOK = ByteTokenizer()


class Oracle(nn.Module):
    """Puts (almost) all probability on the next token of whichever known sequence the context continues;
    uniform where the context leaves every known sequence."""

    def __init__(self, items: list[TaskItem], vocab_size: int = TOK.vocab_size) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.next: dict[tuple[int, ...], int] = {}
        for it in items:
            seq = encode_prompt(TOK, it.prompt) + TOK.encode(it.answer) + [TOK.eos_id]
            for t in range(1, len(seq)):
                self.next[tuple(seq[:t])] = seq[t]

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, None]:
        B, T = idx.shape
        logits = torch.zeros(B, T, self.vocab_size)
        for b in range(B):
            row = idx[b].tolist()
            for t in range(T):
                nxt = self.next.get(tuple(row[: t + 1]))
                if nxt is not None:
                    logits[b, t, nxt] = 50.0
        return logits, None


class Uniform(nn.Module):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*idx.shape, TOK.vocab_size)


@pytest.fixture(scope="module")
def tasks() -> dict[str, list[TaskItem]]:
    return synthetic_tasks(make_world(3, n_entities=6), seed=11, n_items=12)


def test_suite_has_every_task_with_well_formed_items(tasks):
    assert set(tasks) == {"fact_mc", "fact_em", "arithmetic", "copy", "agreement", "count"}
    world = make_world(3, n_entities=6)
    for item in tasks["fact_mc"]:
        assert len(item.choices) == 4 and len(set(item.choices)) == 4 and item.answer in item.choices
        attribute = item.prompt.split()[1]  # "the color of zorvak is"
        assert {c.strip() for c in item.choices} <= set(world.attributes[attribute])
    for item in tasks["arithmetic"]:
        assert str(eval(item.prompt[:-1])) == item.answer  # noqa: S307 - digits and one operator
    assert all(
        it.metric == "exact_match"
        for name in ("fact_em", "arithmetic", "copy", "count")
        for it in tasks[name]
    )
    positions = [it.choices.index(it.answer) for it in tasks["fact_mc"]]
    assert len(set(positions)) > 1, "the right answer must not always be in the same place"


def test_tasks_are_deterministic_given_the_seed():
    world = make_world(3, n_entities=6)
    assert synthetic_tasks(world, 5, 10) == synthetic_tasks(world, 5, 10)
    assert synthetic_tasks(world, 5, 10)["arithmetic"] != synthetic_tasks(world, 6, 10)["arithmetic"]


def test_oracle_scores_every_task_perfectly(tasks):
    oracle = Oracle([it for items in tasks.values() for it in items])
    results = evaluate_tasks(oracle, TOK, tasks)
    assert {k: v["accuracy"] for k, v in results.items()} == {k: 1.0 for k in tasks}
    assert results["fact_mc"]["metric"] == "multiple_choice" and results["copy"]["metric"] == "exact_match"


def test_oracle_of_wrong_answers_scores_zero(tasks):
    wrong = [TaskItem(it.task, it.prompt, " nope", it.choices) for it in tasks["fact_em"]]
    assert score_items(Oracle(wrong), TOK, tasks["fact_em"]) == [0.0] * len(wrong)
    decoys = [
        TaskItem(it.task, it.prompt, next(c for c in it.choices if c != it.answer)) for it in tasks["fact_mc"]
    ]
    assert score_items(Oracle(decoys), TOK, tasks["fact_mc"]) == [0.0] * len(decoys)


def test_uniform_model_scores_chance_on_multiple_choice():
    items = [TaskItem("mc", f"pick {i}", " ab", (" ab", " cd", " ef", " gh")) for i in range(8)]
    assert score_items(Uniform(), TOK, items) == [0.25] * 8
    pairs = [TaskItem("mc2", "x", " cd", (" ab", " cd")) for _ in range(4)]
    assert evaluate_tasks(Uniform(), TOK, {"mc2": pairs})["mc2"]["accuracy"] == 0.5


def test_exact_match_needs_a_word_boundary_after_the_answer():
    assert exact_match(" 7", " 7") and exact_match(" 7\n8", " 7") and exact_match(" teal.", " teal")
    assert not exact_match(" 71", " 7") and not exact_match(" teals", " teal") and not exact_match(" 8", " 7")


def test_mc_credit_splits_ties():
    assert mc_credit([-1.0, -2.0], 0) == 1.0
    assert mc_credit([-1.0, -2.0], 1) == 0.0
    assert mc_credit([-1.0, -1.0, -3.0], 1) == 0.5


def test_cloze_items_come_from_the_text_and_an_oracle_solves_them():
    texts = [
        "the quick brown fox jumps over the lazy dog while seven small birds watch from the old tree",
        "rivers carry water from mountains towards distant oceans through valleys and plains every season",
    ]
    tasks = cloze_tasks(texts, seed=1, n_items=6)
    assert tasks == cloze_tasks(texts, seed=1, n_items=6)
    items = tasks["cloze"]
    assert len(items) == 6
    for it in items:
        assert it.answer in it.choices and len(set(it.choices)) == 4
        assert any(f"{it.prompt}{it.answer}" in t for t in texts)
    assert evaluate_tasks(Oracle(items), TOK, tasks)["cloze"]["accuracy"] == 1.0


def test_a_real_gpt_scores_items_longer_than_its_context():
    model = init_model(
        GPTConfig(vocab_size=TOK.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16), seed=0
    )
    long_prompt = "count: " + " ".join(str(i) for i in range(30))
    items = [TaskItem("count", long_prompt, " 30"), TaskItem("mc", long_prompt, " 30", (" 30", " 31"))]
    credits = score_items(model, TOK, items)
    assert all(0.0 <= c <= 1.0 for c in credits)

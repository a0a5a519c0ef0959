"""SFT data and training: the loss mask covers only the response, the split holds facts out by pair, and a
few steps lower the response loss."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn import functional as F

from ddiloco.data.synthetic import make_world
from ddiloco.data.tokenizer import ByteTokenizer
from ddiloco.model.gpt import IGNORE_INDEX, GPTConfig, init_model
from ddiloco.posttrain import sft
from ddiloco.posttrain.sft import (
    SFTConfig,
    build_example,
    collate,
    read_jsonl_pairs,
    split_items,
    synthetic_instructions,
    train_sft,
)
from ddiloco.posttrain.tasks import TaskItem

TOK = ByteTokenizer()


def test_mask_covers_exactly_the_response_and_its_eos():
    x, y = build_example(TOK, "q?", " ok", block_size=64)
    ids = [TOK.eos_id, *b"q?", *b" ok", TOK.eos_id]
    assert x == ids[:-1]
    assert y == [IGNORE_INDEX, IGNORE_INDEX, *b" ok", TOK.eos_id]


def test_over_long_prompts_lose_their_start_never_the_response():
    x, y = build_example(TOK, "p" * 100, " answer", block_size=16)
    assert len(x) == len(y) == 16
    assert [t for t in y if t != IGNORE_INDEX] == [*b" answer", TOK.eos_id]


def test_masked_loss_equals_cross_entropy_over_response_positions_only():
    model = init_model(
        GPTConfig(vocab_size=TOK.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16), seed=0
    )
    x, y = collate(
        [build_example(TOK, "what?", " this", 32), build_example(TOK, "longer prompt", " no", 32)], TOK.pad_id
    )
    assert x[0, -1] == TOK.pad_id and y[0, -1] == IGNORE_INDEX  # the shorter example is right-padded
    logits, loss = model(x, y)
    keep = y != IGNORE_INDEX
    assert int(keep.sum()) == len(b" this") + 1 + len(b" no") + 1
    manual = F.cross_entropy(logits[keep], y[keep])
    torch.testing.assert_close(loss, manual)


def test_facts_are_held_out_by_entity_attribute_pair():
    world = make_world(0, n_entities=8)
    keyed = synthetic_instructions(world, seed=0, items_per_kind=50)
    train, test = split_items(keyed, seed=0, fraction=0.25, eval_items=1000)
    assert set(test) == {"instr_fact", "instr_arithmetic", "instr_copy", "instr_agreement", "instr_count"}
    train_prompts = {it.prompt for it in train}
    for items in test.values():
        assert not train_prompts & {it.prompt for it in items}
    n_facts = len(world.fact_items())
    assert 0.1 * n_facts < len(test["instr_fact"]) < 0.4 * n_facts
    assert split_items(keyed, seed=0, fraction=0.25, eval_items=1000) == (train, test)


def test_jsonl_pairs_are_read_and_bad_lines_named(tmp_path):
    good = tmp_path / "ok.jsonl"
    good.write_text(json.dumps({"prompt": "hi", "response": " there"}) + "\n\n")
    assert read_jsonl_pairs(good) == [("hi", TaskItem("instructions", "hi", " there", chat=True))]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*response"):
        read_jsonl_pairs(bad)


def _response_loss(model, items) -> float:
    x, y = collate([build_example(TOK, it.prompt, it.answer, 32) for it in items], TOK.pad_id)
    with torch.no_grad():
        return float(model(x, y)[1])


@pytest.mark.parametrize("replay", [False, True])
def test_a_few_steps_lower_the_response_loss(replay):
    torch.manual_seed(0)
    model = init_model(
        GPTConfig(vocab_size=TOK.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32), seed=0
    )
    items = [TaskItem("t", f"name {c}?", f" {c * 3}") for c in "abcdefgh"]
    stream = torch.randint(0, 256, (2000,)) if replay else None
    before = _response_loss(model, items)
    cfg = SFTConfig(steps=40, batch_size=8, lr=3e-3, warmup_steps=5, replay_fraction=0.5 if replay else 0.0)
    losses = train_sft(model, TOK, items, cfg, seed=0, replay=stream)
    after = _response_loss(model, items)
    assert len(losses) == 40
    assert after < 0.7 * before, (before, after)


def test_training_on_the_shared_schedule_is_bitwise_the_closed_form_one(monkeypatch):
    """SFT's rate comes from `ddiloco.run.schedule.lr_at`; where a warm-up step's double differs from the closed
    form lr·(s+1)/W in its last bit, the fp32 update does not: losses and parameters are identical."""
    cfg = SFTConfig(steps=12, batch_size=8, lr=3e-3, warmup_steps=7, replay_fraction=0.0)
    items = [TaskItem("t", f"name {c}?", f" {c * 3}") for c in "abcd"]

    def closed_form(step: int, c: SFTConfig) -> float:
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        progress = (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps)
        return c.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))

    def train() -> tuple[list[float], list[torch.Tensor]]:
        model = init_model(
            GPTConfig(vocab_size=TOK.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32), 0
        )
        return train_sft(model, TOK, items, cfg, seed=0), [p.detach().clone() for p in model.parameters()]

    assert any(sft.sft_lr(s, cfg) != closed_form(s, cfg) for s in range(cfg.steps))  # the case is exercised
    shared = train()
    monkeypatch.setattr(sft, "sft_lr", closed_form)
    closed = train()
    assert shared[0] == closed[0]
    assert all(torch.equal(a, b) for a, b in zip(shared[1], closed[1], strict=True))

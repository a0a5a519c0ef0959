"""`ddiloco sft`: supervised fine-tuning of a checkpoint on prompt/response pairs, loss on the response only.

Instruction data is built in for synthetic runs (the downstream tasks rephrased as instructions, a format
pre-training never showed) or a user's JSONL file of `prompt` / `response` objects. Items are held out by a
keyed hash of their split key; for facts the key is the (entity, attribute) pair, so answering a held-out
fact after SFT shows the format transferred to pretrained knowledge. Every example is <eos> + prompt +
response + <eos> with prompt targets -100, so only the response is learned; AdamW with warm-up and cosine
decay, one process. The result is the signed payload `sft/model.safetensors` (kind "sft") and `sft/meta.json`;
the base model and the replay shard are read through the `RunRoot`, so with the run key they must verify.

Design notes (examples of each kind): docs/internals.md, "Supervised fine-tuning".
"""

from __future__ import annotations

import logging
import random
import time
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ddiloco.config.run import SFTConfig
from ddiloco.data.loader import iter_jsonl
from ddiloco.data.synthetic import SyntheticWorld, make_world
from ddiloco.data.tokenizer import Tokenizer
from ddiloco.model.gpt import GPT, IGNORE_INDEX, configure_optimizer
from ddiloco.platform.devices import resolve_device
from ddiloco.posttrain.evaluate import load_model
from ddiloco.posttrain.tasks import (
    TaskItem,
    agreement_problem,
    arithmetic_problem,
    encode_prompt,
    evaluate_tasks,
    random_word,
)
from ddiloco.run.root import RunRoot
from ddiloco.run.schedule import lr_at

log = logging.getLogger(__name__)

SFT_LR_FLOOR = 0.1
"""The learning rate at the last step, as a fraction of the peak `sft.lr`."""
INSTRUCTION = "instruction: {}\nresponse:"


# --- instruction data ----------------------------------------------------------------------------------------
def is_heldout(key: str, seed: int, fraction: float) -> bool:
    return zlib.crc32(f"{seed}:{key}".encode()) % 10_000 < fraction * 10_000


def instruction(task: str, prompt: str, response: str) -> TaskItem:
    """An SFT item: a user turn and the response to learn (`TaskItem.chat`)."""
    return TaskItem(task, prompt, response, chat=True)


def synthetic_instructions(
    world: SyntheticWorld, seed: int, items_per_kind: int
) -> list[tuple[str, TaskItem]]:
    """(split key, item) pairs of every kind; the caller splits them with `is_heldout`."""
    out: list[tuple[str, TaskItem]] = []
    for e, a, v in world.fact_items():
        out.append(
            (
                f"fact:{e}:{a}",
                instruction("instr_fact", INSTRUCTION.format(f"what is the {a} of {e}?"), " " + v),
            )
        )
    rng = random.Random(f"ddiloco-sft:{seed}")
    for _ in range(items_per_kind):
        q, ans = arithmetic_problem(rng)
        out.append((q, instruction("instr_arithmetic", INSTRUCTION.format(f"what is {q[:-1]}?"), " " + ans)))
        w = random_word(rng)
        op, ans = ("copy", w) if rng.random() < 0.5 else ("reverse", w[::-1])
        out.append((f"{op}:{w}", instruction("instr_copy", INSTRUCTION.format(f"{op} {w}."), " " + ans)))
        phrase, plural = agreement_problem(rng)
        ans = " are" if plural else " is"
        out.append((phrase, instruction("instr_agreement", INSTRUCTION.format(f"is or are? {phrase}"), ans)))
        start, n = rng.randrange(50), rng.randint(3, 6)
        seq = " ".join(str(start + i) for i in range(n))
        out.append(
            (seq, instruction("instr_count", INSTRUCTION.format(f"what comes after {seq}?"), f" {start + n}"))
        )
    return out


def read_jsonl_pairs(path: str | Path) -> list[tuple[str, TaskItem]]:
    """(split key, item) from a JSONL file of {"prompt": str, "response": str} objects."""
    out = []
    for where, obj in iter_jsonl(Path(path)):
        if not all(isinstance(obj.get(k), str) for k in ("prompt", "response")):
            raise ValueError(f'{where}: expected an object with string fields "prompt" and "response"')
        if not obj["response"].strip():
            raise ValueError(f"{where}: empty response")
        out.append((obj["prompt"], instruction("instructions", obj["prompt"], obj["response"])))
    if not out:
        raise ValueError(f"{path}: no prompt/response pairs")
    return out


def split_items(
    keyed: list[tuple[str, TaskItem]], seed: int, fraction: float, eval_items: int
) -> tuple[list[TaskItem], dict[str, list[TaskItem]]]:
    """(training items, held-out items by task, at most eval_items per task, in a seeded order)."""
    train, test = [], {}
    for key, item in keyed:
        if is_heldout(key, seed, fraction):
            test.setdefault(item.task, []).append(item)
        else:
            train.append(item)
    rng = random.Random(f"ddiloco-sft-eval:{seed}")
    for task, items in test.items():
        test[task] = rng.sample(items, min(eval_items, len(items)))
    if not train or not test:
        raise ValueError(
            f"the instruction set splits into {len(train)} training and {len(test)} held-out items"
        )
    return train, test


# --- training ------------------------------------------------------------------------------------------------
def build_example(
    tokenizer: Tokenizer, prompt: str, response: str, block_size: int
) -> tuple[list[int], list[int]]:
    """(inputs, targets) for <eos> + prompt + response + <eos>, targets -100 except on response + <eos>;
    the prompt is the tokenizer's chat template's user turn when it has one (`Tokenizer.chat_prompt_ids`)."""
    context = encode_prompt(tokenizer, prompt, chat=True)
    answer = [*tokenizer.encode(response), tokenizer.eos_id]
    ids = (context + answer)[-(block_size + 1) :]  # over-long prompts lose their start, never the response
    n_context = max(len(ids) - len(answer), 0)
    x, y = ids[:-1], ids[1:]
    y = [IGNORE_INDEX if j < n_context - 1 else t for j, t in enumerate(y)]
    return x, y


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(x) for x, _ in examples)
    xb = torch.full((len(examples), width), pad_id, dtype=torch.long)  # (B, T)
    yb = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    for i, (x, y) in enumerate(examples):
        xb[i, : len(x)] = torch.tensor(x)
        yb[i, : len(y)] = torch.tensor(y)
    return xb, yb


def sft_lr(step: int, cfg: SFTConfig) -> float:
    """Linear warm-up over `cfg.warmup_steps`, then cosine decay to `SFT_LR_FLOOR` of `cfg.lr` at the last step
    (`ddiloco.run.schedule.lr_at`, progress counted over the steps after the warm-up)."""
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return lr_at(step, cfg.lr, cfg.warmup_steps, progress=progress, schedule="cosine", min_ratio=SFT_LR_FLOOR)


def train_sft(
    model: GPT,
    tokenizer: Tokenizer,
    items: list[TaskItem],
    cfg: SFTConfig,
    seed: int,
    replay: torch.Tensor | None = None,
) -> list[float]:
    """Fine-tune in place; returns the instruction (response-token) loss of every step.

    `replay` is a pre-training token stream; `replay_fraction` of each batch is drawn from it.
    """
    device = next(model.parameters()).device
    examples = [build_example(tokenizer, it.prompt, it.answer, model.config.block_size) for it in items]
    opt = configure_optimizer(model, cfg.lr, cfg.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    n_replay = (
        min(round(cfg.batch_size * cfg.replay_fraction), cfg.batch_size - 1) if replay is not None else 0
    )
    n_instr = cfg.batch_size - n_replay
    width = min(cfg.replay_seq_len, model.config.block_size)
    if replay is not None and replay.numel() <= width + 1:
        raise ValueError(
            f"the replay stream has {replay.numel()} tokens, fewer than one window ({width + 1})"
        )
    losses = []
    model.train()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = sft_lr(step, cfg)
        pick = torch.randint(len(examples), (n_instr,), generator=gen).tolist()
        x, y = collate([examples[i] for i in pick], tokenizer.pad_id)
        _, loss = model(x.to(device), y.to(device))
        total = loss * (n_instr / cfg.batch_size)
        if n_replay:
            starts = torch.randint(replay.numel() - width - 1, (n_replay, 1), generator=gen)
            window = replay[starts + torch.arange(width + 1)].long()  # (R, W+1)
            _, replay_loss = model(window[:, :-1].to(device), window[:, 1:].to(device))
            total = total + replay_loss * (n_replay / cfg.batch_size)
        opt.zero_grad(set_to_none=True)
        total.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


@torch.no_grad()
def response_loss(model: GPT, tokenizer: Tokenizer, items: list[TaskItem], batch_size: int = 64) -> float:
    """Mean NLL (nats) of the response tokens and closing <eos>, teacher-forced: how well the model would
    answer, also where exact match gives no credit yet."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for lo in range(0, len(items), batch_size):
        chunk = items[lo : lo + batch_size]
        x, y = collate(
            [build_example(tokenizer, it.prompt, it.answer, model.config.block_size) for it in chunk],
            tokenizer.pad_id,
        )
        n = int((y != IGNORE_INDEX).sum())
        _, loss = model(x.to(device), y.to(device))
        total += float(loss) * n
        count += n
    model.train(was_training)
    return total / max(count, 1)


def _accuracy(model: GPT, tokenizer: Tokenizer, test: dict[str, list[TaskItem]]) -> dict[str, float]:
    res = evaluate_tasks(model, tokenizer, test)
    acc = {k: float(v["accuracy"]) for k, v in res.items()}
    n = sum(int(v["n"]) for v in res.values())
    acc["all"] = sum(float(v["accuracy"]) * int(v["n"]) for v in res.values()) / n
    return acc


NO_INSTRUCTIONS = (
    "sft skipped: the run trained on a user corpus and sft.data names no instruction file; set "
    "sft.data=FILE.jsonl ({prompt, response} per line) to fine-tune, or sft: null to say so"
)


def has_instructions(cfg: Any, scfg: SFTConfig) -> bool:
    """Whether SFT has data: `sft.data`, or the synthetic instruction set of a synthetic corpus."""
    return scfg.data is not None or cfg.data.source == "synthetic"


def skip_without_instructions(root: RunRoot, scfg: SFTConfig) -> str | None:
    """When SFT has no data (see `has_instructions`): warn, leave `sft/skipped.json` (so the evaluation of
    `sft` skips too) and return why; None when there is data to fine-tune on."""
    if has_instructions(root.config(), scfg):
        return None
    log.warning(NO_INSTRUCTIONS)
    root.write_sft_skipped(NO_INSTRUCTIONS)
    return NO_INSTRUCTIONS


def run_sft(root: RunRoot, scfg: SFTConfig | None = None) -> dict[str, Any]:
    """Fine-tune `scfg.base` of the run, write sft/model.safetensors (signed) + sft/meta.json, return metrics."""
    scfg = scfg or SFTConfig()
    t0 = time.monotonic()
    cfg = root.config()
    seed = cfg.seed if scfg.seed is None else scfg.seed
    layout = root.layout()
    tokenizer = root.tokenizer()
    if not has_instructions(cfg, scfg):
        raise ValueError("this run trained on a user corpus: pass an instruction JSONL file with --data")
    if scfg.data is not None:
        keyed = read_jsonl_pairs(scfg.data)
    else:
        meta = root.data_meta() or {}
        world = make_world(meta.get("world_seed", cfg.seed), n_entities=cfg.data.synthetic_entities)
        keyed = synthetic_instructions(world, seed, scfg.items_per_kind)
    train, test = split_items(keyed, seed, scfg.heldout_fraction, scfg.eval_items)
    model, info = load_model(root, scfg.base, layout)
    model.to(resolve_device(scfg.device))
    heldout = [it for items in test.values() for it in items]
    before, loss_before = _accuracy(model, tokenizer, test), response_loss(model, tokenizer, heldout)
    t_train = time.monotonic()
    replay = None
    if scfg.replay_fraction > 0:
        replay = root.training_tokens(0)
    losses = train_sft(model, tokenizer, train, scfg, seed, replay)
    train_seconds = time.monotonic() - t_train
    after, loss_after = _accuracy(model, tokenizer, test), response_loss(model, tokenizer, heldout)
    tail = losses[-20:]
    metrics = {
        "run_id": cfg.run_id,
        "base": info,
        "data": scfg.data or "synthetic",
        "train_items": len(train),
        "heldout_items": {k: len(v) for k, v in sorted(test.items())},
        "heldout_split": "by (entity, attribute) for facts, by prompt otherwise"
        if scfg.data is None
        else "by prompt",
        "steps": scfg.steps,
        "train_seconds": train_seconds,
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "loss_curve": losses[:: max(1, len(losses) // 50)],
        "instruction_accuracy_before": before,
        "instruction_accuracy_after": after,
        "heldout_response_loss_before": loss_before,
        "heldout_response_loss_after": loss_after,
        "config": asdict(scfg),
        "device": str(next(model.parameters()).device),
    }
    root.write_sft_model(model, {"base": scfg.base, "steps": scfg.steps})
    metrics["seconds"] = time.monotonic() - t0
    root.write_sft_meta(metrics)
    log.info(
        "sft: %d steps on %d items in %.1fs; held-out instruction accuracy %.2f -> %.2f",
        scfg.steps,
        len(train),
        train_seconds,
        before["all"],
        after["all"],
    )
    return metrics

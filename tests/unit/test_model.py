"""GPT: shapes, causality, init, analytic sizes of the presets, a few optimiser steps."""

import math

import pytest
import torch

from ddiloco.model.gpt import (
    GPT,
    PRESETS,
    GPTConfig,
    configure_optimizer,
    count_params,
    flops_per_token,
    gpt_config,
    init_model,
)

torch.set_num_threads(1)

V, T = 258, 32


@pytest.fixture
def cfg() -> GPTConfig:
    return gpt_config("tiny", vocab_size=V, block_size=T)


def test_forward_shapes_and_initial_loss(cfg):
    model = init_model(cfg, seed=0)
    idx = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx)
    assert logits.shape == (3, T, V) and loss is None
    logits, loss = model(idx, idx)
    assert loss.shape == () and abs(loss.item() - math.log(V)) < 0.1  # near-uniform at init


def test_too_long_sequence_rejected(cfg):
    with pytest.raises(ValueError, match="block_size"):
        init_model(cfg, seed=0)(torch.zeros(1, T + 1, dtype=torch.long))


def test_causal(cfg):
    model = init_model(cfg, seed=0).eval()
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 7) % V
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_init_deterministic_and_seeded(cfg):
    a, b, c = init_model(cfg, seed=3), init_model(cfg, seed=3), init_model(cfg, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        torch.testing.assert_close(pa, pb)
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), name
    # Independent of the global RNG.
    torch.manual_seed(123)
    d = init_model(cfg, seed=3)
    torch.testing.assert_close(a.lm_head.weight, d.lm_head.weight)


def test_residual_projections_scaled(cfg):
    model = init_model(gpt_config("tiny", vocab_size=V, block_size=T, n_layer=8, n_embd=256), seed=0)
    proj = model.transformer.h[0].mlp.c_proj.weight.std().item()
    fc = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert proj == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert fc == pytest.approx(0.02, rel=0.1)


def test_ignore_index(cfg):
    model = init_model(cfg, seed=0)
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(2))
    targets = idx.clone()
    targets[:, : T // 2] = -100
    logits, loss = model(idx, targets)
    ref = torch.nn.functional.cross_entropy(logits[:, T // 2 :].reshape(-1, V), idx[:, T // 2 :].reshape(-1))
    torch.testing.assert_close(loss, ref)


def test_embedding_names_untied(cfg):
    model = init_model(cfg, seed=0)
    names = dict(model.named_parameters())
    emb = model.embedding_names()
    assert emb == {"transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"}
    assert emb <= names.keys()
    assert names["transformer.wte.weight"].data_ptr() != names["lm_head.weight"].data_ptr()


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_count_params_matches_module(preset):
    for bias in (False, True):
        c = gpt_config(preset, vocab_size=V, block_size=64, bias=bias)
        assert GPT(c).num_params() == count_params(c)


@pytest.mark.parametrize(
    ("preset", "expected"),
    [("125m", 124e6), ("350m", 355e6), ("1b", 1.01e9), ("small", 11e6), ("tiny", 0.14e6)],
)
def test_preset_sizes(preset, expected):
    # GPT-2 counts: 50257 tokens, 1024 positions, one (tied) token matrix. Ours is untied: drop lm_head.
    vocab = 258 if preset in ("tiny", "small") else 50257
    c = gpt_config(preset, vocab_size=vocab, block_size=1024 if vocab > 258 else 128)
    n = count_params(c) - c.vocab_size * c.n_embd
    if preset in ("tiny", "small"):
        n += c.vocab_size * c.n_embd  # these are quoted with their (byte) LM head
    assert n == pytest.approx(expected, rel=0.06)


def test_flops_per_token(cfg):
    n_matmul = count_params(cfg) - V * cfg.n_embd - T * cfg.n_embd
    assert flops_per_token(cfg) == 6 * n_matmul + 12 * cfg.n_layer * cfg.n_embd * T
    assert init_model(cfg, seed=0).flops_per_token(seq_len=8) < flops_per_token(cfg)


def test_config_errors():
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(vocab_size=V, block_size=T, n_layer=1, n_head=3, n_embd=64)
    with pytest.raises(ValueError, match="n_layer must be a positive integer"):
        GPTConfig(vocab_size=V, block_size=T, n_layer=0, n_head=4, n_embd=64)
    with pytest.raises(ValueError, match="unknown model preset 'huge'.*tiny"):
        gpt_config("huge", vocab_size=V, block_size=T)
    with pytest.raises(ValueError, match="unknown GPTConfig field"):
        gpt_config("tiny", vocab_size=V, block_size=T, n_layers=3)
    assert gpt_config("tiny", vocab_size=V, block_size=T, n_layer=None).n_layer == PRESETS["tiny"]["n_layer"]
    assert gpt_config("tiny", vocab_size=V, block_size=T, n_layer=5).n_layer == 5


def test_adamw_steps_reduce_loss(cfg):
    model = init_model(cfg, seed=0)
    opt = configure_optimizer(model, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])
    idx = torch.randint(0, V, (4, T + 1), generator=torch.Generator().manual_seed(5))
    x, y = idx[:, :-1], idx[:, 1:]
    losses = []
    for _ in range(10):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_generate_greedy_and_eos(cfg):
    model = init_model(cfg, seed=0).eval()
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(6))
    out = model.generate(prompt, max_new_tokens=6)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    torch.testing.assert_close(out, model.generate(prompt, max_new_tokens=6))  # greedy is deterministic
    first = int(out[0, 5])
    stopped = model.generate(prompt[:1], max_new_tokens=6, eos_id=first)
    assert stopped.shape == (1, 6) and int(stopped[0, -1]) == first
    long = model.generate(prompt, max_new_tokens=T + 4, temperature=1.0)  # crops context to block_size
    assert long.shape == (2, T + 9)

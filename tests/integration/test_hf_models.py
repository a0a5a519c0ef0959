"""Hugging Face causal LMs as the trained model (issue 27): tiny Llama, Qwen2, Qwen3, Gemma 4 text, Mixtral and
Qwen3-MoE directories built here, trained by real learners and a real syncer driven in one process over a
memory store; and the refusals `prepare` owes a bad `model.hf`, before it writes anything."""

import json

import pytest
import torch

from ddiloco.data.tokenizer import ModelTokenizer
from ddiloco.errors import ConfigError
from ddiloco.posttrain.evaluate import validation_loss
from ddiloco.posttrain.summary import build_summary
from ddiloco.run.globalmodel import build_model, read_layout
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store
from tests._harness import tiny_config, train_in_process
from tests._hf import ARCHS, SAMPLE, tiny_hf_dir

pytest.importorskip("transformers")
from transformers import AutoTokenizer  # noqa: E402


def _run(name: str, *overrides: str):
    store = open_store(f"memory://{name}")
    cfg = tiny_config(name, "model.seq_len=32", *overrides)
    prepare(store, cfg)
    return store, cfg


def _loss(root: RunRoot, model, cfg) -> float:
    return validation_loss(model, root.val(), batch_size=8, seq_len=cfg.model.seq_len, max_batches=4)


# CI trains Llama, Gemma 4 and Qwen3-MoE here (Qwen3 trains in test_hf_run, Mixtral in test_learner_ddp_hf);
# Qwen2, Qwen3 and Mixtral run here in the long tier.
LONG_ARCHS = {"qwen2", "qwen3", "mixtral"}


@pytest.mark.parametrize(
    "model_type", [pytest.param(a, marks=pytest.mark.long) if a in LONG_ARCHS else a for a in sorted(ARCHS)]
)
def test_each_architecture_trains_to_a_balanced_ledger_and_a_lower_loss(tmp_path, model_type):
    """Each with its own tokenizer (tests/_hf.py: its family's special tokens and chat template)."""
    d = tiny_hf_dir(tmp_path / model_type, model_type, tokenizer=True)
    store, cfg = _run(f"hf-{model_type}", f"model.hf={d}", "diloco.token_budget=12000")
    tok = RunRoot(store, cfg.run_id).tokenizer()
    mine = AutoTokenizer.from_pretrained(d)
    assert isinstance(tok, ModelTokenizer) and tok.vocab_size == len(mine) == 272
    assert (
        tok.eos_id == mine.eos_token_id
        and tok.encode(SAMPLE) == mine(SAMPLE, add_special_tokens=False)["input_ids"]
    )
    layout = read_layout(store)
    assert layout.model["kind"] == "hf" and layout.model["hf_config"]["model_type"] == model_type
    model = build_model(layout, cfg.seed)
    names = dict(model.named_parameters())
    members = {n for f in layout.fragments for n in f.names}
    assert members == set(names) and len(members) == sum(len(f.names) for f in layout.fragments)
    assert layout.embedding_names >= {n for n in names if "embed_tokens" in n}
    assert not any(".experts." in n or "norm" in n for n in layout.embedding_names)
    if model_type == "gemma4_text":  # tied: the LM head is the embedding, one member merged once
        assert not any(n.startswith("lm.lm_head") for n in names)
    else:
        assert "lm.lm_head.weight" in layout.embedding_names
    if ".experts." in " ".join(names):  # MoE: every fragment holds expert weights
        assert all(any(".experts." in n for n in f.names) for f in layout.fragments), layout.fragments
    root = RunRoot(store, cfg.run_id)
    before = _loss(root, model, cfg)

    train_in_process(store, 2)
    s = build_summary(store)
    assert s.status == "done" and s.ledger_balanced and s.tokens_outstanding == 0
    assert s.tokens_merged >= cfg.diloco.token_budget and s.rejected_updates == {}
    after = _loss(root, root.final_model(layout), cfg)
    assert after < before - 0.3, (before, after)
    _exported_matches(root, "final", tmp_path / "export")  # loads with transformers alone, same logits


def test_weights_in_the_directory_are_version_0_and_the_same_seed_gives_the_same_init(tmp_path):
    d = tiny_hf_dir(tmp_path / "w", "qwen3", weights=True, seed=7)
    from safetensors.torch import load_file

    saved = load_file(d / "model.safetensors")
    store, cfg = _run("hf-weights", f"model.hf={d}")
    root = RunRoot(store, cfg.run_id)
    v0 = root.model_at_versions(read_layout(store), [0] * read_layout(store).num_fragments)
    got = {n.removeprefix("lm."): p for n, p in v0.named_parameters()}
    assert set(got) == set(saved) and all(torch.equal(got[n], saved[n]) for n in saved)

    c = tiny_hf_dir(tmp_path / "c", "qwen3")
    a, _ = _run("hf-seed-a", f"model.hf={c}")
    b, _ = _run("hf-seed-b", f"model.hf={c}")
    other, _ = _run("hf-seed-c", f"model.hf={c}", "seed=1")
    la = read_layout(a)
    runs = ((a, "hf-seed-a"), (b, "hf-seed-b"), (other, "hf-seed-c"))
    models = [RunRoot(s, r).model_at_versions(la, [0] * la.num_fragments) for s, r in runs]
    pa, pb, pc = (dict(m.named_parameters()) for m in models)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not all(torch.equal(pa[n], pc[n]) for n in pa)


def _refused(tmp_path, spec: str, *overrides: str) -> str:
    store = open_store(f"file://{tmp_path}/root")
    with pytest.raises(ConfigError) as e:
        prepare(store, tiny_config("hf-bad", "model.seq_len=32", f"model.hf={spec}", *overrides))
    assert store.list("") == [], "nothing may be written to the run root"
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_bad_model_directories_are_refused_in_one_line_before_anything_is_written(tmp_path):
    assert "is not a directory" in _refused(tmp_path, str(tmp_path / "nope"))
    assert "ftp://x" in _refused(tmp_path, "ftp://x/y")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(
        json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]})
    )
    assert "encoder" in _refused(tmp_path, str(bert))
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps({"model_type": "t5", "is_encoder_decoder": True}))
    assert "encoder-decoder" in _refused(tmp_path, str(t5))
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    assert "does not know" in _refused(tmp_path, str(odd))
    sharded = tiny_hf_dir(tmp_path / "sharded", "llama", weights=True)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model-00002-of-00002.safetensors" in _refused(tmp_path, str(sharded))
    small = tiny_hf_dir(tmp_path / "small-vocab", "llama", vocab_size=100)
    assert "vocab_size 100" in _refused(tmp_path, str(small))  # the byte tokenizer has more ids
    own = tiny_hf_dir(tmp_path / "own-vocab", "qwen3", tokenizer=True, vocab_size=260)
    assert "the tokenizer has 272 ids" in _refused(tmp_path, str(own))  # its own tokenizer is larger
    assert "has none of tokenizer.json" in _refused(tmp_path, str(small), "data.tokenizer=model")
    short = tiny_hf_dir(tmp_path / "short", "llama")
    assert "max_position_embeddings" in _refused(tmp_path, str(short), "model.seq_len=128")
    big = dict(hidden_size=32768, intermediate_size=131072, num_hidden_layers=96, num_attention_heads=256)
    huge = tiny_hf_dir(tmp_path / "huge", "llama", head_dim=128, **big)
    msg = _refused(tmp_path, str(huge))
    assert "B parameters" in msg and "GiB" in msg


def _exported_matches(root: RunRoot, spec: str, out) -> None:
    """`ddiloco export` wrote a directory transformers loads alone, with the run's logits and token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ddiloco.cli.main import main
    from ddiloco.posttrain.evaluate import load_model

    assert main(["export", "--store", root.url, "--model", spec, "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n\treturn x ** 2  # wörld ✓"
    ids = root.tokenizer().encode(text)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids and tok.decode(ids) == text
    assert tok.eos_token_id == root.tokenizer().eos_id
    assert tok.pad_token_id in (root.tokenizer().pad_id, None)  # a model without a pad token pads with eos
    ours, _ = load_model(root, spec, root.layout())
    x = root.val()[:32].long()[None]
    with torch.no_grad():
        diff = (hf(input_ids=x).logits - ours.eval()(x)[0]).abs().max().item()
    assert diff <= 1e-5, diff


def test_export_writes_a_directory_transformers_loads_alone_with_the_same_logits(tmp_path):
    store, cfg = _run("export-gpt")  # the built-in GPT, exported as GPT-2
    _exported_matches(RunRoot(store, cfg.run_id), "latest", tmp_path / "gpt")
    d = tiny_hf_dir(tmp_path / "m", "qwen3", weights=True)
    store, cfg = _run("export-hf", f"model.hf={d}")
    _exported_matches(RunRoot(store, cfg.run_id), "latest", tmp_path / "qwen3")

"""`ddiloco run` on a Hugging Face model directory and a JSONL corpus, with real learner and syncer
processes: a tiny random-init Qwen3 with its own tokenizer and chat template (built here), fine-tuned on an
instruction file in that template, then exported and scored with transformers alone. It is also the test
of the command line's contract: progress on stderr, the summary's path as stdout's last line."""

import json
import random
import subprocess
import sys

import pytest
import torch

from ddiloco.cli.main import main
from ddiloco.data.loader import val_batches
from ddiloco.data.synthetic import make_world, synthetic_documents
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store
from tests._hf import tiny_hf_dir

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def _corpus(tmp_path):
    docs = tmp_path / "corpus.jsonl"
    docs.write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in synthetic_documents(make_world(0, 8), 0, 600))
    )
    rng = random.Random(0)
    pairs = [(rng.randrange(20), rng.randrange(20)) for _ in range(80)]
    instr = tmp_path / "instructions.jsonl"
    instr.write_text(
        "".join(
            json.dumps({"prompt": f"what is {a} plus {b}?", "response": f" {a + b}"}) + "\n" for a, b in pairs
        )
    )
    return docs, instr


def test_run_on_a_model_directory_trains_fine_tunes_in_its_chat_template_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tiny_hf_dir(tmp_path / "qwen3", "qwen3", tokenizer=True)
    docs, instr = _corpus(tmp_path)
    sets = [f"model.hf={model}", f"data.source={docs}", f"sft.data={instr}", "sft.steps=20", "model.seq_len=32",
            "train.batch_size=4", "diloco.learners=2", "diloco.fragments=2", "diloco.token_budget=24000",
            "eval.val_batches=2", "train.threads=1"]  # fmt: skip
    args = [sys.executable, "-m", "ddiloco.cli", "run", "--workdir", str(tmp_path / "w"), "--run-id", "hf"]
    out = subprocess.run(
        args + [a for s in sets for a in ("--set", s)], capture_output=True, text=True, timeout=400
    )
    assert out.returncode == 0, out.stderr[-3000:]
    path = out.stdout.strip().splitlines()[-1]
    assert path.endswith("hf/summary.json") and "val loss" in out.stderr
    s = json.loads(open(path).read())
    assert s["status"] == "done" and s["ledger_balanced"] and s["tokens_outstanding"] == 0
    assert s["final_val_loss"] < s["initial_val_loss"] - 1.0, (s["initial_val_loss"], s["final_val_loss"])
    assert s["sft"]["heldout_response_loss_after"] < s["sft"]["heldout_response_loss_before"]

    root = RunRoot(open_store(f"file://{tmp_path}/w/hf"), "hf")
    tok = root.tokenizer()
    prompt = tok.chat_prompt_ids("what is 1 plus 2?")
    assert (
        tok.decode(prompt) == "user\nwhat is 1 plus 2?\nassistant\n"
    )  # the template, special tokens dropped
    assert prompt[0] == tok._raw.token_to_id("<|im_start|>")

    export = tmp_path / "export"
    assert main(["export", "--store", root.url, "--model", "final", "--out", str(export)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(export).eval()
    hf_tok = AutoTokenizer.from_pretrained(export)
    assert (
        hf_tok.apply_chat_template(
            [{"role": "user", "content": "what is 1 plus 2?"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        == prompt
    )
    held_out = root.val()
    first, second = (held_out == tok.eos_id).nonzero().flatten()[:2].tolist()
    doc = held_out[first + 1 : second].tolist()  # the first whole held-out document
    assert hf_tok(hf_tok.decode(doc), add_special_tokens=False)["input_ids"] == doc
    total = count = 0
    with torch.no_grad():  # the run's evaluation windows, scored by transformers alone
        for x, y in val_batches(held_out, batch_size=4, seq_len=32, max_batches=2):
            logits = hf(input_ids=x).logits
            total += float(
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            )
            count += y.numel()
    assert abs(total / count - s["final_val_loss"]) < 1e-4, (total / count, s["final_val_loss"])

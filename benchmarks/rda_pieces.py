"""How much RDA per row piece differs from RDA per whole tensor, on real learner deltas and on i.i.d. ones.

A tensor larger than the ideal fragment is split into row pieces that merge on their own
(`ddiloco.run.fragments`), so their RDA norms are per piece. This measures the difference on the tiny preset at
P = 12 (where matrices, not only embeddings, are split): M learners start from one init, each trains
`--steps` AdamW steps on its own synthetic documents, and the learners' deltas of every split non-embedding
tensor are merged both ways. Reported per tensor: relative L2 difference ‖rda_pieces − rda_whole‖ /
‖rda_whole‖ and the ratio of the norms; the same for i.i.d. Gaussian deltas of the same shapes.

    .venv/bin/python benchmarks/rda_pieces.py [--learners 4] [--steps 30] [--fragments 12]

Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json

import torch

from ddiloco.data.synthetic import make_world, synthetic_documents
from ddiloco.data.tokenizer import ByteTokenizer
from ddiloco.model.gpt import configure_optimizer, gpt_config, init_model
from ddiloco.run.globalmodel import make_layout
from ddiloco.syncer.merge.accumulate import RoundSums


def train_delta(
    seed: int, steps: int, init: dict[str, torch.Tensor], cfg, seq: int
) -> dict[str, torch.Tensor]:
    tok = ByteTokenizer()
    docs = synthetic_documents(make_world(0), seed, 400)
    ids = torch.tensor([t for d in docs for t in tok.encode(d)], dtype=torch.long)
    model = init_model(cfg, 0)
    model.load_state_dict(init)
    opt = configure_optimizer(model, 1e-3, 0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq - 1, (8,), generator=g)
        x = torch.stack([ids[s : s + seq] for s in starts])  # (B, T)
        y = torch.stack([ids[s + 1 : s + seq + 1] for s in starts])  # (B, T)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: p.detach() - init[n] for n, p in model.named_parameters()}


def rda(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The syncer's RDA of same-shape tensors (`RoundSums`, one answer at a time)."""
    sums = RoundSums({"t": tensors[0].shape}, method="rda")
    for m, (t, w) in enumerate(zip(tensors, weights, strict=True)):
        sums.add(str(m), w, {"t": t})
    return sums.finalize(lambda key, out=None: {"t": tensors[int(key)]}).merged["t"]


def compare(deltas: list[dict[str, torch.Tensor]], pieces: dict[str, list[tuple[int, int]]]) -> dict:
    weights = [1.0] * len(deltas)
    out = {}
    for name, rows in sorted(pieces.items()):
        whole = rda([d[name] for d in deltas], weights)
        split = torch.cat([rda([d[name][a:b] for d in deltas], weights) for a, b in rows])
        out[name] = {
            "pieces": len(rows),
            "rel_l2": float((split - whole).norm() / whole.norm()),
            "norm_ratio": float(split.norm() / whole.norm()),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fragments", type=int, default=12)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = gpt_config("tiny", vocab_size=258, block_size=128)
    model = init_model(cfg, 0)
    layout = make_layout(model, args.fragments)
    pieces: dict[str, list[tuple[int, int]]] = {}
    for pc in layout.pieces.values():
        if pc.tensor not in model.embedding_names():  # embeddings take the plain mean: no norms
            pieces.setdefault(pc.tensor, []).append((pc.start, pc.stop))
    pieces = {n: sorted(r) for n, r in pieces.items()}
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    real = [train_delta(100 + m, args.steps, init, cfg, 64) for m in range(args.learners)]
    g = torch.Generator().manual_seed(1)
    iid = [{n: torch.randn(init[n].shape, generator=g) for n in pieces} for _ in range(args.learners)]
    result = {"learners": args.learners, "steps": args.steps, "fragments": args.fragments}
    for kind, deltas in (("trained", real), ("iid", iid)):
        per = compare(deltas, pieces)
        result[kind] = per
        result[f"{kind}_rel_l2_max"] = max(v["rel_l2"] for v in per.values())
        result[f"{kind}_rel_l2_min"] = min(v["rel_l2"] for v in per.values())
    print(json.dumps(result))


if __name__ == "__main__":
    main()

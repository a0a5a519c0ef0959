"""MFU and the other efficiency figures (issue 52 item 2): FLOPs per token against hand counts, the peak table,
the override, the one log line for an unknown device, and the summary's per-learner and fleet figures."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from ddiloco.learner.efficiency import Efficiency, device_peak, matmul_precision
from ddiloco.model.gpt import GPTConfig, flops_per_token, init_model
from ddiloco.platform import peaks
from ddiloco.posttrain.efficiency import fleet_efficiency, learner_efficiency
from ddiloco.store.url import open_store
from ddiloco.syncer.roster import Roster
from ddiloco.tracking.metrics import LearnerMetrics
from tests._harness import learner_report

CPU = torch.device("cpu")


def test_gpt_flops_per_token_match_a_hand_count():
    cfg = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, n_embd=8)
    # Per block: qkv 8·24 + proj 8·8 + MLP 8·32 + 32·8 = 768 matmul weights, 2 LayerNorm gains of 8.
    # Plus ln_f (8) and the untied LM head (16·8); wte and wpe are lookups, not matmuls.
    n = 2 * (768 + 16) + 8 + 16 * 8  # 1704
    attention = 12 * 2 * 8 * 4  # 12·L·C·T
    assert flops_per_token(cfg) == 6 * n + attention == 10_992
    assert init_model(cfg, seed=0).flops_per_token(4) == 10_992


def test_hf_llama_flops_per_token_match_a_hand_count():
    pytest.importorskip("transformers")
    from ddiloco.model.hf.model import HFSpec, init_hf

    hf_config = {
        "model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 8, "tie_word_embeddings": False,
    }  # fmt: skip
    model = init_hf(HFSpec(hf_config=hf_config, block_size=8, vocab_size=32), seed=0)
    # Per layer: q 16·16, k and v 16·8 each (2 KV heads of 4), o 16·16, gate/up/down 3·16·32, 2 RMSNorms of 16.
    per_layer = 256 + 128 + 128 + 256 + 3 * 512 + 32  # 2336
    n = 2 * per_layer + 16 + 32 * 16  # + final norm + LM head (the embedding table is a lookup): 5200
    assert model.flops_per_token(8) == 6 * n + 12 * 2 * 16 * 8 == 34_272


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "tf32", 417.5),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA A100-SXM4-40GB", "tf32", 156),
        ("NVIDIA A100 80GB PCIe", "bf16", 312),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L4", "fp32", 30.3),
        ("NVIDIA A10G", "bf16", 125),
        ("Tesla V100-SXM2-16GB", "fp16", 125),
        ("Tesla T4", "fp32", 8.1),
    ],
)
def test_the_peak_table_reads_dense_data_sheet_figures(name, precision, tflops):
    peak = peaks.lookup(name, precision)
    assert peak.flops == pytest.approx(tflops * 1e12) and "data sheet" in peak.source


def test_a_device_or_precision_not_in_the_table_has_no_peak():
    assert peaks.lookup("Tesla T4", "bf16").flops is None  # no bf16 hardware: unknown, not guessed
    assert peaks.lookup("NVIDIA B300", "bf16").flops is None
    with pytest.raises(ValueError, match="choose one of"):
        peaks.lookup("NVIDIA H100", "int8")
    assert device_peak(CPU, "fp32", None).flops is None
    assert device_peak(CPU, "fp32", 2e11) == peaks.Peak(2e11, "train.peak_flops")
    assert matmul_precision("bf16", CPU) == "bf16" and matmul_precision("fp32", CPU) == "fp32"


def _efficiency(registry: CollectorRegistry, peak: float | None, devices: int = 1) -> Efficiency:
    metrics = LearnerMetrics(registry, 3, 0)
    return Efficiency(
        metrics, flops_per_token=1e6, peak=device_peak(CPU, "fp32", peak), devices=devices, device=CPU
    )


def test_mfu_is_model_flops_over_the_peak_of_every_rank(caplog):
    registry = CollectorRegistry()
    with caplog.at_level(logging.INFO, logger="ddiloco.learner.efficiency"):
        eff = _efficiency(registry, 1e11, devices=2)
    assert not caplog.records  # a known peak: nothing to say
    eff.waited(0.25)
    eff.stepped(tokens=4096, step_seconds=1.0, per_step=2.0)  # 2048 tokens/s × 1e6 FLOPs / 2e11
    get, lbl = registry.get_sample_value, {"learner_id": "3"}
    assert eff.mfu == pytest.approx(2048 * 1e6 / 2e11) == get("ddiloco_learner_mfu", lbl)
    assert get("ddiloco_learner_peak_flops", lbl) == 2e11
    assert get("ddiloco_learner_tokens_per_second", lbl) == 2048
    assert get("ddiloco_learner_data_wait_seconds_total", lbl) == 0.25
    assert get("ddiloco_learner_step_seconds_total", lbl) == 1.0
    figures = eff.figures()
    assert figures["mfu"] == eff.mfu and figures["peak_flops_source"] == "train.peak_flops"
    assert figures["peak_memory_kind"] == "peak_rss" and figures["peak_memory_bytes"] > 0
    memory = get("ddiloco_learner_peak_memory_bytes", {**lbl, "kind": "peak_rss"})
    assert memory == figures["peak_memory_bytes"]


def test_an_unknown_device_omits_mfu_with_one_line_saying_how_to_give_the_peak(caplog):
    registry = CollectorRegistry()
    with caplog.at_level(logging.INFO, logger="ddiloco.learner.efficiency"):
        eff = _efficiency(registry, None)
        for _ in range(3):
            eff.stepped(tokens=100, step_seconds=0.1, per_step=0.1)
        eff.figures()
    assert len(caplog.records) == 1 and "train.peak_flops" in caplog.records[0].getMessage()
    assert eff.mfu is None and eff.figures()["mfu"] is None
    assert registry.get_sample_value("ddiloco_learner_mfu", {"learner_id": "3"}) is None  # absent, not 0


def test_the_summary_weighs_mfu_and_wait_by_time_and_keeps_the_largest_memory():
    fast = learner_report(
        tokens_processed=1000, productive_seconds=10.0, busy_seconds=8.0, flops_per_token=1e6,
        peak_flops=1e9, data_wait_seconds=2.0, peak_memory_bytes=300, peak_memory_kind="peak_rss",
    )  # fmt: skip
    restarted = learner_report(
        incarnation=1, tokens_processed=1000, productive_seconds=30.0, busy_seconds=24.0, flops_per_token=1e6,
        peak_flops=1e9, data_wait_seconds=0.0, peak_memory_bytes=200, peak_memory_kind="peak_rss",
    )  # fmt: skip
    one = learner_efficiency([fast, restarted])
    assert one["processed_tokens_per_s"] == 2000 / 40
    assert one["mfu"] == pytest.approx(2000 * 1e6 / (1e9 * 40))
    assert one["data_wait_fraction"] == 2.0 / 32
    assert (one["peak_memory_bytes"], one["peak_memory_kind"]) == (300, "peak_rss")
    old = learner_report(learner_id=1, tokens_processed=500, productive_seconds=10.0, busy_seconds=10.0)
    assert learner_efficiency([old])["mfu"] is None  # a report from before the fields: unknown, not 0
    fleet = fleet_efficiency([fast, restarted, old], wall_seconds=50.0)
    assert fleet["processed_tokens_per_s"] == 2500 / 50 and fleet["mfu"] == one["mfu"]


def test_the_fleet_mfu_in_the_syncer_status_weighs_each_learner_by_its_peak():
    roster = Roster(open_store("memory://fleet-mfu"), clock=lambda: 0.0, wall=lambda: 0.0, heartbeat_s=1.0)
    roster.live = lambda: [  # what the checked reports of three live learners say
        SimpleNamespace(tokens_per_s=100.0, mfu=0.5, peak_flops=1e12),
        SimpleNamespace(tokens_per_s=50.0, mfu=0.2, peak_flops=3e12),
        SimpleNamespace(tokens_per_s=10.0, mfu=None, peak_flops=None),  # a CPU learner: no peak
    ]
    assert roster.throughput() == {"tokens_per_s": 160.0, "mfu": pytest.approx((0.5e12 + 0.6e12) / 4e12)}
    roster.live = lambda: []
    assert roster.throughput() == {"tokens_per_s": None, "mfu": None}

"""Run configuration schema: the tree of dataclasses and the checks on it.

Recipes and `load_config` (recipe → YAML → `--set`) are in `ddiloco.config.recipes`; setting fields from dicts and
`a.b=c` strings in `ddiloco.config.overrides`.

Design choices:
- torchtitan style: nested `@dataclass(kw_only=True, slots=True)`, a docstring under every field, each
  section checks itself in `validate()`, `RunConfig.validate()` checks them in order plus what spans them.
- An optional feature is on when its sub-config is present (`diloco.grace: null` turns the grace window off).
- A section that belongs to a feature module lives there (`link`: `ddiloco.store.shaped`, `retention`:
  `ddiloco.config.retention`, `chaos`: `ddiloco.config.chaos`, next to the parser of its events); those
  modules raise `ddiloco.errors.ConfigError` and never import this one.
- Every error names the key and says what to change. The config travels as JSON (`config.json` at the run
  root); YAML is only an input format.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ddiloco import errors
from ddiloco.config.chaos import ChaosConfig  # the `chaos` section lives next to its events
from ddiloco.config.chaos_schedule import schedule_from_config
from ddiloco.config.data import DataConfig
from ddiloco.config.lease import LeaseConfig
from ddiloco.config.link import LinkConfig
from ddiloco.config.overrides import apply_dict
from ddiloco.config.retention import RetentionConfig  # the `retention` section lives next to its rules
from ddiloco.config.tracking import TrackingConfig  # the `tracking` section lives next to the tracker

MERGES = ("rda", "mean")
PRECISIONS = ("auto", "fp32", "bf16")
LR_SCHEDULES = ("auto", "cosine", "linear", "wsd", "constant")
DEVICES = ("auto", "cpu", "cuda")
PARALLELS = ("ddp", "fsdp")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    preset: str = "tiny"
    """Model size preset from `ddiloco.model.gpt.PRESETS` (tiny, small, 125m, 350m, 1b)."""
    n_layer: int | None = None
    """Override the preset's number of transformer blocks."""
    n_head: int | None = None
    """Override the preset's number of attention heads."""
    n_embd: int | None = None
    """Override the preset's embedding width."""
    seq_len: int = 128
    """Training context length in tokens (also the model's block size)."""
    hf: str | None = None
    """A Hugging Face causal LM to train instead of the built-in GPT: a directory (local path, file:// or
    s3:// prefix) with its config.json and optionally weights; preset/n_layer/n_head/n_embd then unused."""

    def validate(self) -> None:
        _check(self.seq_len >= 8, "model.seq_len must be ≥ 8")
        named = self.hf is None or (isinstance(self.hf, str) and self.hf.strip() != "")
        _check(named, "model.hf must name a directory (local path, file:// or s3:// prefix), or be null")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    batch_size: int = 16
    """Sequences per inner step per learner."""
    learner_batch_sizes: list[int] | None = None
    """Per-learner batch sizes by learner id (mixed hardware; the token-weighting ablation); learners past the
    end of the list, and every learner when null, use batch_size."""
    lr: float = 3e-3
    """Inner AdamW peak learning rate."""
    warmup_steps: int = 20
    """Linear warm-up of the inner learning rate over each learner's own first inner steps."""
    lr_schedule: str = "auto"
    """Inner-rate decay on global progress (tokens merged / token budget): cosine, linear, wsd or constant;
    `auto`: cosine for data-parallel, and for Decoupled DiLoCo cosine when the global model can follow the
    decay (it spans at least 1/(1 − outer momentum) outer steps per fragment), else constant
    (`ddiloco.run.schedule.resolve`)."""
    lr_decay_fraction: float = 0.2
    """wsd only: the last fraction of the budget over which the rate cools down (1-sqrt) to its floor."""
    lr_min_ratio: float = 0.1
    """The decay's floor, reached at the budget, as a fraction of train.lr (see ddiloco/run/schedule.py)."""
    weight_decay: float = 0.1
    """AdamW weight decay (2-D tensors only)."""
    beta1: float = 0.9
    """AdamW beta1 (beta2 below)."""
    beta2: float = 0.95
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    device: str = "auto"
    """`auto` (CUDA when present), `cpu` or `cuda`."""
    threads: int = 1
    """torch intra-op threads per learner process on CPU."""
    precision: str = "auto"
    """Autocast dtype of the inner forward pass: `auto` (bf16 on a CUDA device that supports it, else fp32),
    `fp32` or `bf16`. Parameters, gradients and AdamW state stay fp32 either way."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device of a learner (a GPU, or the CPU) at the precision it trains in: MFU's
    denominator. Null: the data-sheet figure for the GPU's name (`ddiloco.platform.peaks`: H100, H200, A100, L40S, L4,
    A10G, V100, T4, ...); a device not there (a CPU) then reports no MFU. E.g. 989.5e12: an H100 SXM in bf16."""
    compile: bool = False
    """`torch.compile` the model for the inner steps (a one-off compile; worth it on GPUs, rarely on CPU)."""
    ranks: int = 1
    """Most data-parallel ranks (GPUs, started by torchrun) inside one learner; a learner step covers
    ranks × batch sequences, and the syncer bounds the tokens an answer may claim accordingly."""
    parallel: str = "ddp"
    """How a learner's ranks hold the model: `ddp` (a replica per rank, gradients all-reduced) or `fsdp`
    (FSDP2: parameters, gradients and AdamW state sharded over the ranks; bf16 compute with fp32 master
    weights and reductions when the precision is bf16; `ddiloco.learner.sharded`). One rank: no difference."""
    activation_checkpointing: bool = False
    """With `parallel: fsdp`: recompute each transformer block's activations in backward (less memory,
    about a third more compute)."""
    checkpoint_every_s: float | None = None
    """Seconds between learner checkpoints (AdamW state, data cursor: what a rejoin needs; the parameters
    come from the globals); null: by the model's size (`ddiloco.learner.checkpoint.checkpoint_every_s`: 20 s
    for tiny and small, ~40 s for 125m, ~100 s for 350m, ~4.5 min for 1b)."""
    heartbeat_every_s: float = 1.0
    """Seconds between learner heartbeats (liveness and token accounting)."""
    poll_every_s: float = 0.05
    """Seconds between the learner's polls of the syncer's status object."""
    max_unmerged_s: float | None = None
    """Seconds a learner trains with none of its answers merged, the store and the syncer up, before it exits
    (code 4) to be restarted; null: max(1800, 20 × sync_every × its step seconds) (`ddiloco.learner.health`)."""

    def batch_for(self, learner_id: int) -> int:
        """Batch size (sequences per inner step) of learner `learner_id`."""
        sizes = self.learner_batch_sizes or []
        return sizes[learner_id] if 0 <= learner_id < len(sizes) else self.batch_size

    def max_batch(self) -> int:
        """The most sequences one learner step covers: the largest batch × ranks (bounds the tokens an honest
        learner reports per step)."""
        return max([self.batch_size, *(self.learner_batch_sizes or [])]) * self.ranks

    def validate(self) -> None:
        _check(self.batch_size >= 1 and self.lr > 0, "train.batch_size must be ≥ 1 and train.lr > 0")
        _check(
            all(isinstance(b, int) and b >= 1 for b in self.learner_batch_sizes or []),
            f"train.learner_batch_sizes={self.learner_batch_sizes} must be a list of integers ≥ 1 (or null)",
        )
        _check(self.device in DEVICES, f"train.device={self.device!r}: choose auto, cpu or cuda")
        _check(self.threads >= 1, "train.threads must be ≥ 1")
        _check(
            self.checkpoint_every_s is None or self.checkpoint_every_s >= 0,
            "train.checkpoint_every_s must be ≥ 0 seconds, or null for the model size's default",
        )
        _check(self.ranks >= 1, "train.ranks must be ≥ 1 (data-parallel ranks per learner)")
        peak = self.peak_flops
        _check(
            peak is None or 0 < peak < math.inf,
            f"train.peak_flops={peak} must be a device's peak FLOP/s > 0 (e.g. 312e12), or null (by device name)",
        )
        u = self.max_unmerged_s
        _check(u is None or 0 < u < math.inf, "train.max_unmerged_s must be > 0 s or null (by the pace)")
        _choose("train.precision", self.precision, PRECISIONS)
        _choose("train.parallel", self.parallel, PARALLELS)
        _choose("train.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _check(0 <= self.lr_min_ratio <= 1, f"train.lr_min_ratio={self.lr_min_ratio} must be in [0, 1]")
        _check(
            0 < self.lr_decay_fraction <= 1, f"train.lr_decay_fraction={self.lr_decay_fraction}: in (0, 1]"
        )
        _check(
            self.warmup_steps >= 0 and self.grad_clip >= 0,
            "train.warmup_steps and train.grad_clip must be ≥ 0",
        )


@dataclass(kw_only=True, slots=True)
class GraceConfig:
    gamma: float = 0.8
    """Scale γ of the adaptive window max(γ·(τ·ξ_step + min(ξ_link, cap) − ξ_quorum − ξ_sync), 0)
    (`ddiloco.syncer.rounds`: at most τ steps of waiting on late compute, plus the links' transport time)."""
    cap_seconds: float = 30.0
    """Upper bound of the transport allowance ξ_link in seconds (the compute part τ·ξ_step is not capped)."""
    ema: float = 0.2
    """Smoothing factor of the EMAs ξ (step time, time to quorum, merge+publish time)."""

    def validate(self) -> None:
        _check(self.gamma >= 0 and self.cap_seconds >= 0, "diloco.grace.gamma and cap_seconds must be ≥ 0")
        _check(0 < self.ema <= 1, "diloco.grace.ema must be in (0, 1]")


@dataclass(kw_only=True, slots=True)
class DilocoConfig:
    learners: int = 4
    """M: number of learners the run is provisioned for (more may join mid-run)."""
    max_learners: int | None = None
    """The most learner ids the run may have (0..max_learners-1: its own, chaos-added and joined learners);
    `prepare` cuts one disjoint shard per id. Null: M, or the chaos schedule's highest added id + 1."""
    quorum: int = 1
    """K: minimum number of learner answers before a round may merge."""
    fragments: int = 4
    """P: number of parameter fragments, synced round-robin."""
    sync_every: int = 32
    """H: inner steps between two syncs of the same fragment (a round opens every H/P learner steps)."""
    overlap: int = 2
    """τ: maximum number of rounds in flight."""
    sync_from: str = "open"
    """What a fragment's H learner steps are counted from before its next round opens: `open` (its last
    round's opening: synced every H steps as in the paper, the overlap taken out of them) or `publish` (its
    newest version: an answer covers ~H steps, a fragment is synced every H + overlap steps; at a small budget
    its rounds merge fewer answers: docs/results.md §12.6)."""
    grace: GraceConfig | None = field(default_factory=GraceConfig)
    """Adaptive grace window after quorum; null merges as soon as K learners answered."""
    outer_lr: float = 0.7
    """Outer Nesterov SGD learning rate."""
    outer_momentum: float = 0.9
    """Outer Nesterov SGD momentum."""
    momentum_follows_lr: bool = True
    """Rescale the outer momentum as the inner rate decays, so outer steps anneal too (`merge.OuterNesterov`)."""
    closing_step: str = "mean"
    """How the rounds merged while the run closes move their fragment, the last time it moves
    (`ddiloco.syncer.drain`): `mean` (Θ_p − Δ, Δ the answers' plain weighted mean: the learners' weighted
    mean, no RDA length, outer rate or momentum look-ahead) or `outer` (the merge and outer Nesterov step of
    every other round)."""
    merge: str = "rda"
    """`rda` (radial-directional averaging) or `mean` (token-weighted mean) for non-embedding tensors."""
    token_weighting: bool = True
    """Weight learners by c_tokens²/c_steps; false weighs every answer equally."""
    codec: str = "fp32"
    """Upload codec of deltas: fp32, bf16, int8, int4, int2 (blockwise absmax, block 128)."""
    global_dtype: str = "fp32"
    """dtype of published global fragments: fp32 or bf16."""
    download_codec: str = "int8"
    """Each new global version is also published as a delta against the previous one in this codec (int8,
    int4, int2; error feedback keeps learners within one quantization step of the syncer's master), and a
    learner one version behind downloads only that (`ddiloco.run.downlink`); none: full versions only (`off`
    would read as false in YAML). int8 by default: at the tiny preset (M = 4, int4 uploads, 1.5M tokens) it
    cut downloads 2.7x (fp32 globals, two seeds) and 1.7x (bf16), int4 3.8x and 2.5x, every val loss within
    the runs' noise (±2%) of none; int8 is the conservative choice (steps 18x finer) until int4 is shown free."""
    mixing: float = 0.0
    """α: on a new global version, local ← α·local + (1−α)·global (0 = overwrite)."""
    token_budget: int = 10_000_000
    """Stop when this many tokens are merged (averaged over fragments)."""
    deadline_s: float | None = None
    """Seconds after `prepare` at which the syncer stops merging and finishes the run as at its budget (a
    reservation that ends at a known time; evaluation still runs); null: the token budget alone."""
    round_timeout_s: float = 120.0
    """A round with fewer than K answers after this long is abandoned (no learner alive); it reopens later."""
    robust_clip: float | None = None
    """Robust mode: clip each outer gradient to this multiple of the round's median norm (null: off, ≥ 1)."""
    robust_merge: str | None = None
    """`trimmed_mean`: a round of 3 or more answers merges as their coordinate-wise trimmed mean
    (`ddiloco.syncer.merge.robust`; the round keeps its answers encoded until it merges); null: RDA or the mean alone."""
    robust_trim: float = 0.2
    """β of `robust_merge`: ⌊β·n⌋ of n answers dropped from each side of every coordinate, at least one, at
    most (n−1)/2; in (0, 0.5)."""
    staleness_exponent: float = 0.5
    """a: an answer s versions behind is weighted (1 + s)^-a, and a round of stale answers steps by the freshest
    one's discount (`ddiloco.syncer.fragment`); 0 weighs every answer by tokens alone."""
    max_staleness: int | None = 8
    """Reject (`too_stale`) answers whose base is more than this many versions behind; null accepts any."""

    def validate(self) -> None:
        from ddiloco.codec import registry as codecs  # here: importing a config does not import torch

        _check(self.learners >= 1, "diloco.learners must be ≥ 1")
        _check(
            self.max_learners is None or self.max_learners >= self.learners,
            f"diloco.max_learners={self.max_learners} must be ≥ diloco.learners={self.learners} (or null)",
        )
        _check(
            1 <= self.quorum <= self.learners,
            f"diloco.quorum={self.quorum} must be between 1 and diloco.learners={self.learners}",
        )
        _check(self.fragments >= 1, "diloco.fragments must be ≥ 1")
        _check(
            1 <= self.overlap <= self.fragments,
            f"diloco.overlap={self.overlap} must be between 1 and diloco.fragments={self.fragments}",
        )
        _check(self.sync_every >= 1, "diloco.sync_every must be ≥ 1")
        _choose("diloco.sync_from", self.sync_from, ("publish", "open"))
        _choose("diloco.closing_step", self.closing_step, ("mean", "outer"))
        _check(self.merge in MERGES, f"diloco.merge={self.merge!r}: choose one of {', '.join(MERGES)}")
        _choose("diloco.codec", self.codec, codecs.names("upload"))
        _choose("diloco.global_dtype", self.global_dtype, ("fp32", "bf16"))
        _choose("diloco.download_codec", self.download_codec, codecs.download_choices())
        _check(0.0 <= self.mixing < 1.0, f"diloco.mixing={self.mixing} must be in [0, 1)")
        _check(
            self.robust_clip is None or self.robust_clip >= 1.0,
            f"diloco.robust_clip={self.robust_clip} must be null (off) or ≥ 1 "
            "(e.g. 3: clip at 3× the median norm)",
        )
        _check(
            self.robust_merge in (None, "trimmed_mean"),
            f"diloco.robust_merge={self.robust_merge!r}: choose null (off) or trimmed_mean",
        )
        _check(
            0 < self.robust_trim < 0.5,
            f"diloco.robust_trim={self.robust_trim} must be in (0, 0.5) (e.g. 0.2: a fifth from each side)",
        )
        _check(
            self.outer_lr > 0 and 0 <= self.outer_momentum < 1,
            "diloco.outer_lr must be > 0 and diloco.outer_momentum in [0, 1)",
        )
        _check(
            math.isfinite(self.staleness_exponent) and self.staleness_exponent >= 0,
            f"diloco.staleness_exponent={self.staleness_exponent} must be ≥ 0 (0.5: half weight at staleness 3)",
        )
        _check(
            self.max_staleness is None or self.max_staleness >= 0,
            f"diloco.max_staleness={self.max_staleness} must be null (accept any) or ≥ 0",
        )
        _check(self.token_budget > 0, "diloco.token_budget must be > 0")
        _check(
            self.deadline_s is None or 0 < self.deadline_s < math.inf,
            f"diloco.deadline_s={self.deadline_s} must be > 0 seconds after prepare, or null (budget alone)",
        )
        _check(self.round_timeout_s > 0, "diloco.round_timeout_s must be > 0")
        if self.grace is not None:
            self.grace.validate()


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    val_batches: int = 16
    """Validation batches (batch_size × seq_len tokens each) for validation loss."""
    seed: int | None = None
    """Seed of the downstream task items; null uses the run's seed."""
    items_per_task: int = 200
    """Items per downstream task (fact tasks are capped by the number of facts in the world)."""
    tasks: list[str] | None = None
    """Only these tasks (e.g. [fact_mc, arithmetic]); null runs all of them."""
    curve_points: int = 8
    """Points of the post-hoc validation-loss curve of the global model (reports)."""
    device: str = "auto"
    """`auto` (CUDA when present), `cpu` or `cuda` for evaluation."""

    def validate(self) -> None:
        _check(self.val_batches >= 1, "eval.val_batches must be ≥ 1")
        _check(
            self.items_per_task >= 1 and self.curve_points >= 2,
            "eval.items_per_task ≥ 1, eval.curve_points ≥ 2",
        )
        _choose("eval.device", self.device, DEVICES)


@dataclass(kw_only=True, slots=True)
class SFTConfig:
    base: str = "final"
    """Checkpoint to fine-tune (any `ddiloco evaluate --model` spec: final, latest, round:N, a key)."""
    data: str | None = None
    """JSONL file of {"prompt", "response"} objects; null builds the synthetic instruction set."""
    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 32
    """Examples per step."""
    lr: float = 1e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay (matrices only)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (0 disables)."""
    replay_fraction: float = 0.5
    """Fraction of every batch made of pre-training windows (full loss), so SFT keeps what pre-training
    taught (the facts the held-out instructions ask about); 0 trains on instructions alone."""
    replay_seq_len: int = 64
    """Length of the replayed pre-training windows (at most the model's context)."""
    heldout_fraction: float = 0.25
    """Fraction of items held out for evaluation (see ddiloco/sft.py for the split key)."""
    items_per_kind: int = 400
    """Synthetic instruction items drawn per non-fact kind (before the split)."""
    eval_items: int = 200
    """Held-out items evaluated per kind (at most)."""
    seed: int | None = None
    """Seed of the instruction set, split and batch order; null uses the run's seed."""
    device: str = "auto"
    """`auto` (CUDA when present), `cpu` or `cuda`."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check(
            self.steps >= 0 and self.batch_size >= 1 and self.lr > 0,
            "sft.steps ≥ 0, sft.batch_size ≥ 1 and sft.lr > 0",
        )
        _check(0 <= self.replay_fraction < 1, f"sft.replay_fraction={self.replay_fraction} must be in [0, 1)")
        _check(
            0 < self.heldout_fraction < 1, f"sft.heldout_fraction={self.heldout_fraction} must be in (0, 1)"
        )


@dataclass(kw_only=True, slots=True)
class RestartConfig:
    delay_s: float = 1.0
    """Delay before restarting a process that died (like Argo's retryStrategy backoff.duration)."""
    factor: float = 2.0
    """Backoff factor between restarts of the same process."""
    max_delay_s: float = 10.0
    """Upper bound of the restart delay."""
    max_restarts: int = 10
    """Restarts allowed per process before it is given up."""

    def validate(self) -> None:
        _check(
            self.delay_s >= 0 and self.factor >= 1 and self.max_restarts >= 0,
            "restart: delay_s ≥ 0, factor ≥ 1, max_restarts ≥ 0",
        )


@dataclass(kw_only=True, slots=True)
class RunConfig:
    run_id: str = ""
    """Run identifier (one run = one store prefix); generated when empty."""
    seed: int = 0
    """Seed for model init, data order and the synthetic corpus."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The GPT being trained."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and shards."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Inner (learner) training."""
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    """Decoupled DiLoCo: learners, quorum, fragments, merge, compression, budget."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation settings."""
    sft: SFTConfig | None = field(default_factory=SFTConfig)
    """Supervised fine-tuning after pre-training (`ddiloco run`, the pipeline's sft step); null skips it."""
    chaos: ChaosConfig | None = None
    """Fault injection schedule; null for a run without injected faults."""
    restart: RestartConfig = field(default_factory=RestartConfig)
    """How the local orchestrator restarts processes that die (the cluster uses the pipeline's retries)."""
    link: LinkConfig | None = None
    """Learners' link to the store (also applied to the data-parallel baseline); null: no shaping."""
    retention: RetentionConfig | None = field(default_factory=RetentionConfig)
    """Which global and momentum versions the store keeps (`ddiloco.config.retention`); null keeps every one."""
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    """The syncer's lease (`ddiloco.syncer.lease`): one publishing syncer at a time, standbys take over."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Experiment tracking: TensorBoard event files under the run root's `tb/`, an optional MLflow run."""

    def validate(self) -> RunConfig:
        """Check every section, in order; raise `errors.ConfigError` saying what to change."""
        self.diloco.validate()
        self.train.validate()
        self.model.validate()
        self.data.validate()
        _check(
            self.data.tokenizer != "model" or self.model.hf is not None,
            "data.tokenizer=model needs model.hf (the directory whose tokenizer to use)",
        )
        self.eval.validate()
        for optional in (self.sft, self.link, self.retention):  # null: the feature is off
            if optional is not None:
                optional.validate()
        self.restart.validate()
        self.lease.validate()
        self.tracking.validate()
        if self.chaos is not None:
            self.chaos.validate(self.diloco.learners)
        top, cap = max(self._added_learners(), default=-1), self.diloco.max_learners
        _check(
            cap is None or top < cap,
            f"chaos adds learner {top}, an id without a shard of its own under diloco.max_learners={cap}; "
            f"raise diloco.max_learners to {top + 1} or set it to null",
        )
        return self

    def _added_learners(self) -> list[int]:
        events = schedule_from_config(self.chaos, self.diloco.learners)
        return [e.learner for e in events if e.kind == "add_learner" and e.learner is not None]

    @property
    def max_learners(self) -> int:
        """Learner ids 0..max_learners-1 each have a shard of their own (see diloco.max_learners)."""
        if self.diloco.max_learners is not None:
            return self.diloco.max_learners
        return max(self.diloco.learners, max(self._added_learners(), default=-1) + 1)

    @property
    def num_shards(self) -> int:
        """Shards `prepare` writes: data.num_shards, else one per learner id (`max_learners`)."""
        return self.data.num_shards or self.max_learners

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        cfg = cls()
        apply_dict(cfg, d)
        return cfg.validate()


_check, _choose = errors.require, errors.choose

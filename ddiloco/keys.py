"""Every object-store key and prefix of a run root, relative to the root: the only place that knows key names.

No torch here: `ddiloco.components`, `ddiloco.pipelines`, chaos and the summary import it cheaply.

What stays how long (bounded storage): global versions `global/{p}/v{n}` and outer momentum
`syncer/momentum/{p}/v{n}` are pruned by the syncer after each merge to the newest few plus the loss curve's
moments (`ddiloco.config.retention`, remembered in `syncer/retention.json`); updates `updates/{p}/{round}/` are
deleted when their round merges or is abandoned (late ones at the fragment's next merge, all at the end); a
learner keeps one checkpoint `learners/{id}/ckpt/` (`ddiloco.learner.checkpoint`). Everything else (round
records, reports, logs, evaluation) is small and kept for the summary and the report.
"""

from __future__ import annotations

import re

CONFIG = "config.json"
DATA_META = "data/meta.json"
TOKENIZER = "data/tokenizer.json"
VAL = "data/val.safetensors"
CORPUS = "data/corpus.json"
"""A pre-tokenized corpus read in place (`ddiloco.data.streamed`): its source, file manifest and range plan."""
LAYOUT = "global/layout.json"
STATUS = "syncer/status.json"
SYNCER_STATE = "syncer/state.json"
SYNCER_PACE = "syncer/pace.json"
"""`ddiloco.syncer.pace`: how closely the syncer kept the pace (overlap, sync period, lag)."""
RETENTION = "syncer/retention.json"
"""The curve moments the syncer keeps (`ddiloco.syncer.retention`): merge count -> version of every fragment."""
FINAL_MODEL = "final/model.safetensors"
FINAL_META = "final/meta.json"
DONE = "done.json"
SUMMARY = "summary.json"
LAUNCHER_EVENTS = "launcher/events.json"
UPDATES = "updates/"
LEARNERS = "learners/"
ROUNDS = "syncer/rounds/"
CHAOS = "chaos/"
"""Chaos event records (`ddiloco.chaos`): `chaos/fired/...` locally, `chaos/{backend}/...` on a cluster."""
KEEPER = "keeper/"
"""Keepers' notes on a worker waiting to be scheduled (`ddiloco.components.keeper_note`)."""


def keeper_note_key(name: str) -> str:
    """`keeper/<role>[-<learner id>].json`."""
    return f"{KEEPER}{name}.json"


# Post-training (ddiloco.posttrain): evaluation results, the fine-tuned model and the report.
EVAL = "eval/"
SFT_MODEL = "sft/model.safetensors"
SFT_META = "sft/meta.json"
SFT_SKIPPED = "sft/skipped.json"
"""Why fine-tuning was skipped (a user corpus without `sft.data`): `evaluate --model sft` then skips too."""
REPORT_HTML = "report/report.html"
REPORT_MD = "report/summary.md"
REPORT_METRICS = "report/metrics.json"

# The synchronous data-parallel baseline (ddiloco.baseline), in the run root it is compared with.
BASELINE_SUMMARY = "baseline/summary.json"
BASELINE_MODEL = "baseline/model.safetensors"


def eval_key(name: str) -> str:
    """Where `ddiloco evaluate --name NAME` writes its result (`eval/final.json`, `eval/sft.json`, ...)."""
    return f"{EVAL}{name}.json"


EVAL_CURVE = eval_key("curve")
"""The cached validation-loss curve of the global model (not an evaluation result)."""


def eval_name(key: str) -> str | None:
    """NAME of an `eval_key(NAME)` listed under `EVAL`, or None for anything else (the curve included)."""
    if not (key.startswith(EVAL) and key.endswith(".json")) or key == EVAL_CURVE:
        return None
    return key[len(EVAL) : -len(".json")]


def baseline_rank_key(rank: int) -> str:
    return f"baseline/rank-{rank:03d}.json"


def shard_key(i: int) -> str:
    return f"data/shard-{i:04d}.safetensors"


GLOBALS = "global/"
"""Every fragment's global versions, download deltas and latest pointers."""


def global_prefix(p: int) -> str:
    """Every global version of fragment p, and its latest pointer."""
    return f"{GLOBALS}{p:03d}/"


def global_key(p: int, version: int) -> str:
    return f"{global_prefix(p)}v{version:08d}.safetensors"


def global_delta_key(p: int, version: int) -> str:
    """Global version `version` of fragment p as a compressed delta against version − 1 (`ddiloco.run.downlink`)."""
    return f"{global_prefix(p)}d{version:08d}.safetensors"


def global_latest_key(p: int) -> str:
    return f"global/{p:03d}/latest.json"


def momentum_prefix(p: int) -> str:
    return f"syncer/momentum/{p:03d}/"


def momentum_key(p: int, version: int) -> str:
    return f"{momentum_prefix(p)}v{version:08d}.safetensors"


def version_of(key: str, prefix: str, letter: str = "v") -> int | None:
    """The version of a `global_key`, `momentum_key` or `master_key` listed under `prefix` (`global_prefix(p)`,
    `momentum_prefix(p)`, `master_prefix(p)`), or None for anything else there (the latest pointer, stray
    objects). `letter="d"`: the version of a `global_delta_key` instead."""
    name = key[len(prefix) :] if key.startswith(prefix) else ""
    ok = name.startswith(letter) and name.endswith(".safetensors")
    digits = name[1 : -len(".safetensors")] if ok else ""
    return int(digits) if len(digits) == 8 and digits.isdigit() else None


def global_versions_listed(listed: list[str], num_fragments: int) -> list[set[int]]:
    """Per fragment, the global versions among the keys `listed` (e.g. `store.list(GLOBALS)`)."""
    out: list[set[int]] = [set() for _ in range(num_fragments)]
    for p, found in enumerate(out):
        found.update(v for k in listed if (v := version_of(k, global_prefix(p))) is not None)
    return out


def master_prefix(p: int) -> str:
    return f"syncer/master/{p:03d}/"


def master_key(p: int, version: int) -> str:
    """The syncer's fp32 master of fragment p at `version` (written when the published values differ from it:
    bf16 globals or download deltas)."""
    return f"{master_prefix(p)}v{version:08d}.safetensors"


QUARANTINE = "syncer/quarantine/"
"""Objects found at a key the syncer writes that did not verify, moved aside (`ddiloco.syncer.adopt`)."""


def quarantine_key(key: str, tag: str) -> str:
    """Where the syncer moves the unverifiable object it found at `key`; `tag` tells copies apart."""
    return f"{QUARANTINE}{key}.{tag}"


LEASE = "syncer/lease/"
"""The syncer's lease (`ddiloco.syncer.lease`): claims of epochs, the holder's renewals, standbys."""


def lease_claim_key(epoch: int) -> str:
    """Write-once claim of one syncer epoch (Store.create): exactly one syncer process gets each number."""
    return f"{LEASE}claims/{epoch:08d}.json"


def lease_claim_prefix() -> str:
    return f"{LEASE}claims/"


def lease_epoch_of(key: str) -> int | None:
    """The epoch of a `lease_claim_key` listed under `lease_claim_prefix()`, or None for anything else."""
    name = key[len(lease_claim_prefix()) :] if key.startswith(lease_claim_prefix()) else ""
    stem = name[: -len(".json")] if name.endswith(".json") else ""
    return int(stem) if stem.isdigit() and len(stem) == 8 else None


def lease_renewal_key(epoch: int) -> str:
    """The holder of `epoch` rewrites this (only it does) to say it is alive, or that it released the lease."""
    return f"{LEASE}renewals/{epoch:08d}.json"


def lease_standby_key(nonce: str) -> str:
    """A standing-by syncer's announcement (the holder lists them into the status object)."""
    return f"{LEASE}standby/{nonce}.json"


def lease_standby_prefix() -> str:
    return f"{LEASE}standby/"


def round_record_key(round_: int) -> str:
    return f"{ROUNDS}{round_:08d}.json"


def fragment_updates_prefix(p: int) -> str:
    """Every update of fragment p, of any round."""
    return f"{UPDATES}{p:03d}/"


def update_prefix(p: int, round_: int) -> str:
    return f"{UPDATES}{p:03d}/{round_:08d}/"


def update_key(p: int, round_: int, learner_id: int, incarnation: int) -> str:
    return f"{update_prefix(p, round_)}{learner_id:03d}-{incarnation:04d}.safetensors"


def learner_prefix(learner_id: int) -> str:
    return f"{LEARNERS}{learner_id:03d}/"


def incarnation_key(learner_id: int) -> str:
    """The newest incarnation a learner claimed: a hint for readers (two starts may write it out of order)."""
    return f"{learner_prefix(learner_id)}incarnation.json"


def incarnation_claim_key(learner_id: int, incarnation: int) -> str:
    """Write-once claim of one incarnation number (Store.create): exactly one process gets each number."""
    return f"{learner_prefix(learner_id)}incarnations/{incarnation:04d}.json"


def incarnation_claim_prefix(learner_id: int) -> str:
    return f"{learner_prefix(learner_id)}incarnations/"


def report_key(learner_id: int, incarnation: int) -> str:
    return f"{learner_prefix(learner_id)}inc-{incarnation:04d}/report.json"


def is_report_key(key: str) -> bool:
    """Whether a key listed under `LEARNERS` is a learner report (`report_key`)."""
    return key.startswith(LEARNERS) and key.endswith("/report.json")


def claim_prefix(learner_id: int) -> str:
    """Claims of a learner id by joiners from elsewhere (`ddiloco.run.join`)."""
    return f"{learner_prefix(learner_id)}claims/"


def claim_key(learner_id: int, nonce: str) -> str:
    return f"{claim_prefix(learner_id)}{nonce}.json"


def ckpt_prefix(learner_id: int) -> str:
    """A learner's checkpoints and their latest pointer (`ddiloco.learner.checkpoint` keeps one)."""
    return f"{learner_prefix(learner_id)}ckpt/"


def ckpt_key(learner_id: int, step: int) -> str:
    return f"{ckpt_prefix(learner_id)}step-{step:08d}.safetensors"


def ckpt_latest_key(learner_id: int) -> str:
    return f"{ckpt_prefix(learner_id)}latest.json"


def contributor(learner_id: int, incarnation: int) -> str:
    """The name a learner incarnation goes by in round records and the status object."""
    return f"{learner_id}-{incarnation}"


LOGS = "logs/"
_LOG_NAME = re.compile(r"(?:(\d{3,9})-)?(\d{4,9})(?:\.dup(\d{1,4}))?\.json")


def log_key(role: str, incarnation: int, ident: int | None = None, dup: int = 0) -> str:
    """Where a process ships its log (`ddiloco.tracking.logship`): `logs/learner/002-0001.json` (learner 2,
    incarnation 1), `logs/syncer/0003.json`, `logs/evaluate/0000.json`. Numbers are zero-padded so names sort;
    `.dupN` marks a second process that got a number already taken (one died before its role counted it)."""
    if not role.isalpha() or not role.islower():
        raise ValueError(f"log role must be lowercase letters, got {role!r}")
    name = f"{incarnation:04d}" if ident is None else f"{ident:03d}-{incarnation:04d}"
    return f"{LOGS}{role}/{name}{f'.dup{dup}' if dup else ''}.json"


def parse_log_key(key: str) -> tuple[str, int | None, int, int] | None:
    """(role, ident or None, incarnation, dup) of a `log_key`, or None if `key` is not one."""
    parts = key.split("/")
    m = _LOG_NAME.fullmatch(parts[-1]) if len(parts) == 3 and f"{parts[0]}/" == LOGS else None
    if m is None or not (parts[1].isalpha() and parts[1].islower()):
        return None
    role, ident, inc, dup = parts[1], None if m[1] is None else int(m[1]), int(m[2]), int(m[3] or 0)
    return (role, ident, inc, dup) if log_key(role, inc, ident, dup) == key else None


def parse_update_name(name: str) -> tuple[int, int] | None:
    """(learner_id, incarnation) from the last segment of an update key, or None if it is not one."""
    stem, dot, ext = name.partition(".")
    lid, dash, inc = stem.partition("-")
    if ext != "safetensors" or not dash or not (lid.isdigit() and inc.isdigit()) or "/" in name:
        return None
    if len(lid) > 9 or len(inc) > 9 or name != f"{int(lid):03d}-{int(inc):04d}.safetensors":
        return None
    return int(lid), int(inc)


CHAOS_SELF_FIRED = "fired"
"""The `chaos_record_key` backend of the kills a learner fires at itself (`at_step`)."""


def chaos_step_key(backend: str) -> str:
    """When the chaos steps of a run with this backend started (`{"started_at": [epoch, ...]}`): a step that
    finds it is a re-run (`ddiloco.chaos.runner`). Outside CHAOS: it is no event record."""
    return f"chaos-steps/{backend}.json"


def chaos_record_key(backend: str, event_id: str) -> str:
    """What chaos did with one event, written once: `backend` is the chaos step's (`k8s`, `local`), or
    CHAOS_SELF_FIRED; `summary.json` lists everything under CHAOS."""
    return f"{CHAOS}{backend}/{event_id}.json"


TB = "tb/"
"""TensorBoard event files, one directory (a TensorBoard run) per role: `tb/syncer/`, `tb/learner-0/`,
`tb/posttrain/` (`ddiloco.tracking.tensorboard`)."""
TRACKING = "tracking/"
MLFLOW_RUN = "tracking/mlflow.json"
"""The run's MLflow run ({tracking_uri, experiment_id, run_id}), claimed once with `Store.create` by the first
role that logs to MLflow; the others log into the same MLflow run (`ddiloco.tracking.mlflow_run`)."""
_TRACKING_ROLE = re.compile(r"[a-z]+(?:-\d{1,6})?")


def tracking_role(role: str) -> str:
    """`role` if it names a tracking run (`syncer`, `posttrain`, `learner-3`), else ValueError."""
    if not _TRACKING_ROLE.fullmatch(role):
        raise ValueError(f"tracking role must look like syncer or learner-3, got {role!r}")
    return role


def tb_key(role: str, name: str) -> str:
    """An event file of `role`'s TensorBoard run; `name` contains `tfevents` (what TensorBoard reads)."""
    return f"{TB}{tracking_role(role)}/{name}"


def tracking_stats_key(role: str, name: str) -> str:
    """What one process's tracker wrote and dropped (`{role, written, dropped}`), written when it closes."""
    return f"{TRACKING}stats/{tracking_role(role)}/{name}.json"

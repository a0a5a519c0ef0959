"""Every object-store key and prefix of a run root, relative to the root: the only place that knows key names.

No torch here: `ddiloco.components`, `ddiloco.pipelines`, chaos and the summary import it cheaply.
"""

from __future__ import annotations

import re

CONFIG = "config.json"
DATA_META = "data/meta.json"
TOKENIZER = "data/tokenizer.json"
VAL = "data/val.safetensors"
LAYOUT = "global/layout.json"
STATUS = "syncer/status.json"
SYNCER_STATE = "syncer/state.json"
FINAL_MODEL = "final/model.safetensors"
FINAL_META = "final/meta.json"
DONE = "done.json"
SUMMARY = "summary.json"
LAUNCHER_EVENTS = "launcher/events.json"


def shard_key(i: int) -> str:
    return f"data/shard-{i:04d}.safetensors"


def global_key(p: int, version: int) -> str:
    return f"global/{p:03d}/v{version:08d}.safetensors"


def global_latest_key(p: int) -> str:
    return f"global/{p:03d}/latest.json"


def momentum_key(p: int, version: int) -> str:
    return f"syncer/momentum/{p:03d}/v{version:08d}.safetensors"


def round_record_key(round_: int) -> str:
    return f"syncer/rounds/{round_:08d}.json"


def update_prefix(p: int, round_: int) -> str:
    return f"updates/{p:03d}/{round_:08d}/"


def update_key(p: int, round_: int, learner_id: int, incarnation: int) -> str:
    return f"{update_prefix(p, round_)}{learner_id:03d}-{incarnation:04d}.safetensors"


def learner_prefix(learner_id: int) -> str:
    return f"learners/{learner_id:03d}/"


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


def ckpt_key(learner_id: int, step: int) -> str:
    return f"{learner_prefix(learner_id)}ckpt/step-{step:08d}.safetensors"


def ckpt_latest_key(learner_id: int) -> str:
    return f"{learner_prefix(learner_id)}ckpt/latest.json"


def contributor(learner_id: int, incarnation: int) -> str:
    """The name a learner incarnation goes by in round records and the status object."""
    return f"{learner_id}-{incarnation}"


LOGS = "logs/"
_LOG_NAME = re.compile(r"(?:(\d{3,9})-)?(\d{4,9})(?:\.dup(\d{1,4}))?\.json")


def log_key(role: str, incarnation: int, ident: int | None = None, dup: int = 0) -> str:
    """Where a process ships its log (`ddiloco.logship`): `logs/learner/002-0001.json` (learner 2,
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

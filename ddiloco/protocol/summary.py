"""summary.json: the run summary (`ddiloco.posttrain.summary.build_summary` computes it from the store).

Field order is the JSON's order. Free-form parts (chaos events, per-learner accounting, tracking) stay JSON
objects; every field is checked against its annotation when read (`Summary.from_json`). The post-training
fields after `task_accuracy` are written only once post-training ran (`posttrain_seconds` is set), as
`ddiloco run` writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddiloco.protocol.fields import Fields, plain
from ddiloco.protocol.messages import LearnerEvent

Json = dict[str, Any]


@dataclass(slots=True)
class Summary:
    """summary.json (`ddiloco.posttrain.summary` says what each figure means)."""

    # --- the run and its settings
    run_id: str
    status: str
    """`done` once the syncer wrote done.json, else `running`."""
    waiting: dict[str, Json]
    finished_by: str | None
    closing: dict[str, float] | None
    wall_seconds: float | None
    learners: int
    quorum: int
    num_fragments: int
    sync_every: int
    steps_per_answer: float | None
    overlap: int
    codec: str
    token_budget: int
    model_params: int
    fragment_bytes: list[int]
    # --- the token books
    tokens_processed: int
    tokens_merged: float
    tokens_discarded: float
    tokens_outstanding: float
    tokens_merged_per_fragment: list[int]
    tokens_merged_by_learners_per_fragment: list[int]
    ledger_balanced: bool
    # --- global versions and the store
    rounds: int
    rounds_abandoned: int
    global_versions: list[int]
    global_versions_contiguous: bool
    global_versions_kept: list[int]
    store_bytes: int
    store_bytes_by_prefix: dict[str, int]
    versions_by_multiple_epochs: int
    syncer_epochs: list[int]
    versions_by_epoch: dict[str, int]
    # --- learners: incarnations, sites, data, failures
    incarnations: dict[str, int]
    tokens_per_learner: dict[str, int]
    tokens_merged_by_site: dict[str, float]
    tokens_processed_by_site: dict[str, int]
    learners_by_site: dict[str, list[int]]
    data_shards: int
    data_read: dict[str, Json]
    data_mixture: dict[str, Json] | None
    shared_shards: dict[str, list[int]]
    unread_shards: list[int]
    chaos_events: list[Json]
    learner_events: list[LearnerEvent]
    kill_recovery: list[Json]
    learner_accounting: dict[str, Json]
    tokens_read_twice: int
    restarts: list[Json]
    # --- the syncer's and the learners' counters
    rejected_updates: dict[str, int]
    clipped_updates: dict[str, int]
    rejected_globals: dict[str, int]
    bytes_uploaded: int
    bytes_downloaded: int
    bytes_published: int
    late_answers: int
    # --- efficiency and pace
    goodput: float | None
    merged_token_share: float | None
    learner_step_seconds: float | None
    learner_step_wall_seconds: float | None
    processed_tokens_per_s: float | None
    mfu: float | None
    data_wait_fraction: float | None
    peak_memory_bytes: int | None
    peak_memory_kind: str | None
    mean_quorum: float | None
    mean_grace_seconds: float | None
    mean_time_to_quorum_seconds: float | None
    mean_staleness: float | None
    syncer_lag: float | None
    sync_pace: Json
    entropy_floor: float | None
    tracking: Json
    # --- evaluation (`ddiloco.posttrain.stages.summary_fields`); None until post-training ran
    initial_val_loss: float | None = None
    final_val_loss: float | None = None
    sft_val_loss: float | None = None
    task_accuracy: Json | None = None
    # written only after post-training (`POSTTRAIN_FIELDS`)
    final_perplexity: float | None = None
    sft_perplexity: float | None = None
    sft_task_accuracy: Json | None = None
    instruction_accuracy_before: Json | None = None
    instruction_accuracy_after: Json | None = None
    sft: Json | None = None
    posttrain_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = plain(self)
        if self.posttrain_seconds is None:
            for name in POSTTRAIN_FIELDS:
                del out[name]
        return out

    @classmethod
    def from_json(cls, obj: Any) -> Summary:
        f = Fields(obj, "summary")
        return f.build(cls, learner_events=f.each("learner_events", LearnerEvent.from_json))


POSTTRAIN_FIELDS = (
    "final_perplexity",
    "sft_perplexity",
    "sft_task_accuracy",
    "instruction_accuracy_before",
    "instruction_accuracy_after",
    "sft",
    "posttrain_seconds",
)
"""The fields post-training adds at the end of summary.json."""

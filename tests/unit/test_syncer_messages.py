"""The protocol's documents (`ddiloco.protocol.messages`, the update header): the JSON as written, read back, and bad
fields named."""

import json
import math

import pytest

from ddiloco.protocol.messages import RoundRecord, Status, SyncerState
from ddiloco.protocol.update import UpdateHeader
from ddiloco.protocol.wire import PayloadError

RECORD = {
    "round": 12,
    "fragment_id": 0,
    "version": 6,
    "opened_at": 1700000000.5,
    "time_to_quorum": 0.25,
    "grace_s": 0.1,
    "merged_at": 1700000001.0,
    "quorum": 2,
    "contributors": {
        "0-0": {
            "c_tokens": 512,
            "c_steps": 4,
            "c_seconds": 0.5,
            "base_version": 5,
            "staleness": 0,
            "weight": 65536.0,
            "discount": 1.0,
        },
        "1-2": {
            "c_tokens": 384,
            "c_steps": 3,
            "c_seconds": 1,
            "base_version": 4,
            "staleness": 1,
            "weight": 1.0,
            "discount": 0.7071067811865476,
        },
    },
    "rejected": {"009-0000.safetensors": "bad_signature"},
    "merged_norm": 1.5,
    "mean_delta_norm": 1.25,
    "ratio": 1.2,
    "clipped": {"1-2": 0.5},
    "epoch": 2,
    "step": "mean",
}
MERGED = {"round": 12, "fragment_id": 0, "version": 6, "contributors": {"0-0": 512, "1-2": 384}}
STATUS = {
    "run_id": "r",
    "time": 1700000002.0,
    "syncer_incarnation": 1,
    "done": False,
    "syncer_host": "h",
    "syncer_pid": 42,
    "next_round": 14,
    "versions": {"0": 6, "1": 5},
    "open_rounds": [{"round": 13, "fragment_id": 1, "opened_at": 1700000001.5}],
    "merged": [MERGED],
    "tokens_merged": 448.0,
    "token_budget": 12000,
    "rounds_merged": 11,
    "live_learners": 2,
    "loss": 3.25,
    "rejected": {"bad_signature": 1},
    "clipped": {"norm_outlier": 1},
    "rejections": [
        {"learner_id": 1, "incarnation": 2, "fragment_id": 0, "round": 12, "reason": "bad_codec", "time": 1.5}
    ],
    "epoch": 2,
    "standbys": [{"host": "h2", "pid": 43, "time": 1700000001.75}],
    "closing": False,
    "tokens_per_s": 1536.5,
    "mfu": 0.25,
}
STATE = {
    "run_id": "r",
    "incarnation": 1,
    "versions": [6, 5],
    "ledger": [
        {"merged_tokens": 896, "merged_answers": 2, "merged_steps": 7},
        {"merged_tokens": 0, "merged_answers": 0, "merged_steps": 0},
    ],
    "rejected": {"bad_signature": 1},
    "clipped": {},
    "next_round": 14,
    "rounds_merged": 11,
    "rounds_abandoned": 0,
    "merged_recent": [MERGED],
    "xi_quorum": 0.2,
    "xi_sync": 0.01,
    "started_wall": 1699999999.0,
    "open_rounds": [{"round": 13, "fragment_id": 1, "opened_wall": 1700000001.5}],
    "bytes_published": 1024,
    "late_answers": 3,
    "learner_events": [{"event": "joined", "learner": "0-0", "time": 1.0}],
    "epoch": 2,
    "xi_link": 0.3,
    "quarantined": {"bad_signature": 1},
    "credited_steps": {"0-1/2": 40},
}


@pytest.mark.parametrize("cls, doc", [(RoundRecord, RECORD), (Status, STATUS), (SyncerState, STATE)])
def test_documents_read_back_to_the_same_json(cls, doc):
    """Same fields, same order, same number types (an int stays an int): byte-identical JSON."""
    assert json.dumps(cls.from_json(doc).to_json()) == json.dumps(doc)


def test_a_round_record_written_before_closing_steps_existed_took_the_outer_step():
    old = {k: v for k, v in RECORD.items() if k != "step"}
    assert RoundRecord.from_json(old).step == "outer"


def test_a_round_record_written_before_staleness_discounts_reads_with_discount_one():
    contributors = {c: dict(x) for c, x in RECORD["contributors"].items()}
    for x in contributors.values():
        del x["discount"]
    old = {**RECORD, "contributors": contributors}
    assert {c: x.discount for c, x in RoundRecord.from_json(old).contributors.items()} == {
        "0-0": 1.0,
        "1-2": 1.0,
    }


def test_the_status_loss_may_be_nan():
    status = Status.from_json(STATUS | {"loss": math.nan})
    assert math.isnan(status.to_json()["loss"])


def test_a_status_from_before_throughput_reads_it_unknown():
    old = {k: v for k, v in STATUS.items() if k not in ("tokens_per_s", "mfu")}
    status = Status.from_json(old)
    assert status.tokens_per_s is None and status.mfu is None


def test_an_older_state_without_optional_fields_reads_them_empty():
    old = {k: v for k, v in STATE.items() if k not in ("clipped", "open_rounds", "learner_events")}
    state = SyncerState.from_json(old)
    assert state.clipped == {} and state.open_rounds == [] and state.learner_events == []
    assert SyncerState.from_json({k: v for k, v in STATE.items() if k != "xi_link"}).xi_link == 0.0
    assert SyncerState.from_json({k: v for k, v in STATE.items() if k != "quarantined"}).quarantined == {}


@pytest.mark.parametrize("cls, doc", [(RoundRecord, RECORD), (Status, STATUS), (SyncerState, STATE)])
def test_documents_from_before_the_lease_read_as_epoch_0(cls, doc):
    old = {k: v for k, v in doc.items() if k not in ("epoch", "standbys")}
    assert cls.from_json(old).epoch == 0


@pytest.mark.parametrize(
    "cls, doc, field",
    [
        (RoundRecord, RECORD | {"quorum": "2"}, "'quorum'"),
        (RoundRecord, RECORD | {"rejected": {"x": 1}}, "'rejected'"),
        (RoundRecord, {**RECORD, "contributors": {"0-0": {"c_tokens": 1}}}, "'c_steps'"),
        (Status, {k: v for k, v in STATUS.items() if k != "syncer_pid"}, "'syncer_pid'"),
        (Status, STATUS | {"done": 0}, "'done'"),
        (Status, STATUS | {"versions": {"0": 6, "2": 5}}, "'versions'"),
        (Status, STATUS | {"time": True}, "'time'"),
        (SyncerState, STATE | {"versions": [6, "5"]}, "'versions'"),
        (SyncerState, STATE | {"ledger": [{"merged_tokens": 1.5}]}, "'merged_tokens'"),
        (
            SyncerState,
            STATE | {"open_rounds": [{"round": 13, "fragment_id": 1, "opened_at": 1.0}]},
            "'opened_wall'",
        ),
        (SyncerState, [], "expected a JSON object"),
    ],
)
def test_a_bad_field_is_named(cls, doc, field):
    with pytest.raises(ValueError, match=field):
        cls.from_json(doc)


HEADER = {
    "run_id": "r", "kind": "update", "learner_id": 1, "incarnation": 2, "fragment_id": 0, "round": 7,
    "base_version": 3, "c_steps": 4, "c_tokens": 512, "c_seconds": 0.25, "inner_step": 40, "codec": "int8",
    "wait_s": 0.125,
}  # fmt: skip


def test_an_update_header_is_written_in_the_learners_order_and_reads_back():
    """The learner packs `to_json` (wire bytes sort the keys; the key set and values are the header's)."""
    got = UpdateHeader.from_json({**HEADER, "norms": {"w": 1.0}, "packing": "planar"})
    assert list(got.to_json().items()) == list(HEADER.items())
    assert (got.norms, got.packing) == ({"w": 1.0}, "planar")
    assert UpdateHeader.from_json(HEADER).norms is None


@pytest.mark.parametrize("wait", [-1, "x", True, math.nan, None])
def test_an_unusable_wait_reads_as_zero(wait):
    assert UpdateHeader.from_json({**HEADER, "wait_s": wait}).wait_s == 0.0
    assert UpdateHeader.from_json({k: v for k, v in HEADER.items() if k != "wait_s"}).wait_s == 0.0


@pytest.mark.parametrize("field", ["learner_id", "round", "c_tokens", "c_seconds", "codec"])
def test_a_bad_update_header_field_is_malformed_and_named(field):
    with pytest.raises(PayloadError, match=field) as e:
        UpdateHeader.from_json({**HEADER, field: None if field != "codec" else 5})
    assert e.value.reason == "malformed"

"""Log shipping (`ddiloco.tracking.logship`): the ring's bound, periodic writes, store errors, keys, SIGTERM, the
report's view of processes that died, and `ddiloco logs`. Really killed processes:
tests/integration/test_log_shipping.py."""

from __future__ import annotations

import logging
import signal
import time

import pytest

from ddiloco import keys
from ddiloco.cli.main import main
from ddiloco.posttrain.report import deaths_html, deaths_markdown
from ddiloco.store.base import StoreUnavailable
from ddiloco.store.memory import reset_memory_stores
from ddiloco.store.url import open_store
from ddiloco.tracking import logship


@pytest.fixture
def store():
    reset_memory_stores()
    yield open_store("memory://logship/run")
    reset_memory_stores()


class Flaky:
    """The public Store API of `inner`, failing every call while `down` (an outage)."""

    def __init__(self, inner):
        self.inner, self.down, self.calls = inner, False, 0

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def call(*args, **kwargs):
            self.calls += 1
            if self.down:
                raise StoreUnavailable("injected outage")
            return method(*args, **kwargs)

        return call


def handler(role="learner", **kw) -> logship.StoreLogHandler:
    h = logship.StoreLogHandler(role, **kw)
    h.setFormatter(logging.Formatter("%(message)s"))
    return h


def wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_keys_are_zero_padded_sortable_and_parse_back():
    assert keys.log_key("learner", 1, 2) == "logs/learner/002-0001.json"
    assert keys.log_key("syncer", 3) == "logs/syncer/0003.json"
    assert keys.log_key("learner", 1, 2, dup=1) == "logs/learner/002-0001.dup1.json"
    for role, inc, ident, dup in [("learner", 1, 2, 0), ("syncer", 3, None, 0), ("learner", 1, 2, 1),
                                  ("evaluate", 12345, None, 0)]:  # fmt: skip
        assert keys.parse_log_key(keys.log_key(role, inc, ident, dup)) == (role, ident, inc, dup)
    assert keys.parse_log_key("logs/learner/002-0001.dup1.json") == ("learner", 2, 1, 1)
    assert keys.parse_log_key("logs/syncer/0003.json") == ("syncer", None, 3, 0)
    for bad in ["logs/learner/2-0001.json", "logs/learner/002-0001.dup0.json", "logs/a/b/0001.json", "x/y"]:
        assert keys.parse_log_key(bad) is None
    names = [keys.log_key("learner", i, j) for j in (10, 2) for i in (11, 3)]
    assert sorted(names) == [keys.log_key("learner", i, j) for j in (2, 10) for i in (3, 11)]
    with pytest.raises(ValueError):
        keys.log_key("Learner/x", 0)


def test_ring_is_bounded_in_bytes_and_counts_what_it_dropped(store):
    h = handler(max_bytes=1000)
    for i in range(100):
        h.append(f"line {i:03d} " + "x" * 40)  # 49 bytes each: 20 fit
    assert h.dropped_lines == 80 and h.dropped_bytes == 80 * 49
    h.append("é" * 2000)  # one record over a quarter of the ring is cut, on a character boundary
    h.bind(store, ident=0, incarnation=0)
    assert h.ship()
    doc = logship.read_log(store, "logs/learner/000-0000.json")
    assert sum(len(x.encode()) for x in doc["lines"]) <= 1000
    assert doc["lines"][-1].startswith("é" * 125) and doc["lines"][-1].endswith("bytes cut]")
    assert doc["lines"][-2] == "line 099 " + "x" * 40
    assert doc["dropped_lines"] == h.dropped_lines > 80 and doc["exit"] is None and doc["incarnation"] == 0
    puts = store.stats.snapshot()
    assert h.ship() and store.stats.snapshot() == puts, "an unchanged ring is not written again"


def test_ships_every_interval_from_a_thread(store):
    h = handler(interval_s=0.05)
    logger = logging.getLogger("test.logship.periodic")
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    try:
        logger.info("before bind")  # kept until the handler knows where to ship
        time.sleep(0.1)
        assert not store.list("logs/")
        h.bind(store, ident=3, incarnation=7)
        key = "logs/learner/003-0007.json"
        wait_for(lambda: store.exists(key))  # at once
        logger.info("second")
        wait_for(lambda: logship.read_log(store, key)["lines"] == ["before bind", "second"])
        assert logship.read_log(store, key)["exit"] is None
    finally:
        logger.removeHandler(h)
        h.close()
    assert logship.read_log(store, key)["exit"] == "exit"


def test_the_first_line_is_written_at_once_not_an_interval_later(store):
    h = handler(interval_s=60)
    h.bind(store, ident=1, incarnation=0)  # nothing to write yet
    time.sleep(0.1)
    h.append("joined")  # e.g. a learner that chaos kills a moment after it joined
    wait_for(lambda: store.exists("logs/learner/001-0000.json"), timeout=2)
    h.append("later")  # from now on, every interval
    time.sleep(0.2)
    assert logship.read_log(store, "logs/learner/001-0000.json")["lines"] == ["joined"]
    h.close()
    assert logship.read_log(store, "logs/learner/001-0000.json")["lines"] == ["joined", "later"]


def test_a_hanging_store_delays_the_final_write_by_its_timeout_only(store):
    class Hanging(Flaky):
        def __getattr__(self, name):
            time.sleep(5)

    h = handler(interval_s=60)
    h.append("x")
    h._target = (Hanging(store), None, 0)  # bound, without starting the thread
    t0 = time.monotonic()
    assert not h.finish("SIGTERM", timeout=0.3)
    assert time.monotonic() - t0 < 2


def test_store_errors_keep_the_ring_and_the_next_write_catches_up(store, caplog):
    flaky = Flaky(store)
    h = handler(interval_s=0.05)
    h.append("one")
    flaky.down = True
    with caplog.at_level(logging.INFO):
        h.bind(flaky, incarnation=0)
        wait_for(lambda: h.failures >= 3)  # the thread keeps trying, quietly
        h.append("two")
        assert not store.list("logs/")
        flaky.down = False
        wait_for(lambda: store.exists("logs/learner/0000.json"))
    assert logship.read_log(store, "logs/learner/0000.json")["lines"] == ["one", "two"]
    assert not [r for r in caplog.records if r.name == "ddiloco.tracking.logship"], "store errors: debug only"
    flaky.down = True
    assert not h.finish("exit", timeout=2)  # the final write fails too, without raising or hanging
    h.close()


def test_a_taken_number_gets_dup_and_numberless_roles_take_the_next(store):
    for _ in range(2):
        h = handler("syncer")
        h.append("a syncer")
        h.bind(store, incarnation=1)  # e.g. the first one died before it wrote its state
        assert h.ship()
        h.close()
    for _ in range(2):
        h = handler("evaluate")
        h.append("an evaluation")
        h.bind(store)
        assert h.finish("exit")
    assert [k for k, _ in logship.list_logs(store)] == [
        "logs/evaluate/0000.json", "logs/evaluate/0001.json",
        "logs/syncer/0001.json", "logs/syncer/0001.dup1.json",
    ]  # fmt: skip
    assert logship.read_log(store, "logs/evaluate/0001.json")["incarnation"] == 1


def test_exit_reason_and_exception_are_recorded(store):
    h = handler("report")
    h.bind(store)
    h.append("working")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        h.note_exception()
    h.close()
    h.close()  # idempotent (logging.shutdown closes it again at exit)
    doc = logship.read_log(store, "logs/report/0000.json")
    assert doc["exit"] == "error" and "RuntimeError: boom" in doc["lines"][-1]


def test_sigterm_ships_then_hands_the_signal_on(store, monkeypatch):
    monkeypatch.setenv(logship.ENV_INTERVAL, "60")  # no periodic write: what is there came from SIGTERM
    got = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        h = logship.install("syncer")
        assert h is not None and signal.getsignal(signal.SIGTERM) is logship._on_sigterm
        logging.getLogger("test.logship").warning("a line before bind")
        logship.bind(store, incarnation=4)
        key = "logs/syncer/0004.json"
        wait_for(lambda: store.exists(key))  # shipped once, at bind
        logging.getLogger("test.logship").warning("the last line before SIGTERM")
        time.sleep(0.2)
        assert len(logship.read_log(store, key)["lines"]) == 1
        signal.raise_signal(signal.SIGTERM)
        assert got == [signal.SIGTERM], "the previous handler ran after the log was shipped"
        doc = logship.read_log(store, key)
        assert doc["exit"] == "SIGTERM" and len(doc["lines"]) == 3
        assert any("the last line before SIGTERM" in x for x in doc["lines"])
        assert "SIGTERM received" in doc["lines"][-1]
        logship.uninstall(h)
        assert h not in logging.getLogger().handlers
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_that_does_not_end_the_process_resumes_shipping(store):
    # PID 1 of a container ignores SIGTERM's default action: it runs on until its SIGKILL, and so does its log
    h = handler(interval_s=0.05)
    h.bind(store, incarnation=0)
    h.append("before")
    assert h.finish("SIGTERM")
    assert logship.read_log(store, "logs/learner/0000.json")["exit"] == "SIGTERM"
    stopped = h._thread
    h.resume()
    h.append("after")
    wait_for(lambda: logship.read_log(store, "logs/learner/0000.json")["lines"] == ["before", "after"])
    assert logship.read_log(store, "logs/learner/0000.json")["exit"] is None
    wait_for(lambda: not stopped.is_alive())  # one shipping thread, the new one
    assert h._thread is not stopped and h._thread.is_alive()
    h.close()


def test_shipping_can_be_turned_off_and_bad_settings_fall_back():
    assert logship.install("learner", env={logship.ENV_INTERVAL: "0"}) is None
    assert logship.settings({logship.ENV_INTERVAL: "2.5", logship.ENV_KB: "64"}) == (2.5, 64 * 1024)
    assert logship.settings({logship.ENV_INTERVAL: "soon", logship.ENV_KB: "-1"}) == (5.0, 1 << 20)


def put_log(store, role, inc, ident=None, exit=None, n=30, dup=0):
    doc = {
        "role": role,
        "id": ident,
        "incarnation": inc,
        "exit": exit,
        "time": time.time(),
        "dropped_lines": 0,
    }
    doc["lines"] = [f"{role} {ident} {inc} line {i}" for i in range(n)]
    store.put_json(keys.log_key(role, inc, ident, dup), doc)


def test_died_names_killed_incarnations_with_their_last_lines(store, capsys):
    reports = [
        {"learner_id": 0, "incarnation": 0, "final": False},  # killed: a newer one started
        {"learner_id": 0, "incarnation": 1, "final": True, "exit_reason": "done"},
        {"learner_id": 1, "incarnation": 0, "final": True, "exit_reason": "error"},
        {"learner_id": 2, "incarnation": 0, "final": False},  # the newest, the run still going: alive
    ]
    for lid, inc in [(0, 0), (0, 1), (1, 0), (2, 0), (3, 0), (3, 1)]:
        put_log(store, "learner", inc, lid)  # learner 3 incarnation 0: killed before its first report
    put_log(store, "syncer", 0, exit="SIGTERM")
    put_log(store, "syncer", 1)  # running
    put_log(store, "evaluate", 0, exit="exit")
    put_log(store, "report", 0)  # running (this report itself)
    got = {d["key"]: d for d in logship.died(store, reports, done=False, tail=5)}
    assert sorted(got) == [
        "logs/learner/000-0000.json", "logs/learner/001-0000.json", "logs/learner/003-0000.json",
        "logs/syncer/0000.json",
    ]  # fmt: skip
    assert got["logs/learner/000-0000.json"]["why"] == "killed: no final report"
    assert got["logs/learner/003-0000.json"]["why"] == "killed before its first report"
    assert got["logs/syncer/0000.json"]["why"] == "SIGTERM"
    assert got["logs/learner/000-0000.json"]["lines"] == [f"learner 0 0 line {i}" for i in range(25, 30)]
    done = {d["key"] for d in logship.died(store, reports, done=True)}
    # once the run is done, the newest incarnations without a final report (or log exit) died too
    assert done - set(got) == {
        "logs/learner/002-0000.json",
        "logs/learner/003-0001.json",
        "logs/syncer/0001.json",
    }
    md = "\n".join(deaths_markdown(list(got.values())))
    assert "learner 0 incarnation 0: killed: no final report (last 5 of 30 lines" in md
    assert "learner 0 0 line 29" in md and "<pre>learner 0 0 line 25" in deaths_html(list(got.values()))

    assert main(["logs", "--store", "memory://logship/run"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0].split()[:3] == ["KEY", "PROCESS", "LINES"] and len(listing) == 11
    assert "logs/syncer/0000.json" in listing[-2] and listing[-2].endswith("SIGTERM")
    assert (
        main(["logs", "--store", "memory://logship/run", "--role", "learner", "--id", "0", "--tail", "2"])
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("==> logs/learner/000-0000.json: learner 0 incarnation 0")
    assert out[1:3] == ["learner 0 0 line 28", "learner 0 0 line 29"]
    assert out[3].startswith("==> logs/learner/000-0001.json") and out[-1] == "learner 0 1 line 29"
    assert main(["logs", "--store", "memory://logship/run", "--role", "learner", "--id", "9"]) == 2
    assert "no logs match" in capsys.readouterr().err

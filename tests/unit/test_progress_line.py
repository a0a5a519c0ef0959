"""`ddiloco run`'s progress line says how fast tokens merge and when the budget will be reached (issue 52)."""

from __future__ import annotations

import dataclasses
from collections import deque

from ddiloco.cli.run import progress_printer, rate_and_eta
from ddiloco.tracking.progress import Progress
from tests._harness import status


def test_rate_over_the_last_minute_and_the_time_left():
    samples: deque = deque()
    assert rate_and_eta(samples, 0.0, 0, 1e6) == (None, None)  # one sample: no rate yet
    for t in range(1, 121):  # 1,000 tokens a second for the first minute, then 4,000
        merged = 1000 * min(t, 60) + 4000 * max(0, t - 60)
        rate, eta = rate_and_eta(samples, float(t), merged, 1e6)
    assert rate == 4000.0 and eta == (1e6 - 300_000) / 4000.0  # the last minute only
    assert len(samples) <= 62


def test_the_line_shows_tokens_per_second_and_eta(capsys):
    progress = progress_printer(1_000_000, tty=True)
    progress(Progress(None, 0.0, 5))  # before the syncer's first status
    for t, merged in ((0.0, 0), (10.0, 50_000), (20.0, 100_000)):
        progress(Progress(status(tokens_merged=merged, token_budget=1_000_000, live_learners=4), t, 5))
    line = capsys.readouterr().err.split("\r")[-1]
    assert "5.0k tok/s, ETA 3m00s" in line and "live learners 4" in line


def test_the_line_shows_processed_tokens_per_second_and_mfu_when_known(capsys):
    progress = progress_printer(1_000_000, tty=True)
    base = status(tokens_merged=0, token_budget=1_000_000, tokens_per_s=6100.0)
    progress(Progress(base, 1.0, 5))
    assert "| processed 6.1k tok/s |" in capsys.readouterr().err  # no peak known: no MFU
    progress(Progress(dataclasses.replace(base, mfu=0.4123), 2.0, 5))
    assert "processed 6.1k tok/s, MFU 41.2% |" in capsys.readouterr().err

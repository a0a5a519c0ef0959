"""Chaos: kill, stall, slow down and add learners, kill the syncer and cut the store, on a declared schedule.

`events` (the schedule as data), `runner` (one runner over a backend; `local`: the launcher's processes and
pids, `k8s`: pods; `victims`: what the pid and pod backends share), `inprocess` (what each process does to
itself: outages, a learner's own kills and slowdowns), `record` (what was done, one record type).
"""

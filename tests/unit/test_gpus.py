"""`ddiloco.platform.gpus`: each learner of a local run gets GPUs of its own (this machine has none: the CUDA device
count is patched, and what the launcher hands its processes is read off `subprocess.Popen`)."""

from __future__ import annotations

import logging

import pytest
import torch

from ddiloco import launch
from ddiloco.errors import ConfigError
from ddiloco.platform.gpus import GpuPlan, visible_gpus
from tests._harness import tiny_config


@pytest.fixture
def gpus(monkeypatch):
    def count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return count


def test_the_gpus_seen_are_the_variables_entries_up_to_an_invalid_one_else_the_device_count(gpus):
    gpus(8)
    assert visible_gpus({}) == [str(i) for i in range(8)]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5"}) == ["4", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": " GPU-1a2b , GPU-3c4d"}) == ["GPU-1a2b", "GPU-3c4d"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == ["0"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    gpus(0)  # a CPU machine whose environment names GPUs anyway
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}) == []


@pytest.mark.parametrize(
    ("count", "learners", "ranks", "expected"),
    [
        (8, 4, 1, ["0", "1", "2", "3"]),
        (4, 2, 2, ["0,1", "2,3"]),
        (2, 3, 1, ["0", "1", "0"]),  # more learners than GPUs: they share, in turn
        (3, 2, 2, ["0,1", "2,0"]),  # never two ranks of one learner on one GPU
        (1, 4, 1, ["0", "0", "0", "0"]),  # the one-GPU laptop: every learner on GPU 0
    ],
)
def test_each_learner_gets_its_ranks_gpus_in_turn(gpus, count, learners, ranks, expected):
    gpus(count)
    plan = GpuPlan.for_run("auto", learners, ranks, {})
    assert [plan.env(i)["CUDA_VISIBLE_DEVICES"] for i in range(learners)] == expected
    assert plan.env(None) == {}  # the syncer's environment is left as it is


def test_cpu_runs_and_machines_without_gpus_set_nothing(gpus):
    gpus(4)
    assert GpuPlan.for_run("cpu", 4, 2, {}).env(0) == {}
    gpus(0)
    assert GpuPlan.for_run("auto", 4, 8, {}).env(3) == {}


def test_ranks_that_would_share_a_gpu_and_cuda_without_one_are_config_errors(gpus):
    gpus(1)
    with pytest.raises(ConfigError, match=r"train.ranks=2 needs 2 GPUs per learner .* shows 1; lower"):
        GpuPlan.for_run("auto", 4, 2, {})
    gpus(0)
    with pytest.raises(ConfigError, match="train.device=cuda but no GPU is visible"):
        GpuPlan.for_run("cuda", 1, 1, {})


def test_the_launcher_starts_each_learner_with_its_gpus_and_logs_the_plan(
    gpus, monkeypatch, tmp_path, caplog
):
    gpus(4)
    started: dict[str, dict[str, str]] = {}

    class Popen:
        def __init__(self, argv, *, env, **_):
            name = argv[argv.index("--learner-id") + 1] if "--learner-id" in argv else "syncer"
            started[name], self.pid = env, 1

    monkeypatch.setattr(launch.subprocess, "Popen", Popen)
    cfg = tiny_config("gpus", "diloco.learners=3")
    with caplog.at_level(logging.INFO, logger="ddiloco.platform.gpus"):
        run = launch.LocalRun(cfg, tmp_path, extra_env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert "learners' GPUs: 0: 2, 1: 3, 2: 2 (3 learner ranks on 2 GPUs: learners share GPUs)" in caplog.text
    run.spawn(launch.Proc("syncer", None))
    for i in range(3):
        run.spawn(launch.Proc("learner", i))
    run.add_learner(5)  # a learner added mid-run gets GPUs by the same rule
    assert {k: e["CUDA_VISIBLE_DEVICES"] for k, e in started.items()} == {
        "syncer": "2,3", "0": "2", "1": "3", "2": "2", "5": "3"
    }  # fmt: skip


def test_a_learner_rank_beyond_the_hosts_gpus_is_refused_before_nccl(monkeypatch):
    """torchrun on a cluster node with fewer GPUs than ranks: one line that says what to change, not NCCL's
    duplicate-GPU failure after the rendezvous (the rank used to wrap onto GPU 0)."""
    from ddiloco.learner import ddp

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(ddp.dist, "init_process_group", lambda *a, **k: pytest.fail("joined the group"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="local rank 1 but this host shows 1 GPU.*lower train.ranks"):
        ddp.from_env("auto")


def test_a_run_whose_gpus_cannot_work_writes_nothing(gpus, tmp_path):
    gpus(0)
    with pytest.raises(ConfigError, match="no GPU is visible"):
        launch.LocalRun(tiny_config("no-gpu", "train.device=cuda"), tmp_path)
    assert list(tmp_path.iterdir()) == []  # no run key, no logs, no store

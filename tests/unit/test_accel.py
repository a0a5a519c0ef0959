"""ddiloco.learner.accel on CPU: the shared inner step against torch's AdamW, bf16 autocast tracking fp32, host
snapshots, torch.compile, optimizer-state placement; the GPU presets sized on the meta device."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from ddiloco import keys
from ddiloco.errors import ConfigError
from ddiloco.learner import accel
from ddiloco.learner.io import CheckpointWriter, snapshot_checkpoint
from ddiloco.learner.loop import Learner
from ddiloco.model.gpt import GPT, configure_optimizer, count_params, flops_per_token, gpt_config, init_model
from ddiloco.platform.devices import resolve_device
from ddiloco.run.prepare import prepare
from ddiloco.run.schedule import lr_at
from ddiloco.store.url import open_store
from tests._harness import tiny_config

V, T, B = 32, 16, 8


def _cfg():
    return gpt_config("tiny", vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=32)


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable sequences: arithmetic progressions mod V with a random start and a step in 1..3."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, V, (B, 1), generator=g)
        stride = torch.randint(1, 4, (B, 1), generator=g)
        seq = (start + stride * torch.arange(T + 1)) % V  # (B, T+1)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def _train(precision: str, steps: int) -> list[float]:
    model = init_model(_cfg(), seed=0)
    opt = configure_optimizer(model, 3e-3, 0.1)
    return [
        accel.train_step(model, opt, x, y, lr_at(i, 3e-3, 5), 1.0, precision=precision)
        for i, (x, y) in enumerate(_batches(steps))
    ]


def test_device_and_precision_resolution():
    cpu = torch.device("cpu")
    assert resolve_device("cpu") == cpu
    if not torch.cuda.is_available():
        assert resolve_device("auto") == cpu
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")
    assert accel.resolve_precision("auto", cpu) == "fp32"  # CPU stays fp32 unless asked
    assert accel.resolve_precision("bf16", cpu) == "bf16"
    assert accel.resolve_precision("fp32", cpu) == "fp32"
    with pytest.raises(ValueError, match="fp16"):
        accel.resolve_precision("fp16", cpu)
    assert lr_at(0, 1.0, 4) == 0.25 and lr_at(3, 1.0, 4) == lr_at(99, 1.0, 4) == 1.0


def test_train_step_is_one_adamw_step_and_never_reads_the_loss():
    model = init_model(_cfg(), seed=1)
    ref = copy.deepcopy(model)
    opt = configure_optimizer(model, 1e-2, 0.1)
    ref_opt = torch.optim.AdamW(
        [
            {"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.9, 0.95),
    )
    seen = []

    def before_update():  # grads are ready, parameters not yet updated
        seen.append(all(p.grad is not None for p in model.parameters()))
        torch.testing.assert_close(model.lm_head.weight, ref.lm_head.weight)

    for step, (x, y) in enumerate(_batches(3)):
        lr = lr_at(step, 1e-2, 2)
        loss = accel.train_step(model, opt, x, y, lr, 0.5, before_update=before_update)
        for g in ref_opt.param_groups:
            g["lr"] = lr
        logits = ref(x)[0]
        ref_loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        assert not loss.requires_grad and loss.dim() == 0
        torch.testing.assert_close(loss, ref_loss.detach())
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, msg=name)
    assert seen == [True, True, True]
    assert all(p.grad is None for p in model.parameters())


def test_bf16_autocast_on_cpu_runs_in_bf16_and_tracks_fp32():
    model = init_model(_cfg(), seed=0)
    dtypes = []
    model.lm_head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    x, y = _batches(1)[0]
    for precision in ("fp32", "bf16"):
        with accel.autocast(x.device, precision):
            _, loss = model(x, y)
        assert loss.dtype == torch.float32  # the loss is always computed in fp32
    assert dtypes == [torch.float32, torch.bfloat16]

    fp32, bf16 = _train("fp32", 60), _train("bf16", 60)
    assert fp32 != bf16  # really a different arithmetic
    assert fp32[-1] < fp32[0] - 1.0 and bf16[-1] < bf16[0] - 1.0  # both learn
    late = slice(-10, None)
    gap = abs(sum(fp32[late]) - sum(bf16[late])) / 10
    assert gap < 0.02 * sum(fp32[late]) / 10, (fp32[late], bf16[late])


def test_host_copier_on_cpu_snapshots_are_copies_unless_told_otherwise():
    copier = accel.HostCopier(torch.device("cpu"))
    a, tmp = torch.ones(3), torch.full((2,), 5.0)
    snap = copier.snapshot({"a": a})
    shared = copier.snapshot({"tmp": tmp}, copy=False)
    a.add_(1.0)
    copier.fence()  # nothing to wait for on CPU
    assert torch.equal(snap.wait()["a"], torch.ones(3))
    assert shared.wait()["tmp"].data_ptr() == tmp.data_ptr()  # a temporary is handed over as it is
    snap.release()
    shared.release()


def test_place_optimizer_steps_only_touches_fused_groups():
    p, q = torch.nn.Parameter(torch.randn(2, 2)), torch.nn.Parameter(torch.randn(2))
    fused = torch.optim.AdamW([p], fused=True)
    plain = torch.optim.AdamW([q])
    for opt, t in ((fused, p), (plain, q)):
        t.grad = torch.ones_like(t)
        opt.step()
        opt.state[t]["step"] = torch.tensor(7.0, dtype=torch.float64)  # as a restored checkpoint may leave it
    accel.place_optimizer_steps(fused)
    accel.place_optimizer_steps(plain)
    assert fused.state[p]["step"].dtype == torch.float32 and float(fused.state[p]["step"]) == 7.0
    assert plain.state[q]["step"].dtype == torch.float64


def test_compiled_model_shares_parameters_and_takes_the_same_step():
    model = init_model(_cfg(), seed=2)
    twin = copy.deepcopy(model)
    assert accel.maybe_compile(model, False) is model
    compiled = accel.maybe_compile(model, True, backend="eager")  # dynamo tracing without a C++ toolchain
    assert compiled is not model and {id(p) for p in compiled.parameters()} == {
        id(p) for p in model.parameters()
    }
    opt, twin_opt = configure_optimizer(model, 1e-2, 0.1), configure_optimizer(twin, 1e-2, 0.1)
    for x, y in _batches(2):
        a = accel.train_step(compiled, opt, x, y, 1e-2, 1.0)
        b = accel.train_step(twin, twin_opt, x, y, 1e-2, 1.0)
        torch.testing.assert_close(a, b)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_host_tensors_stay_put_on_cpu():
    t = torch.arange(4)
    cpu = torch.device("cpu")
    assert accel.to_device(t, cpu) is t
    assert accel.pin({"t": t}, cpu)["t"] is t


@pytest.mark.parametrize(("preset", "billions"), [("125m", 0.124), ("350m", 0.355), ("1b", 1.01)])
def test_gpu_presets_sized_on_the_meta_device(preset, billions):
    cfg = gpt_config(preset, vocab_size=50257, block_size=1024)
    with torch.device("meta"):  # no memory: only shapes
        model = GPT(cfg)
    n = model.num_params()
    assert n == count_params(cfg)
    # GPT-2 sizes count one (tied) token matrix; ours are untied, so leave the LM head out.
    assert n - cfg.vocab_size * cfg.n_embd == pytest.approx(billions * 1e9, rel=0.06)
    assert 6 * (n - 50257 * cfg.n_embd - 1024 * cfg.n_embd) < flops_per_token(cfg) < 8 * n


def test_learner_on_cpu_with_bf16_autocast():
    store = open_store("memory://accel-bf16")
    prepare(store, tiny_config("accel-bf16", "train.precision=bf16", "diloco.learners=1"))
    learner = Learner.open(store, 0)
    assert learner.precision == "bf16" and learner.device.type == "cpu" and learner.net is learner.model
    learner.start()
    losses = [learner.step() for _ in range(8)]
    assert all(isinstance(v, float) and v == v for v in losses)  # read every step on CPU, finite
    assert learner.ledger.tokens_processed == 8 * learner.loader.tokens_per_batch
    learner.close("max_steps")


class _DeferredPool:
    """Runs submitted jobs only when told to: lets the test interleave snapshots and writes."""

    def __init__(self) -> None:
        self.jobs = []

    def submit(self, fn, *args):
        self.jobs.append((fn, args))

    def run_all(self) -> None:
        while self.jobs:
            fn, args = self.jobs.pop(0)
            fn(*args)


def test_checkpoint_writer_writes_the_newest_waiting_snapshot_only():
    store = open_store("memory://accel-ckpt")
    prepare(store, tiny_config("accel-ckpt", "diloco.learners=1"))
    learner = Learner.open(store, 0)
    writer = CheckpointWriter(learner.root, 0)
    pool = _DeferredPool()
    copier = accel.HostCopier(torch.device("cpu"))
    for step in (1, 2, 3):  # the store is "slow": nothing is written until the pool runs
        learner.step()
        meta = {"run_id": learner.run_id, "cursor": learner.loader.state_dict(), "incarnation": 0}
        writer.submit(pool, step, snapshot_checkpoint(copier, learner.model, learner.opt), meta)
    assert len(pool.jobs) == 1  # one writer, which takes whatever snapshot is newest when it runs
    pool.run_all()
    assert store.get_json(keys.ckpt_latest_key(0))["inner_step"] == 3
    restored = Learner.open(store, 0)
    restored.start()
    assert restored.loader.state_dict() == learner.loader.state_dict()
    for name, p in restored.model.named_parameters():  # (start() then overwrote params with the globals)
        torch.testing.assert_close(
            restored.opt.state[p]["exp_avg"], learner.opt.state[learner.params[name]]["exp_avg"]
        )
    restored.close("max_steps")
    learner.close("max_steps")


def test_deferred_loss_reading_reports_the_same_curve_one_step_late():
    """The CUDA learner reads each step's loss after queuing the next step; forced on here, on CPU."""
    curves = []
    for defer in (False, True):
        store = open_store(f"memory://accel-defer-{defer}")
        prepare(store, tiny_config(f"accel-defer-{defer}", "diloco.learners=1"))
        learner = Learner.open(store, 0)
        learner._defer_loss = defer
        learner.start()
        curves.append([learner.step() for _ in range(5)])
        learner.close("max_steps")
        curves[-1].append(learner.loss)
    now, late = curves  # now: the five losses, then learner.loss; late: None, four losses, the fifth at exit
    assert len(set(now[:5])) == 5 and now[5] == now[4]
    assert late == [None, *now[:5]]

"""Publishing from reused memory: the out-of-place outer step is the in-place one bit for bit, a payload read
into lent memory verifies the same and is not copied, and a fragment hands its replaced buffers back."""

import torch

from ddiloco.protocol import signing, wire
from ddiloco.syncer.merge.bufferpool import BufferPool, Loan, carve
from ddiloco.syncer.merge.outer import OuterNesterov

KEY = signing.for_run(b"k" * 32, "r")  # the run "r"'s keys

SHAPES = {"a.weight": torch.Size([3, 70]), "b.bias": torch.Size([5]), "c": torch.Size([300, 2])}


def test_step_to_writes_what_step_on_copies_computes_bit_for_bit_and_leaves_its_inputs_alone():
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    ref, new = OuterNesterov(0.7, 0.9), OuterNesterov(0.7, 0.9)
    ref_p = {n: t.clone() for n, t in params.items()}
    cur_p = {n: t.clone() for n, t in params.items()}
    for k, scale in enumerate([1.0, 1.0, 0.6, 0.3]):  # the first step, then the buffer rescaled by the decay
        grad = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
        ref.step(ref_p, grad, lr_scale=scale)
        before = {n: t.clone() for n, t in cur_p.items()}
        out_p = {n: torch.full(s, float("nan")) for n, s in SHAPES.items()}  # whatever the lent memory held
        out_b = {n: torch.full(s, float("nan")) for n, s in SHAPES.items()}
        stepped = new.step_to(cur_p, grad, out_p, out_b, lr_scale=scale)
        assert all(torch.equal(cur_p[n], before[n]) for n in SHAPES), "inputs must not change"
        for n in SHAPES:
            assert torch.equal(out_p[n], ref_p[n]), (k, n)
            assert torch.equal(stepped.state_dict()[n], ref.state_dict()[n]), (k, n)
        assert stepped.lr_scale == ref.lr_scale
        new, cur_p = stepped, out_p


def test_a_payload_read_into_lent_memory_verifies_and_its_tensors_are_views_of_that_memory():
    g = torch.Generator().manual_seed(1)
    tensors = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    blob = wire.pack(tensors, {"run_id": "r", "kind": "global"}, key=KEY)
    loan = Loan(BufferPool())
    lent = loan(len(blob))[: len(blob)]
    lent[:] = blob
    got = wire.unpack(lent, expect={"run_id": "r"}, key=KEY, borrow=True)
    copied = wire.unpack(blob, expect={"run_id": "r"}, key=KEY)
    base = loan.taken[0]
    lo, hi = base.data_ptr(), base.data_ptr() + base.numel() * 4
    for n in SHAPES:
        assert torch.equal(got.tensors[n], copied.tensors[n])
        assert lo <= got.tensors[n].data_ptr() < hi  # no copy
    lent[-1] ^= 1  # the same checks as ever: a flipped bit is refused
    try:
        wire.unpack(lent, key=KEY, borrow=True)
    except wire.PayloadError as e:
        assert e.reason == "checksum"
    else:
        raise AssertionError("a corrupted payload verified")


def test_carve_lays_tensors_out_in_name_order_over_one_flat_buffer():
    flat = torch.arange(sum(s.numel() for s in SHAPES.values()), dtype=torch.float32)
    views = carve(flat, SHAPES)
    assert [n for n in views] == sorted(SHAPES)
    assert views["a.weight"].shape == SHAPES["a.weight"] and views["a.weight"].flatten()[0] == 0
    assert views["b.bias"].flatten()[0] == SHAPES["a.weight"].numel()
    views["c"].zero_()
    assert flat[-1] == 0  # views, not copies

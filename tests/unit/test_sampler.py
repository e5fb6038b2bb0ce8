"""ElasticDistributedSampler: deterministic order, disjoint shards, exact (resharded) resume.

Ranks are simulated in one process: each rank's sampler is built with its dp_rank/dp_size and the
group is stepped in lockstep, one micro-batch per rank per micro-step.
"""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from torchloom.data import DataError, ElasticDistributedSampler, build_dataloader
from torchloom.errors import TorchloomError


def make(dp, mb, gbs=None, n=96, **kw):
    return [
        ElasticDistributedSampler(n, dp_rank=r, dp_size=dp, micro_batch_size=mb, global_batch_size=gbs, **kw)
        for r in range(dp)
    ]


def run(samplers, micro_steps=None):
    """Global sample sequence of the next pass (or of ``micro_steps`` micro-steps); asserts the
    ranks stay in lockstep and agree on the state."""
    its = [iter(s) for s in samplers]
    mb, out = samplers[0].micro_batch_size, []
    for _ in range(micro_steps) if micro_steps is not None else itertools.count():
        chunks = [list(itertools.islice(it, mb)) for it in its]
        if not any(chunks):
            break
        assert all(len(c) == mb for c in chunks), chunks
        out += [i for c in chunks for i in c]
    states = [s.state_dict() for s in samplers]
    assert all(st == states[0] for st in states)
    return out


def reference(n, gbs, epochs, seed=0):
    """The uninterrupted global sequence of ``epochs`` (drop_last=True)."""
    length = n - n % gbs
    return [i for e in epochs for i in torch.randperm(n, generator=torch.Generator().manual_seed(seed + e))[:length].tolist()]


def test_order_is_pure_function_of_seed_and_epoch():
    a, b = make(1, 8, seed=3)[0], make(4, 2, gbs=8, seed=3)[0]
    for e in range(3):
        expect = torch.randperm(96, generator=torch.Generator().manual_seed(3 + e))
        assert torch.equal(a.global_order(e), expect) and torch.equal(b.global_order(e), expect)
    assert not torch.equal(a.global_order(0), a.global_order(1))
    assert not torch.equal(a.global_order(0), make(1, 8, seed=4)[0].global_order(0))
    # Iterating after set_epoch(e) gives the same sequence as a fresh sampler, whatever happened before.
    s = make(2, 4)
    run(s), run(s, 3)
    for x in s:
        x.set_epoch(2)
    fresh = make(2, 4)
    for x in fresh:
        x.set_epoch(2)
    assert run(s) == run(fresh) == reference(96, 8, [2])
    unshuffled = make(2, 4, shuffle=False)
    assert run(unshuffled) == list(range(96))


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_union_over_ranks_is_a_permutation(dp):
    samplers = make(dp, 3, gbs=24, n=100)
    per_rank = [list(s) for s in samplers]
    flat = [i for r in per_rank for i in r]
    assert len(flat) == len(set(flat)) == 96 == samplers[0].epoch_length  # 100 - 100 % 24
    assert all(len(r) == 96 // dp for r in per_rank)
    assert set(flat) <= set(range(100))
    assert set(flat) == set(torch.randperm(100, generator=torch.Generator().manual_seed(0))[:96].tolist())


def test_same_global_batches_for_any_dp_size():
    gbs, n = 16, 96
    layouts = [(1, 16), (2, 8), (4, 4), (8, 2), (2, 2), (4, 1)]  # last two accumulate 4x
    seqs = {layout: run(make(*layout, gbs=gbs, n=n)) for layout in layouts}
    ref = reference(n, gbs, [0])
    for layout, seq in seqs.items():
        assert seq == ref, layout
        batches = [set(seq[i : i + gbs]) for i in range(0, len(seq), gbs)]
        assert batches == [set(ref[i : i + gbs]) for i in range(0, n, gbs)]
    assert {s.epoch_length for layout in layouts for s in make(*layout, gbs=gbs, n=100)} == {96}


@pytest.mark.parametrize("new", [(4, 4), (2, 8), (8, 2), (2, 4), (8, 1)])
@pytest.mark.parametrize("style", ["set_epoch", "auto"])
def test_resume_continues_global_sequence_exactly(new, style):
    n, gbs = 100, 32  # 96 samples / epoch, 3 optimizer steps
    old = make(4, 4, gbs=gbs, n=n)  # step 16, 2 micro-steps per optimizer step
    seen = []
    for e in (0, 1):
        for s in old:
            s.set_epoch(e)
        seen += run(old, micro_steps=None if e == 0 else 3)  # interrupt mid optimizer step
    state = json.loads(json.dumps(old[0].state_dict()))
    assert state == {"epoch": 1, "consumed": 48, "seed": 0, "num_samples": n, "global_batch_size": gbs}

    resumed = make(*new, gbs=gbs, n=n)
    for s in resumed:
        s.load_state_dict(state)
    assert len(resumed[0]) == (96 - 48) // new[0]
    if style == "set_epoch":
        for e in (1, 2):
            for s in resumed:
                s.set_epoch(e)  # e == restored epoch keeps the position
            seen += run(resumed)
    else:
        seen += run(resumed) + run(resumed)  # rest of epoch 1, then rolls over to epoch 2
    assert seen == reference(n, gbs, [0, 1, 2])
    assert resumed[0].state_dict()["epoch"] == 2


def test_resume_at_epoch_end_rolls_over_or_stays_with_set_epoch():
    s = make(2, 4)
    run(s)
    state = s[0].state_dict()
    assert state["consumed"] == 96
    auto = make(4, 2)
    for x in auto:
        x.load_state_dict(state)
    assert run(auto) == reference(96, 8, [1])
    pinned = make(4, 2)
    for x in pinned:
        x.load_state_dict(state)
        x.set_epoch(0)
    assert len(pinned[0]) == 0 and run(pinned) == []


def test_misaligned_resume_is_a_clear_error():
    old = make(4, 2, gbs=32)  # step 8
    run(old, micro_steps=3)
    state = old[0].state_dict()
    assert state["consumed"] == 24
    new = make(8, 4, gbs=32)[0]  # step 32 does not divide 24
    with pytest.raises(DataError, match=r"consumed 24 samples.*not a multiple of dp_size\*micro_batch_size=8\*4=32") as ei:
        new.load_state_dict(state)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, TorchloomError)
    assert "micro_batch_size=3" in str(ei.value) or "micro_batch_size=1" in str(ei.value)
    make(8, 1, gbs=32)[0].load_state_dict(state)  # step 8 divides 24: fine


def test_changed_dataset_is_a_clear_error():
    state = make(2, 4)[0].state_dict()
    with pytest.raises(DataError, match="num_samples=96 but this sampler has num_samples=97"):
        make(2, 4, n=97)[0].load_state_dict(state)
    with pytest.raises(DataError, match="seed=0 but this sampler has seed=1"):
        make(2, 4, seed=1)[0].load_state_dict(state)
    with pytest.raises(DataError, match="missing"):
        make(2, 4)[0].load_state_dict({"epoch": 0})


def test_bad_arguments():
    with pytest.raises(DataError, match=r"global_batch_size=20 is not divisible by dp_size\*micro_batch_size=4\*2=8"):
        make(4, 2, gbs=20)
    with pytest.raises(DataError, match="dp_rank"):
        ElasticDistributedSampler(10, dp_rank=2, dp_size=2, micro_batch_size=1)
    with pytest.raises(DataError, match="drop_last=False"):
        make(2, 4, gbs=16, n=10)


def test_drop_last_false_pads_by_wrapping():
    samplers = make(2, 2, gbs=8, n=10, drop_last=False)
    assert samplers[0].epoch_length == 16 and len(samplers[0]) == 8
    seq = run(samplers)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0)).tolist()
    assert seq == perm + perm[:6]
    assert set(seq) == set(range(10))
    tiny = make(2, 4, gbs=8, n=3, drop_last=False)  # fewer samples than a batch: wraps repeatedly
    assert run(tiny) == [torch.randperm(3, generator=torch.Generator().manual_seed(0)).tolist()[i % 3] for i in range(8)]
    dropped = make(2, 2, gbs=8, n=10)
    assert dropped[0].epoch_length == 8 and run(dropped) == perm[:8]


def test_len_and_state_track_the_remaining_epoch():
    s = make(2, 4)  # 12 micro-steps of 8
    assert len(s[0]) == 48
    run(s, micro_steps=5)
    assert s[0].state_dict()["consumed"] == 40 and len(s[0]) == 28
    assert sorted(s[0].state_dict()) == sorted(["epoch", "consumed", "seed", "num_samples", "global_batch_size"])


def test_build_dataloader_batch_sizes_and_errors():
    dl = build_dataloader(list(range(64)), dp_rank=1, dp_size=2, global_batch_size=16, micro_batch_size=2)
    assert (dl.micro_batch_size, dl.global_batch_size, dl.grad_accum_steps, len(dl)) == (2, 16, 4, 16)
    dl = build_dataloader(list(range(64)), dp_rank=0, dp_size=4, global_batch_size=16)
    assert (dl.micro_batch_size, dl.grad_accum_steps) == (4, 1)
    with pytest.raises(DataError, match=r"global batch size 10 is not divisible by the data-parallel size 4.*8 or 12"):
        build_dataloader(list(range(64)), dp_rank=0, dp_size=4, global_batch_size=10)
    with pytest.raises(DataError, match=r"not divisible by data-parallel size x micro batch size = 2 x 3 = 6"):
        build_dataloader(list(range(64)), dp_rank=0, dp_size=2, global_batch_size=16, micro_batch_size=3)
    for bad in ({"sampler": None}, {"batch_sampler": None}, {"batch_size": 4}):
        with pytest.raises(DataError, match="not accepted"):
            build_dataloader(list(range(64)), dp_rank=0, dp_size=2, global_batch_size=8, **bad)


def test_set_epoch_after_restore_and_epoch_rollover():
    dl = build_dataloader(list(range(32)), dp_rank=0, dp_size=2, global_batch_size=8)
    assert dl.epoch == 0 and len(dl) == 4
    for i, _ in enumerate(dl):
        if i == 3:
            break
    assert dl.state_dict()["consumed"] == 32 and dl.epoch == 1 and len(dl) == 4  # rolls over next
    mid = {**dl.state_dict(), "consumed": 16}
    dl.load_state_dict(mid)
    with pytest.warns(UserWarning, match=r"discards the restored position \(epoch 0, consumed=16\)"):
        dl.set_epoch(1)
    assert dl.state_dict()["consumed"] == 0 and dl.epoch == 1
    dl.load_state_dict(mid)
    dl.set_epoch(0)  # the restored epoch: keeps the position
    assert len(dl) == 2 and len(list(dl)) == 2 and dl.epoch == 1


def test_resume_with_a_different_global_batch_keeps_the_order():
    old = make(4, 8, gbs=32, n=100)
    seen = run(old, micro_steps=2)
    new = make(2, 8, gbs=16, n=100)  # same 96-sample epoch, 64 consumed is a multiple of 16
    for s in new:
        s.load_state_dict(old[0].state_dict())
    assert seen + run(new) == reference(100, 32, [0])

"""``AccelerateResult.set_global_batch_size``: one seam that changes the global batch (a batch-size ramp, or a
checkpoint's global batch held on another number of ranks) in the sampler, the loader, ``train_step`` and the
result together, only at an optimizer-step boundary. In one process (the sampler's ranks simulated in lockstep)."""
from __future__ import annotations

import itertools

import pytest
import torch

import torchloom
from torchloom.data import DataError, ElasticDistributedSampler, build_dataloader


def _samplers(dp, mb, gbs, n=20, **kw):
    return [ElasticDistributedSampler(n, dp_rank=r, dp_size=dp, micro_batch_size=mb, global_batch_size=gbs, **kw)
            for r in range(dp)]


def _lockstep(its, mb, k=None):
    """The global samples of the next ``k`` micro-steps (all of the pass: None) of ranks iterated in lockstep."""
    out = []
    for _ in range(k) if k is not None else itertools.count():
        chunks = [list(itertools.islice(it, mb)) for it in its]
        if not any(chunks):
            break
        out += [i for c in chunks for i in c]
    return out


def test_sampler_global_batch_changes_mid_pass_keep_the_order_and_the_epoch_end():
    # 20 samples, dp 2 x micro 2, global 4 -> 8 after 8 samples (a multiple of 8): the epoch grows from 20 to 24
    # (padded by wrapping to a whole number of the new global batches); the order goes on unchanged
    ss = _samplers(2, 2, 4, shuffle=False, drop_last=False)
    its = [iter(s) for s in ss]
    first = _lockstep(its, 2, k=2)
    for s in ss:
        s.set_global_batch_size(8)
        assert (s.grad_accum_steps, s.epoch_length) == (2, 24)
    assert first + _lockstep(its, 2) == list(range(20)) + [0, 1, 2, 3]
    assert ss[0].state_dict()["global_batch_size"] == 8
    # shrinking (8 -> 4) mid-pass ends the pass at the shorter epoch: 20 samples, not 24
    ss = _samplers(1, 4, 8, shuffle=False, drop_last=False)
    it = iter(ss[0])
    head = list(itertools.islice(it, 8))
    ss[0].set_global_batch_size(4)
    assert head + list(it) == list(range(20))


def test_sampler_refuses_a_global_batch_that_does_not_fit():
    s = _samplers(2, 2, 4, n=20)[0]
    with pytest.raises(DataError, match=r"global_batch_size=6 is not divisible by dp_size\*micro_batch_size=2\*2=4"):
        s.set_global_batch_size(6)
    it = iter(s)
    list(itertools.islice(it, 2))  # one micro-step: 4 samples consumed of epoch 0
    with pytest.raises(DataError, match=r"4 samples of epoch 0 are consumed, not a multiple of 8"):
        s.set_global_batch_size(8)
    assert s.global_batch_size == 4  # unchanged
    with pytest.raises(DataError, match="drop_last=True with num_samples=20 < global_batch_size=24"):
        _samplers(2, 2, 4, n=20, drop_last=True)[0].set_global_batch_size(24)


def test_loader_follows_the_global_batch_in_both_modes():
    dl = build_dataloader(list(range(32)), dp_rank=0, dp_size=2, global_batch_size=8, micro_batch_size=2,
                          shuffle=False)
    assert (dl.grad_accum_steps, len(dl)) == (2, 8)
    it = iter(dl)
    got = [next(it).tolist() for _ in range(4)]  # one optimizer step of 2 micro-batches... and one more step
    dl.set_global_batch_size(16)
    got += [b.tolist() for b in it]
    assert (dl.grad_accum_steps, dl.global_batch_size) == (4, 16)
    assert got == [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 21], [24, 25], [28, 29]]  # rank 0's shard
    assert dl.state_dict()["global_batch_size"] == 16
    with pytest.raises(DataError, match=r"global_batch_size=10 is not divisible.*2\*2=4"):
        dl.set_global_batch_size(10)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(12))

    dl = build_dataloader(Stream(), dp_rank=0, dp_size=1, global_batch_size=2, micro_batch_size=2)
    dl.set_global_batch_size(6)
    assert (dl.global_batch_size, dl.grad_accum_steps) == (6, 3)
    with pytest.raises(DataError, match="global batch size 5 is not divisible by data-parallel size x micro batch"):
        dl.set_global_batch_size(5)


class _Reg(torch.nn.Module):
    """A linear model of rows ``[x0, x1, x2, y]`` (the 4th column is the target)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, rows):
        return self.lin(rows[:, :3]).squeeze(-1)


def _loss(rows, out):
    return ((out - rows[:, 3]) ** 2).mean()


def _result(rows, gbs, micro):
    torch.manual_seed(0)
    return torchloom.auto_accelerate(_Reg(), torch.optim.SGD, list(rows), _loss, [], optim_args={"lr": 0.1},
                                     dataloader_args={"batch_size": gbs, "micro_batch_size": micro,
                                                      "shuffle": False, "drop_last": True})


def test_result_set_global_batch_size_changes_loader_step_and_result_together():
    rows = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    res = _result(rows, gbs=4, micro=2)
    it = iter(res.dataloader)
    for _ in range(2):  # one optimizer step of global batch 4 (2 micro-batches): 4 samples consumed
        res.train_step(next(it))
    assert res.train_step.optimizer_steps == 1
    with pytest.raises(DataError, match="4 samples of epoch 0 are consumed, not a multiple of 8"):
        res.set_global_batch_size(8)  # the epoch's steps would no longer end with it: nothing changed
    assert (res.global_batch_size, res.train_step.grad_accum_steps, res.dataloader.grad_accum_steps) == (4, 2, 2)
    for _ in range(2):
        res.train_step(next(it))
    before = {k: v.detach().clone() for k, v in res.model.state_dict().items()}
    assert res.set_global_batch_size(8) == 4
    assert (res.global_batch_size, res.grad_accum_steps, res.dataloader.grad_accum_steps,
            res.train_step.grad_accum_steps, res.dataloader.sampler.global_batch_size) == (8, 4, 4, 4, 8)
    for k in range(4):  # the next optimizer step takes 4 micro-batches: samples 8..15
        res.train_step(next(it))
        assert res.train_step.optimizer_steps == (2 if k < 3 else 3)
    # the update is one SGD step on the mean loss over those 8 samples
    ref = _Reg()
    ref.load_state_dict(before)
    _loss(rows[8:16], ref(rows[8:16])).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(res.model.state_dict()[k], v, rtol=1e-6, atol=1e-7)
    assert res.dataloader.state_dict()["global_batch_size"] == 8  # what a checkpoint now records
    # refused inside a window (nothing changed), and for a size the micro-batch does not divide (sizes named)
    res.train_step(next(iter(res.dataloader)))
    with pytest.raises(ValueError, match="inside an accumulation window: 1 of its 4 micro-batches"):
        res.set_global_batch_size(4)
    with pytest.raises(ValueError, match="inside a window"):
        res.train_step.set_grad_accum_steps(2)
    assert (res.global_batch_size, res.train_step.grad_accum_steps, res.dataloader.global_batch_size) == (8, 4, 8)
    with pytest.raises(DataError, match=r"global batch size 7 is not divisible.*1 x 2 = 2; use a multiple of 2"):
        res.set_global_batch_size(7)


def test_train_step_set_grad_accum_steps_rebases_the_micro_step():
    res = _result(torch.randn(8, 4), gbs=4, micro=2)
    step = res.train_step
    step.micro_step = 6  # three windows of 2 done
    step.set_grad_accum_steps(3)
    assert (step.micro_step, step.grad_accum_steps) == (9, 3)
    with pytest.raises(ValueError, match="positive int"):
        step.set_grad_accum_steps(0)

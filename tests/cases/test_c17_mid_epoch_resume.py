"""C17 — mid-epoch resume [huggingface/accelerate 2016].

64 integer samples, shuffled, batch 4, 2 ranks; interrupt at epoch 1 step 5 and resume (also with
2 loader workers). Expected: the sample-id sequence across the interruption equals the
uninterrupted run's, across epoch boundaries. Ranks are simulated in one process.
"""
from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import IterableDataset

from torchloom.data import DataError, StatefulDataLoader, build_dataloader

EPOCHS, DP, MB = 3, 2, 4  # 64 samples / (2 ranks * 4) = 8 steps per epoch


def loaders(num_workers, **kw):
    return [
        build_dataloader(list(range(64)), dp_rank=r, dp_size=DP, micro_batch_size=MB, seed=1234, num_workers=num_workers, **kw)
        for r in range(DP)
    ]


def step(its):
    """One lockstep step: this step's sample ids per rank, or None at the end of the pass."""
    batches = [next(it, None) for it in its]
    if all(b is None for b in batches):
        return None
    assert all(b is not None for b in batches)
    return [b.tolist() for b in batches]


def uninterrupted():
    group, seq = loaders(0), []
    for epoch in range(EPOCHS):
        its = [iter(dl) for dl in group]
        while (ids := step(its)) is not None:
            seq.append((epoch, ids))
    return seq


def save(group):
    states = [dl.state_dict() for dl in group]
    assert all(s == states[0] for s in states)
    return json.dumps(states[0])  # what the checkpoint stores: plain data


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("style", ["set_epoch", "auto"])
@pytest.mark.parametrize("stop_step", [5, 7])  # 7 = last step of epoch 1
def test_mid_epoch_resume_matches_uninterrupted_run(num_workers, style, stop_step):
    seq, group = [], loaders(num_workers)
    for epoch in range(EPOCHS):  # first job: interrupted at epoch 1 after step `stop_step`
        if style == "set_epoch":
            for dl in group:
                dl.set_epoch(epoch)
        its, k = [iter(dl) for dl in group], 0
        while (ids := step(its)) is not None:
            seq.append((epoch, ids))
            if (epoch, k) == (1, stop_step):
                break
            k += 1
        else:
            continue
        break
    blob = save(group)
    assert json.loads(blob)["epoch"] == 1 and json.loads(blob)["consumed"] == (stop_step + 1) * DP * MB
    del group, its  # the job dies (workers with prefetched batches included)

    group = loaders(num_workers)  # second job
    state = json.loads(blob)
    for dl in group:
        dl.load_state_dict(state)
    epochs = range(state["epoch"], EPOCHS) if style == "set_epoch" else iter(lambda: group[0].epoch, EPOCHS)
    for epoch in epochs:  # auto: loader.epoch has already rolled over if the epoch was complete
        if style == "set_epoch":
            for dl in group:
                dl.set_epoch(epoch)  # the restored epoch keeps its position (empty if it was done)
        its = [iter(dl) for dl in group]
        while (ids := step(its)) is not None:
            seq.append((epoch, ids))
    assert seq == uninterrupted()
    assert len({i for _, ids in seq for r in ids for i in r}) == 64


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_break_and_continue_counts_only_yielded_batches(num_workers, persistent):
    group = loaders(num_workers, persistent_workers=persistent)
    its, seq = [iter(dl) for dl in group], []
    for _ in range(8 + 3):  # epoch 0, then 3 steps of epoch 1, workers have prefetched more
        if (ids := step(its)) is None:
            its = [iter(dl) for dl in group]
            ids = step(its)
        seq.append(ids)
    assert json.loads(save(group))["consumed"] == 3 * DP * MB
    del its
    for _ in range(2):  # a new iter() continues the same epoch, then the next one
        its = [iter(dl) for dl in group]
        while (ids := step(its)) is not None:
            seq.append(ids)
    assert [ids for _, ids in uninterrupted()] == seq


class Counting(IterableDataset):
    """Deterministic iterable of 0..n-1, reshuffled per epoch via set_epoch."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist())


def test_iterable_dataset_resume_skips_yielded_batches():
    def run(dl, passes):
        return [b.tolist() for _ in range(passes) for b in dl]

    ref = run(StatefulDataLoader(Counting(20), batch_size=4), 3)
    dl = StatefulDataLoader(Counting(20), batch_size=4)
    seen = run(dl, 1)
    for i, b in enumerate(dl):
        seen.append(b.tolist())
        if i == 1:
            break
    state = json.loads(json.dumps(dl.state_dict()))
    assert state == {"kind": "iterable", "epoch": 1, "batches_yielded": 2, "dp_size": 1, "micro_batch_size": 4}
    resumed = StatefulDataLoader(Counting(20), batch_size=4)
    resumed.load_state_dict(state)
    assert seen + run(resumed, 2) == ref
    with pytest.raises(DataError, match="ended after 5"):
        short = StatefulDataLoader(Counting(20), batch_size=4)
        short.load_state_dict({**state, "batches_yielded": 9})
        list(short)
    with pytest.raises(DataError, match="'iterable' data state into a 'map' loader"):
        loaders(0)[0].load_state_dict(state)

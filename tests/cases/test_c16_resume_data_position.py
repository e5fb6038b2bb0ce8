"""C16 — resume at a different world size: data position [pytorch/torchtitan 811].

Save the data position on 4 data-parallel ranks, resume on 2 and on 8. Expected: the global
sample order continues exactly (nothing skipped or repeated), or a clear error; never silent.
Ranks are simulated in one process (one loader per rank, stepped in lockstep).
"""
from __future__ import annotations

import json

import pytest
import torch

from torchloom.data import DataError, build_dataloader

N, GBS = 200, 32  # 192 samples per epoch = 6 optimizer steps


def loaders(dp, mb=None, n=N, seed=0):
    return [
        build_dataloader(list(range(n)), dp_rank=r, dp_size=dp, global_batch_size=GBS, micro_batch_size=mb, seed=seed)
        for r in range(dp)
    ]


def lockstep(group, micro_steps=None):
    """Global sample ids of the next pass (or its first ``micro_steps``), rank-major per micro-step."""
    its, out, k = [iter(dl) for dl in group], [], 0
    while micro_steps is None or k < micro_steps:
        batches = [next(it, None) for it in its]
        if all(b is None for b in batches):
            break
        assert all(b is not None and len(b) == group[0].micro_batch_size for b in batches)
        out += torch.cat(batches).tolist()
        k += 1
    return out


def checkpoint(group):
    states = [dl.state_dict() for dl in group]
    assert all(s == states[0] for s in states), "ranks disagree on the data position"
    return json.loads(json.dumps(states[0]))  # plain data


def reference(epochs):
    return [i for e in epochs for i in torch.randperm(N, generator=torch.Generator().manual_seed(e))[: N - N % GBS].tolist()]


def train_until_interrupt(micro_steps_in_epoch1, mb=None):
    group = loaders(4, mb)
    seen = lockstep(group)  # epoch 0
    seen += lockstep(group, micro_steps_in_epoch1)
    return seen, checkpoint(group)


@pytest.mark.parametrize("new_dp", [2, 8])
def test_resume_on_other_dp_size_continues_global_order(new_dp):
    seen, state = train_until_interrupt(3)  # dp 4 x mb 8: 3 optimizer steps into epoch 1
    assert (state["epoch"], state["consumed"]) == (1, 96)
    group = loaders(new_dp)
    for dl in group:
        dl.load_state_dict(state)
    assert len(group[0]) == (192 - 96) // GBS
    seen += lockstep(group) + lockstep(group)  # rest of epoch 1, all of epoch 2
    assert seen == reference([0, 1, 2])
    assert checkpoint(group)["epoch"] == 3


@pytest.mark.parametrize("new_dp,new_mb", [(2, 4), (2, 2), (8, 1)])
def test_resume_mid_accumulation_when_aligned(new_dp, new_mb):
    seen, state = train_until_interrupt(5, mb=2)  # dp 4 x mb 2, 4 micro-steps per step: mid-step
    assert state["consumed"] == 40
    group = loaders(new_dp, new_mb)
    for dl in group:
        dl.load_state_dict(state)
    seen += lockstep(group)
    assert seen == reference([0, 1])


def test_misaligned_resume_raises_instead_of_skipping():
    _, state = train_until_interrupt(5, mb=2)  # 40 samples consumed in epoch 1
    for dl in loaders(8):  # dp 8 x mb 4 = 32 per micro-step does not divide 40
        with pytest.raises(DataError, match=r"consumed 40 samples of epoch 1.*8\*4=32.*micro_batch_size=1"):
            dl.load_state_dict(state)


def test_changed_dataset_raises():
    _, state = train_until_interrupt(2)
    with pytest.raises(DataError, match="num_samples=200 but this sampler has num_samples=201"):
        loaders(2, n=201)[0].load_state_dict(state)
    with pytest.raises(DataError, match="seed=0 but this sampler has seed=7"):
        loaders(2, seed=7)[0].load_state_dict(state)

"""drop_last=False pads the last global batch of an epoch with repeated samples: one warning per loader (on
data-parallel rank 0, at its first pass) naming how many, never per epoch, none when nothing is repeated.
Ranks are simulated in one process (map-style loaders exchange nothing)."""
from __future__ import annotations

import warnings

import torch
from torch.utils.data import TensorDataset

import torchloom
from torchloom.data import ElasticDistributedSampler, PaddedEpochWarning, build_dataloader


def _data(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1))


def _epochs(loaders, epochs: int = 2) -> tuple[list[int], list[warnings.WarningMessage]]:
    """Every rank's samples over ``epochs`` passes, and every warning raised meanwhile (none filtered)."""
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(epochs):
            for loader in loaders:
                seen += [int(v) for (batch,) in loader for v in batch.flatten()]
    return seen, [w for w in caught if issubclass(w.category, PaddedEpochWarning)]


def test_a_padded_epoch_warns_once_naming_the_repeated_samples():
    loaders = [build_dataloader(_data(10), dp_rank=r, dp_size=4, global_batch_size=8, drop_last=False)
               for r in range(4)]
    seen, caught = _epochs(loaders)
    assert len(seen) == 2 * 16 and sorted(set(seen)) == list(range(10))  # 6 of 10 twice per epoch
    assert len(caught) == 1, [str(w.message) for w in caught]  # rank 0, first epoch only
    msg = str(caught[0].message)
    for part in ("padded with 6 repeated samples", "10 samples", "global batch 8", "drop_last=True",
                 "the last 2 samples", "torchloom.data.eval_loader"):
        assert part in msg, msg


def test_fewer_samples_than_a_global_batch_name_the_fix_that_works():
    sampler = ElasticDistributedSampler(3, dp_rank=0, dp_size=2, micro_batch_size=4, drop_last=False)
    _, caught = _epochs([torchloom.data.StatefulDataLoader(_data(3), sampler=sampler)], epochs=3)
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "padded with 5 repeated samples (3 samples, global batch 8" in msg and "smaller global batch" in msg
    assert "drop_last=True" in msg and "no batch at all" in msg


def test_nothing_repeated_nothing_said():
    for n, drop_last in ((16, False), (10, True)):
        loaders = [build_dataloader(_data(n), dp_rank=r, dp_size=4, global_batch_size=8, drop_last=drop_last)
                   for r in range(4)]
        assert _epochs(loaders)[1] == []


def test_auto_accelerate_dataloader_warns_once():
    res = torchloom.auto_accelerate(torch.nn.Linear(1, 1), torch.optim.SGD, _data(10), optim_args={"lr": 0.1},
                                    dataloader_args={"batch_size": 8, "drop_last": False})
    seen, caught = _epochs([res.dataloader], epochs=3)
    assert len(seen) == 3 * 16 and len(caught) == 1 and "6 repeated samples" in str(caught[0].message)

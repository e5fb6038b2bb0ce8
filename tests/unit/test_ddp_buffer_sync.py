"""The ``ddp`` method's buffer syncing on torch 2.13, whose DDP deprecates ``broadcast_buffers``: torchloom keeps
passing ``broadcast_buffers=False`` where it turns syncing off (``forward_sync_buffers=False`` would still broadcast
rank 0's buffers when DDP is built) and silences exactly that FutureWarning. One process, in this one."""
import warnings

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import torchloom


def _ddp(model: nn.Module) -> tuple[DistributedDataParallel, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = torchloom.auto_accelerate(model, torch.optim.SGD, loss_func=lambda b, o: o.sum(), strategy=["ddp"],
                                        optim_args={"lr": 0.1})
    ddp = next(m for m in res.model.modules() if isinstance(m, DistributedDataParallel))
    return ddp, [f"{w.category.__name__}: {w.message}" for w in seen]


def test_ddp_builds_without_the_broadcast_buffers_deprecation_and_keeps_its_behaviour():
    bn = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    ddp, seen = _ddp(bn)  # running statistics: averaged by sync_buffers, so DDP's broadcast is off
    assert not [s for s in seen if "broadcast_buffers" in s], seen
    assert ddp.forward_sync_buffers is False  # as broadcast_buffers=False: no forward sync (nor one at init)
    ddp, seen = _ddp(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)))  # no running statistics: broadcast on
    assert not [s for s in seen if "broadcast_buffers" in s], seen
    assert ddp.forward_sync_buffers is True

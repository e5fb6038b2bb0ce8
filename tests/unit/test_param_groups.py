"""Single-process checks of the parameter-group readers (issue [8] item 1): the mesh degrees with ``ep``
carved out of ``dp``, zero1's refusal, and :class:`ExpertGradReducer`'s arithmetic and once-per-step rule
(without a process group the edp sum is over one rank, so the result is ``grad / dp`` exactly: tolerance 0;
a reducer running twice would give ``grad / dp**2``, one that skipped ``grad``)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from torchloom.api import plan_dims
from torchloom.errors import StrategyError
from torchloom.parallel.expert.reduce import ExpertGradReducer, ddp_ignore_names, expert_tensor_ids
from torchloom.parallel.mesh import ParallelDims
from torchloom.parallel.param_groups import EXPERT, ParamGroups, param_groups_of
from torchloom.strategy.strategy import Strategy


@pytest.mark.parametrize("dp_method, dim", [("fsdp", "dp_shard"), ("ddp", "dp_replicate")])
def test_ep_is_carved_out_of_the_default_dp(dp_method, dim):
    dims = plan_dims([dp_method, "expert_parallel", ("parallel_mode", {"ep": 2})], 4)
    assert getattr(dims, dim) == 4 and dims.ep == 2 and dims.edp == 2 and dims.dp == 4


def test_ep_errors():
    with pytest.raises(StrategyError, match="does not divide the data-parallel degree"):
        plan_dims(["fsdp", "expert_parallel", ("parallel_mode", {"ep": 3})], 4)
    with pytest.raises(StrategyError, match="no method in the strategy parallelises the 'ep'"):
        plan_dims(["fsdp", ("parallel_mode", {"ep": 2})], 4)


def test_zero1_validate_refuses_ep():
    zero1 = next(m for m in Strategy.parse(["zero1"]).ordered() if type(m).name == "zero1")
    zero1.validate(None, ParallelDims(dp_replicate=4).resolve(4))  # ep=1: fine
    with pytest.raises(StrategyError, match="zero1 with ep=2.*overwrite the expert parameters.*fsdp"):
        zero1.validate(None, ParallelDims(dp_replicate=4, ep=2).resolve(4))


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = 2
        self.w = nn.Parameter(torch.ones(2, 3))

    def forward(self, x):
        return x @ self.w.t()


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(3, 3)
        self.experts = _Experts()

    def forward(self, x):
        return self.experts(self.dense(x)).sum()


def test_reducer_divides_by_dp_once_per_step():
    model = _Model()
    w = model.experts.w
    reducer = ExpertGradReducer([w], group=None, dp=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    reducer.attach([model], opt)
    model(torch.ones(1, 3)).backward()
    raw = w.grad.clone()
    reducer([])  # train_step's pre-step hook
    opt.step()  # the step pre-hook must not reduce again
    assert torch.equal(w.grad, raw / 4) and reducer.reductions == 1
    opt.step()  # no forward since: nothing new to reduce
    assert reducer.reductions == 1
    with torch.no_grad():  # an evaluation forward does not start a new step
        model(torch.ones(1, 3))
    opt.step()
    assert reducer.reductions == 1
    w.grad = None
    model(torch.ones(1, 3)).backward()
    opt.step()  # a plain loop: reduced in the step pre-hook
    assert reducer.reductions == 2 and torch.equal(w.grad, raw / 4)


def test_reducer_none_grad_counts_as_zero():
    model = _Model()
    reducer = ExpertGradReducer([model.experts.w], group=None, dp=2)
    assert reducer.reduce() and torch.equal(model.experts.w.grad, torch.zeros(2, 3))


def test_record_and_ddp_ignore_names():
    model = _Model()
    assert not param_groups_of(model).has_experts  # nothing attached: all dense
    groups = ParamGroups()
    groups.add(EXPERT, "experts", model.experts)
    model._torchloom_param_groups = groups
    assert param_groups_of(model).params("expert") == [model.experts.w]
    assert param_groups_of(model).group_of(model.dense).name == "dense"
    ids = expert_tensor_ids(groups.params("expert"), [model.experts])
    assert ddp_ignore_names(model, ids) == ["experts.w"]

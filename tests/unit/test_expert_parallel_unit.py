"""``expert_parallel``'s checks and the dispatch/shard mechanics in one process (a world of 1: ep=1 groups).

Numbers: the sharded module (dispatch, own forward on the local shard, combine) against the module's own
forward on the same inputs, outputs and gradients (hidden, router weights, parameters) at atol 1e-6
(fp32; only the order of the per-token sums differs). The multi-rank behaviour is tested in
tests/distributed/test_expert_parallel.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.models import tiny_llama, tiny_moe
from torchloom.errors import StrategyError
from torchloom.methods.expert_parallel import ExpertParallel, ExpertParallelConfig
from torchloom.parallel.mesh import ParallelDims, ParallelMesh
from torchloom.strategy.strategy import Strategy
from torchloom.testing.dist import free_port

ATOL = 1e-6


class _Info:  # the part of ModelInfo validate reads
    def __init__(self, module):
        self.module = module


def _method(**cfg) -> ExpertParallel:
    return ExpertParallel(ExpertParallelConfig(**cfg))


def test_experts_not_divisible_by_ep_names_e_ep_and_valid_degrees():
    with pytest.raises(StrategyError, match=r"num_experts=4, not divisible by ep=3.*\[1, 2, 4\]"):
        _method().validate(_Info(tiny_moe("mixtral")), ParallelDims(dp_replicate=6, ep=3))


def test_model_without_experts_is_refused_with_ep_above_one():
    with pytest.raises(StrategyError, match="has no experts module"):
        _method().validate(_Info(tiny_llama()), ParallelDims(dp_replicate=2, ep=2))
    _method().validate(_Info(tiny_llama()), ParallelDims(dp_replicate=2, ep=1))  # ep=1: nothing to check


def test_experts_cls_must_exist_and_follow_the_protocol():
    model = tiny_moe("qwen2_moe")
    with pytest.raises(StrategyError, match="not in the model"):
        _method(experts_cls=["MixtralExperts"]).validate(_Info(model), ParallelDims(dp_replicate=2, ep=2))
    with pytest.raises(StrategyError, match="is not an experts module"):
        _method(experts_cls=["Qwen2MoeMLP"]).validate(_Info(model), ParallelDims(dp_replicate=2, ep=2))
    found = _method(experts_cls=["Qwen2MoeExperts"]).experts_modules(model, 2)
    assert [q for q, _ in found] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_sequence_parallel_with_ep_is_not_supported_yet():
    m = _method()
    m.planning_strategy = Strategy.parse(["fsdp", ("tensor_parallel", {"size": 2}), "sequence_parallel",
                                          "expert_parallel"])
    with pytest.raises(StrategyError, match="sequence_parallel is not supported yet"):
        m.validate(_Info(tiny_moe("mixtral")), ParallelDims(dp_shard=2, tp=2, ep=2))
    m.validate(_Info(tiny_moe("mixtral")), ParallelDims(dp_shard=2, tp=2, ep=1))


def test_zero1_conflict_is_declared():
    with pytest.raises(StrategyError, match="expert parameters differ across the ep ranks"):
        Strategy.parse(["zero1", "expert_parallel"])


def test_ep_alias_and_registry():
    assert "expert_parallel" in Strategy.parse(["ddp", "ep"])


@pytest.fixture
def one_rank_mesh():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return ParallelMesh(ParallelDims().resolve(1), "cpu")


def _inputs(experts: int, tokens: int = 12, k: int = 2, hidden: int = 32, drop: bool = True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    if drop:
        idx[1, 0] = experts  # dropped choices (capacity): contribute nothing
        idx[5] = experts  # a token with none kept
    w = torch.rand(tokens, k, generator=g).requires_grad_(True)
    return x, idx, w


def _own_forward_reference(module, x, idx, w):
    """The module's own forward, dropped choices turned into weight-0 choices of expert 0 (same math)."""
    E = module.num_experts
    keep = idx < E
    return module(x, torch.where(keep, idx, 0), w * keep)


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_sharded_experts_equal_the_module_forward(one_rank_mesh, family, impl):
    """Hugging Face's experts implementations run unchanged on the local shard (``num_experts`` local)."""
    from torchloom.parallel.expert import shard_experts

    ref_mod = tiny_moe(family, experts_implementation=impl).model.layers[0].mlp.experts
    mod = tiny_moe(family, experts_implementation=impl).model.layers[0].mlp.experts
    assert mod.config._experts_implementation == impl
    x, idx, w = _inputs(ref_mod.num_experts)
    rx, rw = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    ref = _own_forward_reference(ref_mod, rx, idx, rw)
    ref.square().sum().backward()

    shard_experts(mod, one_rank_mesh)
    assert all(isinstance(p, DTensor) for p in mod.parameters())
    out = mod(x, idx, w)
    out.square().sum().backward()
    assert mod.num_experts == ref_mod.num_experts  # restored after the local forward
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(out[5], torch.zeros_like(out[5]))  # all choices dropped
    torch.testing.assert_close(x.grad, rx.grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(w.grad, rw.grad, atol=ATOL, rtol=0)
    for (n, p), (_, q) in zip(mod.named_parameters(), ref_mod.named_parameters()):
        torch.testing.assert_close(p.grad.to_local(), q.grad, atol=ATOL, rtol=0, msg=lambda m: f"{n}: {m}")
    with pytest.raises(StrategyError, match="already expert-parallel"):
        shard_experts(mod, one_rank_mesh)


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_no_kept_row_still_gives_zero_gradients(one_rank_mesh, impl):
    """C05 on one rank: every choice dropped, the experts compute nothing, yet each expert parameter gets a
    zero gradient (not None) and the graph still reaches the hidden states (the all-to-all's backward runs
    on every rank). HF's eager forward on zero rows returns ``zeros_like(hidden)``, cut from the graph: called
    as is, the parameters' and the hidden states' gradients were None."""
    from torchloom.parallel.expert import shard_experts

    mod = tiny_moe("mixtral", experts_implementation=impl).model.layers[0].mlp.experts
    shard_experts(mod, one_rank_mesh)
    x, idx, w = _inputs(mod.num_experts)
    out = mod(x, torch.full_like(idx, mod.num_experts), w)
    assert torch.count_nonzero(out) == 0
    out.sum().backward()
    assert x.grad is not None and torch.count_nonzero(x.grad) == 0
    for p in mod.parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad.to_local()) == 0


def test_out_of_range_expert_index_is_an_error(one_rank_mesh):
    from torchloom.parallel.expert import AllToAllDispatcher

    d = AllToAllDispatcher(4, one_rank_mesh["ep"].get_group())
    with pytest.raises(ValueError, match=r"expert indices must lie in \[0, 4\].*\[5\]"):
        d.dispatch(torch.zeros(2, 8), torch.tensor([[0, 5], [1, 2]]))


def test_tensor_parallel_experts_are_refused(one_rank_mesh):
    from torch.distributed.tensor import Shard

    from torchloom.parallel.expert import shard_experts

    mod = tiny_moe("mixtral").model.layers[0].mlp.experts
    mod.down_proj = torch.nn.Parameter(DTensor.from_local(mod.down_proj.detach(), one_rank_mesh["dp"], [Shard(2)]))
    with pytest.raises(StrategyError, match="tp and ep at once is not supported yet"):
        shard_experts(mod, one_rank_mesh)


def test_alltoall_time_counter(one_rank_mesh):
    from torchloom.parallel.expert import AllToAllDispatcher, alltoall_seconds, reset_alltoall_seconds

    reset_alltoall_seconds()
    assert alltoall_seconds() == 0.0
    d = AllToAllDispatcher(4, one_rank_mesh["ep"].get_group())
    x, idx, w = _inputs(4, drop=False)
    y, local, routing = d.dispatch(x, idx)
    d.combine(y, routing, w).sum().backward()
    assert alltoall_seconds() > 0.0


def test_tensor_parallel_plan_splitting_experts_is_refused_at_validate():
    model = tiny_moe("mixtral")
    dims = ParallelDims(dp_shard=2, tp=2, ep=2)
    m = _method()
    m.planning_strategy = Strategy.parse(["fsdp", ("tensor_parallel", {"size": 2}), "expert_parallel"])
    with pytest.raises(StrategyError, match=r"splits the experts modules.*'moe_experts'"):
        m.validate(_Info(model), dims)
    plan = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
            "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
    m.planning_strategy = Strategy.parse(["fsdp", ("tensor_parallel", {"size": 2, "plan": plan}), "expert_parallel"])
    m.validate(_Info(model), dims)  # experts left whole by the plan: composes

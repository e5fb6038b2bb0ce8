"""Place an experts module (``torchloom.moe.protocol``) across the expert-parallel ranks.

:func:`shard_experts` turns each direct parameter ``[E, ...]`` into a DTensor ``Shard(0)`` on ``mesh["ep"]``
(this rank keeps its ``E / ep`` rows; the DTensor still describes the whole tensor, so checkpoints keep the
unsharded layout and reshard to another ``ep``) and replaces the instance's ``forward``: tokens are dispatched
to the ranks holding their experts (:mod:`~torchloom.parallel.expert.dispatch`), the module's *own* forward
runs on the received rows with the local shards swapped in, and the outputs are combined at the source. So
any implementation of the experts math (Hugging Face's ``eager``/``grouped_mm``/``batched_mm``,
``torchloom.moe.GroupedExperts``) works unchanged.

While the own forward runs, the module sees a local world: parameters are the local ``[E_local, ...]``
tensors, ``num_experts`` is ``E_local``, indices are local ``[N, 1]`` in ``[0, E_local)`` and the weights are
ones (the router weights are applied at the source, where their gradient belongs). Module names and the
instance's class are unchanged; FSDP's hooks (``fully_shard`` over ``edp`` later) still run around the
patched forward, and activation checkpointing recomputes the dispatch with the same routing.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ...errors import StrategyError
from .dispatch import AllToAllDispatcher


def shard_experts(module: nn.Module, mesh) -> AllToAllDispatcher:
    """Shard ``module``'s experts over ``mesh["ep"]`` in place and make its forward expert-parallel.

    Args:
        module: an experts module (``num_experts``; direct parameters fused over experts, dim 0 = ``E``;
            ``forward(hidden [T, H], top_k_index [T, k] int64, top_k_weights [T, k]) -> [T, H]``, index ``E`` =
            dropped). Real or meta parameters.
        mesh: the :class:`~torchloom.parallel.mesh.ParallelMesh` (its ``ep`` view; building it is collective).

    Returns:
        The module's :class:`~torchloom.parallel.expert.dispatch.AllToAllDispatcher` (also ``module._ep_dispatcher``).

    Raises:
        StrategyError: ``num_experts`` not divisible by ``ep``; a parameter already a DTensor (e.g. split by
            ``tensor_parallel``'s ``moe_experts`` style: experts cannot be split over tp and ep at once yet);
            the module is already expert-parallel.
    """
    if getattr(module, "_ep_dispatcher", None) is not None:
        raise StrategyError(f"{type(module).__name__} is already expert-parallel (shard_experts ran on it twice).")
    ep_mesh = mesh["ep"]
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    E = int(module.num_experts)
    if E % ep:
        raise StrategyError(f"expert_parallel: {type(module).__name__} has num_experts={E}, not divisible by "
                            f"ep={ep}; choose ep among {[d for d in range(1, E + 1) if E % d == 0]}.")
    local_e = E // ep
    for name, p in list(module.named_parameters(recurse=False)):
        if isinstance(p, DTensor):
            raise StrategyError(
                f"expert_parallel: {type(module).__name__}.{name} is already a DTensor on {p.device_mesh} "
                f"({p.placements}), e.g. split inside each expert by tensor_parallel's 'moe_experts' style; splitting "
                "experts over tp and ep at once is not supported yet. Leave the experts out of the tensor-parallel "
                "plan or use ep=1.")
        local = p.detach()[rank * local_e:(rank + 1) * local_e].clone()
        dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
        module._parameters[name] = nn.Parameter(dt, requires_grad=p.requires_grad)
    dispatcher = AllToAllDispatcher(E, ep_mesh.get_group())
    inner = module.forward

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        x, local_index, routing = dispatcher.dispatch(hidden_states, top_k_index)
        with local_experts(module, local_e) as params:
            if x.shape[0]:
                y = inner(x, local_index.unsqueeze(1), x.new_ones((x.shape[0], 1), dtype=top_k_weights.dtype))
            else:  # nothing to compute; keep the graph so this rank joins the backward all-to-all
                y = x * 0
            if torch.is_grad_enabled() and (not x.shape[0] or y.grad_fn is None):
                # idle rank (case C05): zero gradients for its experts instead of None, so every rank reduces
                # the same tensors (a rank with tokens gets full-shape gradients from the experts math)
                y = y + sum((p.reshape(-1)[:1].sum() * 0 for p in params if p.requires_grad), y.new_zeros(()))
        return dispatcher.combine(y, routing, top_k_weights, out_dtype=hidden_states.dtype)

    module.forward = forward
    module._ep_dispatcher = dispatcher
    return dispatcher


@contextlib.contextmanager
def local_experts(module: nn.Module, local_e: int):
    """Let ``module``'s own forward see its local world: each DTensor parameter replaced by its local shard
    (``to_local`` is differentiable: the gradient lands on the DTensor parameter) and ``num_experts`` set to
    ``local_e``; both restored afterwards. Yields the local tensors."""
    saved = dict(module._parameters)
    saved_e = module.num_experts
    try:
        params = []
        for n, p in saved.items():
            if p is None:
                continue
            if isinstance(p, DTensor):
                module._parameters[n] = p.to_local()
            params.append(module._parameters[n])
        module.num_experts = local_e
        yield params
    finally:
        module._parameters.update(saved)
        module.num_experts = saved_e

"""Tensor parallelism inside every expert of a Hugging Face stacked-experts module (Mixtral, Qwen-MoE style:
``gate_up_proj`` ``(experts, 2 * intermediate, hidden)`` packed ``[gate; up]``, ``down_proj``
``(experts, hidden, intermediate)``).

Each expert is an MLP, so it is split like one (Megatron): gate and up column-wise, down row-wise, on
every expert at once. ``gate_up_proj`` holds ``[gate | up]`` on dim 1, so it is sharded with
``_StridedShard(1, split_factor=2)``: each rank holds ``[gate_r; up_r]`` and the model's own
``chunk(2)`` splits it correctly; the DTensor still represents the original weight (checkpoints keep
the unsharded layout). ``down_proj`` is ``Shard(2)``.

The module's own forward (any ``config._experts_implementation``) runs on the local shards: the router's
outputs (``top_k_weights``) and the hidden states enter the tp region (gradients summed over tp ranks,
since each rank's partial output depends on them) and the partial expert outputs are all-reduced at the
end. The router itself stays replicated: every tp rank routes identically.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from ...errors import StrategyError
from .conv1d import shard_parameter
from .regions import enter_tp_region, leave_tp_region


def is_stacked_experts(module: nn.Module) -> bool:
    """A module holding 3-D ``gate_up_proj`` and ``down_proj`` parameters (transformers' MoE experts)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3


def expert_intermediate_size(module: nn.Module) -> int:
    """Per-expert intermediate size (what the tp ranks split)."""
    return module.down_proj.shape[2]


@contextlib.contextmanager
def _local_parameters(module: nn.Module, names: tuple[str, ...]):
    """Let the module's forward see the local shards of its DTensor parameters (differentiably:
    ``to_local`` passes the gradient back to the DTensor parameter), and restore them afterwards."""
    saved = {n: module._parameters[n] for n in names}
    try:
        for n in names:
            module._parameters[n] = saved[n].to_local()
        yield
    finally:
        module._parameters.update(saved)


class StackedExpertsParallel(ParallelStyle):
    """Column-wise gate/up and row-wise down projections of every expert (see the module docstring).

    The experts' ``forward(hidden_states (tokens, hidden), top_k_index (tokens, k), top_k_weights (tokens, k))``
    keeps its signature; its output ``(tokens, hidden)`` is replicated over the tp ranks.

    Raises:
        StrategyError: the module stores transposed or interleaved weights, or has biases (layouts this
            split does not cover).
    """

    names = ("gate_up_proj", "down_proj")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        unsupported = [a for a, bad in (("is_transposed", True), ("is_concatenated", False), ("has_bias", True))
                       if getattr(module, a, not bad) == bad]
        if unsupported:
            raise StrategyError(
                f"tensor_parallel: the experts module {type(module).__name__} has {unsupported}; the 'moe_experts' "
                "style shards concatenated [gate; up] weights of shape (experts, 2*intermediate, hidden) without "
                "biases. Leave this module out of the plan (its experts stay replicated)."
            )
        shard_parameter(module, "gate_up_proj", device_mesh, _StridedShard(1, split_factor=2), self.src_data_rank)
        shard_parameter(module, "down_proj", device_mesh, Shard(2), self.src_data_rank)
        inner = module.forward

        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
            hidden_states = enter_tp_region(hidden_states, device_mesh)
            top_k_weights = enter_tp_region(top_k_weights, device_mesh)
            with _local_parameters(module, self.names):
                partial_out = inner(hidden_states, top_k_index, top_k_weights)
            return leave_tp_region(partial_out, device_mesh)

        module.forward = forward
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

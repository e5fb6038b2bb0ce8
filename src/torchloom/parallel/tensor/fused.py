"""Column-wise sharding of a *fused* projection whose output concatenates equal blocks, e.g. GPT-2's
``c_attn`` = ``[q | k | v]`` along the output features.

A plain ``Shard`` on the output dimension would give rank 0 all of q and part of k. Instead each block is
split over the tp ranks and every rank holds ``[q_r | k_r | v_r]``: the DTensor placement
``_StridedShard(out_dim, split_factor=blocks)``. The parameter still *represents the original weight*:
``full_tensor()``, ``get_model_state_dict(full_state_dict=True)`` and DCP checkpoints keep the unsharded
layout, so checkpoints load into models with or without tensor parallelism.

The bias stays a replicated DTensor and each forward takes this rank's ``[q_r | k_r | v_r]`` slice of it
(``redistribute`` to the strided placement: no communication; its backward all-gathers the gradient). A
strided-sharded 1-D bias would share dim 0 with FSDP's shard dim, a 2-D layout DTensor cannot gather back
for checkpoints; the bias is tiny. For the same reason an ``nn.Linear`` fused weight (output dim 0) cannot
combine with fsdp; ``Conv1D`` (output dim 1) can.

The forward runs on the local shards (``enter_tp_region`` all-reduces the input gradient, as column-wise
parallelism does); the output is this rank's ``[q_r | k_r | v_r]``, so the attention module must split it
into local widths (GPT-2: ``split_size`` divided by tp; the plan does that).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from .conv1d import is_conv1d, shard_parameter
from .regions import enter_tp_region


class FusedColwiseParallel(ParallelStyle):
    """Column-wise parallel ``nn.Linear`` or ``Conv1D`` whose output is ``blocks`` equal concatenated parts.

    Args:
        blocks: number of concatenated parts (3 for q, k, v).

    Input: a replicated tensor (plain or DTensor) ``(..., in_features)``. Output: plain tensor
    ``(..., out_features / tp)`` holding this rank's slice of every block, in block order.
    """

    def __init__(self, blocks: int = 3):
        super().__init__()
        self.blocks = blocks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        conv = is_conv1d(module)
        out_dim = 1 if conv else 0  # Conv1D weight is (in, out); Linear weight is (out, in)
        shard_parameter(module, "weight", device_mesh, _StridedShard(out_dim, split_factor=self.blocks),
                        self.src_data_rank)
        shard_parameter(module, "bias", device_mesh, Replicate(), self.src_data_rank)
        bias_slice = [_StridedShard(0, split_factor=self.blocks)]

        def forward(x: torch.Tensor) -> torch.Tensor:
            x = enter_tp_region(x, device_mesh)
            weight = module.weight.to_local()
            bias = module.bias.redistribute(device_mesh, bias_slice).to_local() if module.bias is not None else None
            if conv:
                flat = x.reshape(-1, x.size(-1))
                out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
                return out.view(*x.shape[:-1], weight.size(1))
            return F.linear(x, weight, bias)

        module.forward = forward  # instance attribute: module names and state-dict keys do not change
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(blocks={self.blocks})"

"""Column-/row-wise styles for Hugging Face's ``Conv1D`` (GPT-2, GPT-J-style models): a linear layer that
stores its weight transposed, ``(in_features, out_features)``, and computes ``addmm(bias, x, weight)``.

PyTorch's ``ColwiseParallel``/``RowwiseParallel`` shard ``nn.Linear`` weights, whose output dimension is
dim 0; here it is dim 1. Only the partition function changes: inputs, outputs and the forward (run on
DTensor parameters, so ``Conv1D.forward`` works unchanged with its global ``nf``) stay PyTorch's.
"""
from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


def is_conv1d(module: nn.Module) -> bool:
    """True for ``transformers.pytorch_utils.Conv1D`` (matched by name: transformers stays optional)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def shard_parameter(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement, src_data_rank) -> None:
    """Replace ``module.<name>`` by a DTensor parameter distributed from ``src_data_rank`` (rank 0 of the
    mesh by default, so every tp rank starts from the same values)."""
    param = getattr(module, name, None)
    if param is None:
        return
    dist_param = nn.Parameter(distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank),
                              requires_grad=param.requires_grad)
    module.register_parameter(name, dist_param)


class Conv1DColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for ``Conv1D``: weight ``Shard(1)``, bias ``Shard(0)`` (output features split)."""

    def _partition_conv1d_fn(self, name, module, device_mesh):
        shard_parameter(module, "weight", device_mesh, Shard(1), self.src_data_rank)
        shard_parameter(module, "bias", device_mesh, Shard(0), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh, self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for ``Conv1D``: weight ``Shard(0)`` (input features split), bias replicated."""

    def _partition_conv1d_fn(self, name, module, device_mesh):
        shard_parameter(module, "weight", device_mesh, Shard(0), self.src_data_rank)
        shard_parameter(module, "bias", device_mesh, Replicate(), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )

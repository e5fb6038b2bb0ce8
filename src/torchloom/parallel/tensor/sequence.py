"""Sequence-parallel boundaries (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models"): between blocks the residual stream is a DTensor sharded on the sequence dim
(``Shard(1)``); attention and MLP need the whole sequence, so their input is all-gathered (and in backward
the gradient reduce-scattered).

PyTorch's ``PrepareModuleInput`` needs to know whether the hidden states arrive positionally or as a
keyword; Hugging Face decoder layers call ``self_attn(hidden_states=...)`` but ``mlp(hidden_states)``.
:class:`SequenceGather` handles both: the first positional argument, else the ``hidden_states`` keyword.
Other arguments (rotary ``position_embeddings``, masks, caches) pass through untouched.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle


class SequenceGather(ParallelStyle):
    """All-gather a module's sequence-sharded hidden states (``Shard(1)`` DTensor -> ``Replicate``).

    Args:
        local_input: hand the module a plain tensor (for modules that mix the input with plain parameters,
            e.g. a replicated MoE router); else a replicated DTensor, which column-wise layers take directly
            so the backward is one reduce-scatter instead of an all-reduce.
        scatter_output: the module returns a replicated plain tensor (e.g. all-reduced MoE experts): turn it
            back into the sequence-sharded DTensor stream.

    Raises (at forward):
        TypeError: the hidden states are not a DTensor: the module sits outside the sequence-parallel
            stream (the plan's embedding must use a sequence-parallel output).
    """

    def __init__(self, *, local_input: bool = False, scatter_output: bool = False):
        super().__init__()
        self.local_input = local_input
        self.scatter_output = scatter_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather_input(mod, args: tuple, kwargs: dict[str, Any]):
            if args:
                return (self._gather(mod, args[0], device_mesh), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": self._gather(mod, kwargs["hidden_states"], device_mesh)}
            raise TypeError(f"{type(mod).__name__} was called without positional input or `hidden_states` keyword; "
                            "sequence parallelism cannot find the hidden states to gather.")

        module.register_forward_pre_hook(gather_input, with_kwargs=True)
        if self.scatter_output:
            module.register_forward_hook(lambda mod, args, out: self._scatter(out, device_mesh))
        return module

    def _gather(self, mod: nn.Module, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if not isinstance(x, DTensor):
            raise TypeError(
                f"sequence parallelism: {type(mod).__name__} received a plain tensor, not the sequence-sharded "
                "DTensor stream; give the embedding the 'vocab_embedding' (or 'embedding_colwise') style and the "
                "norms 'sequence_parallel' so the stream between blocks is sharded on the sequence dim."
            )
        x = x.redistribute(mesh, [Replicate()])
        return x.to_local() if self.local_input else x

    @staticmethod
    def _scatter(out: Any, mesh: DeviceMesh) -> Any:
        def scatter(t: torch.Tensor) -> DTensor:
            return DTensor.from_local(t, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])

        if isinstance(out, tuple):
            return (scatter(out[0]), *out[1:])
        return scatter(out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(local_input={self.local_input}, scatter_output={self.scatter_output})"

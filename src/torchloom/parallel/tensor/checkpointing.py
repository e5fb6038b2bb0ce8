"""Distributed-checkpoint (DCP) support for DTensors whose local shard is several blocks of the global
tensor: the ``_StridedShard`` layouts of fused q/k/v projections (``[q_r | k_r | v_r]``) and packed MoE
``[gate_r; up_r]`` weights.

DCP describes each rank's data as one contiguous block (offsets + sizes); for these layouts torch 2.13
reports "overlapping chunks" and refuses to save. DCP lets a DTensor's local tensor describe itself
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``: the protocol
``torch.distributed.checkpoint`` uses for DTensor and ShardedTensor). :func:`describe_blocks` attaches that
description to the local tensors in a state dict: one write item per contiguous block, so checkpoints keep
the original layout and reshard into runs with any (or no) tensor parallelism. State-dict post-hooks on
the parameters' modules and on the optimizer attach it to every state dict DCP sees.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

Block = tuple[torch.Size, torch.Size, tuple[slice, ...]]  # global offsets, sizes, slices of the local tensor


def local_blocks(dt: DTensor) -> list[Block]:
    """The contiguous blocks of the global tensor that make up this rank's local tensor.

    Each dimension's local positions are the global indices that survive the placements acting on it,
    applied in mesh order exactly as ``distribute_tensor`` splits (``_split_tensor``); runs of consecutive
    indices become block edges, and the blocks are their Cartesian product.
    """
    coord = dt.device_mesh.get_coordinate()
    runs_per_dim = []
    for d, n in enumerate(dt.shape):
        idx = torch.arange(n)
        for mesh_dim, p in enumerate(dt.placements):
            if isinstance(p, (Shard, _StridedShard)) and p.dim % dt.ndim == d:
                along = _StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(0)
                pieces, _ = along._split_tensor(idx, dt.device_mesh.size(mesh_dim), with_padding=False)
                idx = pieces[coord[mesh_dim]] if coord[mesh_dim] < len(pieces) else idx[:0]
        runs_per_dim.append(_runs(idx.tolist()))
    return [(torch.Size(r[0] for r in combo), torch.Size(r[1] for r in combo),
             tuple(slice(r[2], r[2] + r[1]) for r in combo)) for combo in itertools.product(*runs_per_dim)]


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive global indices: (global start, length, local start)."""
    runs: list[tuple[int, int, int]] = []
    for local, g in enumerate(indices):
        if runs and runs[-1][0] + runs[-1][1] == g:
            start, length, lstart = runs[-1]
            runs[-1] = (start, length + 1, lstart)
        else:
            runs.append((g, 1, local))
    return runs


def describe_blocks(value: Any) -> None:
    """Attach the DCP block description to every multi-block DTensor in a (nested) state dict, in place."""
    if isinstance(value, dict):
        for v in value.values():
            describe_blocks(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            describe_blocks(v)
    elif isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements):
        blocks = local_blocks(value)
        if len(blocks) > 1:
            _attach(value, blocks)


def _attach(dt: DTensor, blocks: list[Block]) -> None:
    local = dt._local_tensor  # DTensor's DCP methods delegate to its local tensor when it has them
    chunks = [ChunkStorageMetadata(offsets=o, sizes=s) for o, s, _ in blocks]
    by_offset = {o: sl for o, _, sl in blocks}

    def create_write_items(fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=TensorProperties.create_from_tensor(local),
                                                      size=dt.size()))
                for c in chunks]

    def get_tensor_shard(index: MetadataIndex) -> torch.Tensor:
        return local[by_offset[torch.Size(index.offset)]]  # a view: loading writes into the parameter

    local.__create_write_items__ = create_write_items
    local.__create_chunk_list__ = lambda: list(chunks)
    local.__get_tensor_shard__ = get_tensor_shard


def install_model_hook(module: nn.Module) -> None:
    """Describe ``module``'s multi-block DTensors in every state dict that holds them (what DCP saves and
    loads into).

    The post-hooks go on the submodules that own parameters, not on ``module``: other module trees hold the
    same submodules (``PipelinedModel`` merges a rank's pipeline stages into one tree under the original
    names), and ``state_dict()`` runs the hooks of every module it recurses through, whichever root it started
    from. A hook on the root alone would never run for them. Installing twice is harmless (one hook per module).
    """
    for sub in module.modules():
        if sub._parameters and not getattr(sub, _HOOKED, False):
            sub.register_state_dict_post_hook(_describe_own_entries)
            setattr(sub, _HOOKED, True)


_HOOKED = "_torchloom_dcp_blocks_hook"


def _describe_own_entries(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for name in module._parameters:  # only this module's entries: the hook runs once per module
        describe_blocks(state_dict.get(prefix + name))


def install_optimizer_hook(optimizer: torch.optim.Optimizer) -> None:
    """The same for the optimizer state (momentum and Adam moments share their parameter's layout)."""
    optimizer.register_state_dict_post_hook(lambda opt, state_dict: describe_blocks(state_dict))

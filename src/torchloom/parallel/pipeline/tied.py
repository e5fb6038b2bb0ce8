"""Weights tied across pipeline stages (embedding <-> head).

When the owners of one shared parameter land on different stages, each stage gets its own copy (the stage
holding the first name keeps the original, the others a clone), so every stage module owns its parameters and
DDP/FSDP can wrap stages independently. The copies are kept *bitwise identical*:

* at setup, every copy takes the first stage's value (meta-device models are initialised per stage);
* at every optimizer step, each copy's gradient is replaced by the sum over all copies (summed over the
  pipeline group), which is the gradient of the single shared parameter of the unsplit model (Megatron-LM
  sums the embedding gradients of the first and last stage the same way; NVIDIA/Megatron-LM 299);
* the global gradient norm counts the shared weight once (:func:`clip_grad_norm_`), as the unsplit model does.

Copies are addressed by name in the (final, possibly FSDP-sharded or tensor-parallel) stage modules and handled
as whole tensors (a tied weight is one embedding matrix: small next to the model).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..grad_norm import global_grad_norm


@dataclass
class TiedGroup:
    """One shared parameter: ``names_by_stage[s]`` are its names held by stage ``s``; ``owner`` is the stage
    holding its first (registration-order) name."""

    names_by_stage: dict[int, list[str]]
    owner: int

    @property
    def names(self) -> list[str]:
        return [n for s in sorted(self.names_by_stage) for n in self.names_by_stage[s]]


def shared_parameter_names(root: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor, each in registration order."""
    by_id: dict[int, list[str]] = defaultdict(list)
    for name, p in root.named_parameters(remove_duplicate=False):
        by_id[id(p)].append(name)
    return [names for names in by_id.values() if len(names) > 1]


def untie_across_stages(root: nn.Module, stage_of: dict[str, int]) -> list[TiedGroup]:
    """Give every stage but the owner its own copy of each parameter shared across stages (in place on
    ``root``'s modules). ``stage_of[param_name]`` is the stage holding that name. Returns the groups that span
    more than one stage."""
    groups = []
    for names in shared_parameter_names(root):
        by_stage: dict[int, list[str]] = defaultdict(list)
        for n in names:
            by_stage[stage_of[n]].append(n)
        if len(by_stage) == 1:
            continue  # one stage holds every owner: an ordinary tie inside a stage module
        owner = stage_of[names[0]]
        original = root.get_parameter(names[0])
        for s, stage_names in by_stage.items():
            if s == owner:
                continue
            copy = nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad)
            for n in stage_names:
                mod_name, _, leaf = n.rpartition(".")
                root.get_submodule(mod_name)._parameters[leaf] = copy
        groups.append(TiedGroup(dict(by_stage), owner))
    return groups


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective over a DTensor's mesh; every rank of that mesh holds the same stages, so
    they call it for the same tied weights in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _shard_of(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` in ``p``'s layout (no communication: every rank holds ``full``)."""
    if isinstance(p, DTensor):
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
    return full


class TiedWeights:
    """Keeps the copies of :class:`TiedGroup` s identical on this pipeline rank's stages.

    Works on whole tensors, so the copies may be laid out differently (a vocabulary-sharded embedding on the
    first stage, a replicated or differently sharded head on the last).

    Args:
        groups: from :func:`untie_across_stages` (the same on every rank).
        stage_modules: ``{stage index: unwrapped stage module}`` of this rank's local stages (after every
            method ran, so FSDP/TP parameters are the final DTensors).
        pp_group: the pipeline process group (every rank of it calls the collectives in the same order).
        device: where collectives run (CPU for gloo).
    """

    def __init__(self, groups: list[TiedGroup], stage_modules: dict[int, nn.Module], pp_group, device: torch.device):
        self.groups, self.pp_group, self.device = groups, pp_group, device
        # per group: [(stage, parameter)] held locally (looked up by the stage's first name for it)
        self.local: list[list[tuple[int, nn.Parameter]]] = [
            [(s, stage_modules[s].get_parameter(g.names_by_stage[s][0])) for s in sorted(g.names_by_stage)
             if s in stage_modules] for g in groups]
        mine = [(tuple(ps[0][1].shape), str(ps[0][1].dtype)) if ps else None for ps in self.local]
        announced: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(announced, mine, group=pp_group)
        self.meta = []
        for i, g in enumerate(groups):
            seen = {a[i] for a in announced if a[i] is not None}
            if len(seen) != 1:
                raise RuntimeError(f"tied weight {g.names} has different shapes/dtypes on its stages: {seen}")
            shape, dtype = seen.pop()
            self.meta.append((shape, getattr(torch, dtype.removeprefix("torch."))))

    def duplicate_ids(self) -> set[int]:
        """``id`` of every non-owner copy held here (left out of the gradient norm)."""
        return {id(p) for g, ps in zip(self.groups, self.local) for s, p in ps if s != g.owner}

    def _sum_over_pp(self, i: int, local_sum: torch.Tensor | None) -> torch.Tensor:
        shape, dtype = self.meta[i]
        t = local_sum if local_sum is not None else torch.zeros(shape, dtype=dtype)
        t = t.to(self.device)
        if dist.get_world_size(self.pp_group) > 1:
            dist.all_reduce(t, group=self.pp_group)
        return t

    @torch.no_grad()
    def sync_values(self) -> None:
        """Every copy takes the owner stage's value (exact: the other ranks contribute zeros)."""
        for i, (g, ps) in enumerate(zip(self.groups, self.local)):
            own = next((_full(p).detach().clone() for s, p in ps if s == g.owner), None)
            if own is None and ps:
                own = torch.zeros(self.meta[i][0], dtype=self.meta[i][1], device=_local(ps[0][1]).device)
            value = self._sum_over_pp(i, own)
            for _, p in ps:
                _local(p).copy_(_shard_of(p, value.to(_local(p).device)))

    @torch.no_grad()
    def sum_gradients(self, params: Iterable[nn.Parameter] = ()) -> None:
        """Replace each copy's gradient by the sum over all copies (a ``pre_step_hooks`` entry)."""
        for i, ps in enumerate(self.local):
            local_sum = None
            if ps:
                local_sum = torch.zeros(self.meta[i][0], dtype=self.meta[i][1], device=_local(ps[0][1]).device)
                for _, p in ps:
                    if p.grad is not None:
                        local_sum += _full(p.grad)
            total = self._sum_over_pp(i, local_sum)
            for _, p in ps:
                piece = _shard_of(p, total.to(_local(p).device))
                same_layout = p.grad is not None and (not isinstance(p, DTensor) or (
                    isinstance(p.grad, DTensor) and p.grad.placements == p.placements))
                if same_layout:
                    _local(p.grad).copy_(piece)  # in place: DDP's bucket views stay valid
                elif isinstance(p, DTensor):
                    p.grad = DTensor.from_local(piece.clone(), p.device_mesh, p.placements, shape=p.shape,
                                                stride=p.stride())
                else:
                    p.grad = piece.clone()


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, extra_groups, duplicates: set[int]) -> torch.Tensor:
    """``torchloom.parallel.grad_norm.clip_grad_norm_`` with tied copies counted once: the norm is taken
    over ``params`` minus ``duplicates`` (summed over ``extra_groups``), every gradient is scaled."""
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm([p for p in params if id(p) not in duplicates], 2.0, extra_groups)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        g = _local(p.grad)
        g.mul_(coef.to(g.device, g.dtype))
    return total

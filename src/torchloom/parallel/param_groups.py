"""Which mesh each parameter group is sharded and reduced over (the seam expert parallelism needs).

Without experts every parameter is *dense*: replicated or FSDP-sharded over ``dp`` and its gradient averaged
over ``dp``. Expert parallelism adds *expert* parameters: their leading (expert) dimension is sharded over
``ep`` (a DTensor ``Shard(0)`` on ``mesh["ep"]``), and their gradient is summed over ``edp`` and divided by
the full ``dp`` degree. Why ``dp`` and not ``edp``: the all-to-all's backward already sums each expert's
gradient over the ``ep`` ranks whose tokens it processed, so the sum over ``edp`` covers all ``dp`` ranks'
losses once, and dividing by ``dp`` gives the mean over the global batch that dense gradients get.

The record is written by the method that creates the group (``expert_parallel``) and read by the methods
that reduce, shard, clip, normalise and save: ``fsdp`` (experts become their own FSDP units on ``edp`` with
gradient divide factor ``dp``), ``ddp`` (experts are left out of DDP and reduced over ``edp`` before the
optimizer step), ``zero1`` (refuses experts), the global gradient norm (DTensor gradients reduce over their
own mesh), checkpoints (DTensor shards reshard on load). It lives on ``AccelContext.param_groups`` and is
attached to the accelerated model as ``model._torchloom_param_groups`` (read with :func:`param_groups_of`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass(frozen=True)
class GroupMesh:
    """Mesh placement of one parameter group.

    Attributes:
        name: ``"dense"`` or ``"expert"`` (or a user group).
        shard_view: mesh view the parameters are split over by model parallelism (``"ep"`` for experts:
            dim 0, the expert dimension), or None.
        reduce_view: mesh view gradients are summed over (``"dp"`` dense, ``"edp"`` experts).
        divide_view: mesh view whose size divides the summed gradient (``"dp"`` for both; see the module
            docstring).
    """

    name: str
    reduce_view: str
    divide_view: str = "dp"
    shard_view: str | None = None


DENSE = GroupMesh("dense", reduce_view="dp")
EXPERT = GroupMesh("expert", reduce_view="edp", shard_view="ep")


@dataclass
class ParamGroups:
    """Modules whose parameters belong to a non-dense group, by group (dense = everything else).

    ``modules[group.name]`` lists ``(qualified name, module)`` in model order; a module's *direct*
    parameters (``recurse=False``) belong to the group. Qualified names are relative to the model part the
    module lives in (``AccelContext.model_parts``).
    """

    groups: dict[str, GroupMesh] = field(default_factory=lambda: {"dense": DENSE})
    modules: dict[str, list[tuple[str, nn.Module]]] = field(default_factory=dict)

    def add(self, group: GroupMesh, qualname: str, module: nn.Module) -> None:
        self.groups.setdefault(group.name, group)
        self.modules.setdefault(group.name, []).append((qualname, module))

    def members(self, name: str) -> list[tuple[str, nn.Module]]:
        """``(qualname, module)`` of the group (empty when it has none)."""
        return list(self.modules.get(name, ()))

    def params(self, name: str) -> list[nn.Parameter]:
        """The group's parameters (direct parameters of its modules), each once."""
        seen, out = set(), []
        for _, m in self.members(name):
            for p in m.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def group_of(self, module: nn.Module) -> GroupMesh:
        """The group a module's direct parameters belong to (dense when not recorded)."""
        for name, mods in self.modules.items():
            if any(m is module for _, m in mods):
                return self.groups[name]
        return DENSE

    @property
    def has_experts(self) -> bool:
        return bool(self.modules.get("expert"))


def param_groups_of(model: nn.Module) -> ParamGroups:
    """The record ``auto_accelerate`` attached to ``model`` (an empty one, all dense, when none)."""
    return getattr(model, "_torchloom_param_groups", None) or ParamGroups()

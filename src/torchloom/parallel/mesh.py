"""`ParallelMesh`: the one object that owns the DeviceMesh and answers every rank/group question.

Named dimensions, outermost first: ``pp`` (pipeline), ``dp_replicate`` (DDP / HSDP replicas),
``dp_shard`` (FSDP / ZeRO shards), ``ep`` (expert), ``tp`` (tensor). A degree of 1 is allowed
everywhere; one degree may be -1, meaning "the rest of the world". Methods never create process groups:
they ask this object for sub-meshes (``mesh["dp"]`` is dp_replicate x dp_shard flattened).
Follows torchtitan's ``ParallelDims``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import StrategyError

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "ep", "tp")


@dataclass
class ParallelDims:
    """Degrees of each mesh dimension (-1 = fill with the rest of the world)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    tp: int = 1

    def resolve(self, world_size: int) -> "ParallelDims":
        """Replace a -1 by the remaining degree and check the product equals ``world_size``.

        Raises:
            StrategyError: more than one -1, a degree < 1, a remainder that does not divide, or a product
                different from the world size (the message shows the degrees and the fix).
        """
        d = asdict(self)
        for k, v in d.items():
            if v != -1 and v < 1:
                raise StrategyError(f"mesh degree {k}={v} is invalid; use a positive integer or -1 (the rest).")
        free = [k for k, v in d.items() if v == -1]
        if len(free) > 1:
            raise StrategyError(f"only one mesh dimension may be -1, got {free}; give explicit degrees to the others.")
        fixed = math.prod(v for v in d.values() if v != -1)
        if free:
            if world_size % fixed:
                raise StrategyError(
                    f"cannot fill '{free[0]}': world size {world_size} is not divisible by the product of the other "
                    f"degrees ({_fmt(d)} -> {fixed}); choose degrees whose product divides {world_size}."
                )
            d[free[0]] = world_size // fixed
        elif fixed != world_size:
            raise StrategyError(
                f"mesh degrees {_fmt(d)} multiply to {fixed} but the world size is {world_size}; make the product equal "
                f"the number of processes or set one degree to -1."
            )
        return ParallelDims(**d)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _fmt(d: dict[str, int]) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in d.items()) + ")"


class ParallelMesh:
    """Owns the world ``DeviceMesh`` with dims :data:`DIM_NAMES` and flattened views.

    Args:
        dims: resolved degrees (product = world size).
        device_type: ``"cpu"``, ``"cuda"``, ...

    Sub-meshes: ``mesh[name]`` for a dim name, ``"dp"`` (replicate x shard), ``"dp_shard_ep"`` is not
    defined yet. ``mesh.dims`` gives degrees; ``dp_rank``/``dp_size`` say which data shard this rank reads
    (tensor- and pipeline-parallel peers read the same data).
    """

    def __init__(self, dims: ParallelDims, device_type: str = "cpu"):
        world = dist.get_world_size()
        self.dims = dims.resolve(world)
        self.device_type = device_type
        shape = tuple(getattr(self.dims, n) for n in DIM_NAMES)
        self.world: DeviceMesh = init_device_mesh(device_type, shape, mesh_dim_names=DIM_NAMES)
        self._flat: dict[str, DeviceMesh] = {}
        self._flat["dp"] = self.world["dp_replicate", "dp_shard"]._flatten("dp")

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(name, str) and name in self._flat:
            return self._flat[name]
        try:
            return self.world[name]
        except (KeyError, RuntimeError, ValueError) as e:
            raise StrategyError(f"no mesh dimension {name!r}; valid: {list(DIM_NAMES) + list(self._flat)}") from e

    def degree(self, name: str) -> int:
        return self.dims.dp if name == "dp" else getattr(self.dims, name)

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of one dimension (or ``"dp"``)."""
        return self[name].get_group()

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        return self["dp"].get_local_rank()

    def __repr__(self) -> str:
        return f"ParallelMesh({_fmt(self.dims.as_dict())}, device_type={self.device_type!r})"



_CURRENT: tuple[ParallelMesh, object] | None = None  # (mesh, the default process group it was built on)


def set_current_mesh(mesh: ParallelMesh | None) -> None:
    """Record ``mesh`` as this process's current torchloom mesh (``auto_accelerate`` does, for the mesh it built),
    so helpers that need the data-parallel layout (``torchloom.data.eval_loader``, ``reduce_metrics``) find it
    without being passed ``mesh=``. ``None`` forgets it."""
    global _CURRENT
    _CURRENT = None if mesh is None else (mesh, dist.group.WORLD)


def current_mesh() -> ParallelMesh | None:
    """The mesh recorded by :func:`set_current_mesh` (the last ``auto_accelerate``'s), or ``None`` when none was
    recorded or it does not belong to the current default process group (none initialised, or re-initialised
    since: its groups are gone)."""
    if _CURRENT is None or not (dist.is_available() and dist.is_initialized()):
        return None
    mesh, world = _CURRENT
    return mesh if world is dist.group.WORLD else None

"""`ParallelMesh`: the one object that owns the DeviceMesh and answers every rank/group question.

Named dimensions of the world mesh, outermost first: ``pp`` (pipeline), ``dp_replicate`` (DDP / HSDP
replicas), ``dp_shard`` (FSDP / ZeRO shards), ``tp`` (tensor); their degrees multiply to the world size. A
degree of 1 is allowed everywhere; one degree may be -1, meaning "the rest of the world". Methods never
create process groups: they ask this object for sub-meshes (``mesh["dp"]`` is dp_replicate x dp_shard
flattened).

Expert parallelism does not multiply the world: ``ep`` is carved out of the data-parallel ranks (the
standard layout of torchtitan and Megatron-Core). The flattened ``dp`` view is split row-major into
``edp x ep`` (``ep`` innermost, so expert peers are the closest data-parallel ranks: inside ``dp_shard``
first). Dense parameters are reduced over ``dp``; expert parameters are sharded over ``ep`` and reduced
over ``edp`` = dp / ep (the expert-data-parallel view). Dense layers still see all ``dp`` ranks reading
different data. Follows torchtitan's ``ParallelDims`` (``torchtitan/distributed/parallel_dims.py``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import StrategyError

#: dimensions of the world mesh (their degrees multiply to the world size); ``cp`` (the sequence split of
#: context parallelism / Ulysses) between ``dp_shard`` and ``tp``, torchtitan's order
DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: views carved out of ``dp`` for expert parallelism: ``edp x ep`` = ``dp``
EXPERT_VIEWS = ("edp", "ep")


@dataclass
class ParallelDims:
    """Degrees of each mesh dimension (-1 = fill with the rest of the world).

    ``pp x dp_replicate x dp_shard x cp x tp`` = world size; ``ep`` is not a factor of the world but a divisor of
    ``dp`` (= dp_replicate x dp_shard): expert peers are data-parallel ranks (see the module docstring).
    ``cp`` (context parallel: each sample's sequence split over ``cp`` ranks, between ``dp_shard`` and ``tp``
    in the layout, as torchtitan orders it) is set by ``context_parallel`` / ``ulysses``; cp peers read the same
    samples (``dp`` excludes ``cp``) and reduce gradients together (the ``dp_cp`` / ``dp_shard_cp`` views).
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def world(self) -> int:
        """The world size these degrees fill (``ep`` is carved out of ``dp``, not a factor)."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    def resolve(self, world_size: int) -> "ParallelDims":
        """Replace a -1 by the remaining degree and check the product equals ``world_size``.

        Raises:
            StrategyError: more than one -1, a degree < 1, a remainder that does not divide, or a product
                different from the world size (the message shows the degrees and the fix).
        """
        d = asdict(self)
        ep = d.pop("ep")
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise StrategyError(
                f"mesh degree ep={ep!r} is invalid; use a positive integer (ep is carved out of the data-parallel "
                "ranks, so it cannot be -1)."
            )
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
        dp = d["dp_replicate"] * d["dp_shard"]
        if dp % ep:
            raise StrategyError(
                f"ep={ep} does not divide the data-parallel degree dp={dp} (dp_replicate={d['dp_replicate']} x "
                f"dp_shard={d['dp_shard']}): expert-parallel ranks are carved out of the data-parallel ranks "
                f"(ep x edp = dp). Choose ep among {[k for k in range(1, dp + 1) if dp % k == 0]}, or raise dp."
            )
        return ParallelDims(**d, ep=ep)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the ranks holding the same experts (dp / ep)."""
        return self.dp // self.ep

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _fmt(d: dict[str, int]) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in d.items()) + ")"


class ParallelMesh:
    """Owns the world ``DeviceMesh`` with dims :data:`DIM_NAMES` and flattened views.

    Args:
        dims: resolved degrees (product = world size).
        device_type: ``"cpu"``, ``"cuda"``, ...

    Sub-meshes: ``mesh[name]`` for a dim name, ``"dp"`` (replicate x shard), and the expert views ``"ep"``,
    ``"edp"`` and ``"sparse"`` (the 2-D ``(edp, ep)`` mesh expert parameters live on; ``mesh["ep"]`` and
    ``mesh["edp"]`` are its dimensions, so FSDP over ``edp`` accepts parameters sharded over ``ep``). The
    expert views exist on every mesh (degree 1 when ``ep == 1``) and are built on first use: every rank
    must ask for them at the same point (``expert_parallel`` does during ``apply``). ``mesh.dims`` gives
    degrees; ``dp_rank``/``dp_size`` say which data shard this rank reads (tensor- and pipeline-parallel peers
    read the same data; expert peers read different data).
    """

    def __init__(self, dims: ParallelDims, device_type: str = "cpu"):
        world = dist.get_world_size()
        self.dims = dims.resolve(world)
        self.device_type = device_type
        shape = tuple(getattr(self.dims, n) for n in DIM_NAMES)
        self.world: DeviceMesh = init_device_mesh(device_type, shape, mesh_dim_names=DIM_NAMES)
        self._flat: dict[str, DeviceMesh] = {}
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._flat["dp"] = self.world["dp_replicate", "dp_shard"]._flatten("dp")
        if self.dims.cp > 1:  # what gradients are reduced over (dp_cp) and FSDP shards over (dp_shard_cp)
            self._flat["dp_cp"] = self.world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
            self._flat["dp_shard_cp"] = self.world["dp_shard", "cp"]._flatten("dp_shard_cp")

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(name, str) and name in self._flat:
            return self._flat[name]
        if isinstance(name, str) and name in (*EXPERT_VIEWS, "sparse"):
            sparse = self._sparse()
            return sparse if name == "sparse" else sparse[name]
        try:
            return self.world[name]
        except (KeyError, RuntimeError, ValueError) as e:
            raise StrategyError(
                f"no mesh dimension {name!r}; valid: {list(DIM_NAMES) + ['dp', *EXPERT_VIEWS, 'sparse']}"
                + (" (dp_cp and dp_shard_cp exist when cp > 1)" if self.dims.cp == 1 else "")) from e

    def _sparse(self) -> DeviceMesh:
        """The ``(edp, ep)`` mesh: ``dp`` unflattened (``ep`` innermost). Built once; a collective call."""
        if "sparse" not in self._flat:
            self._flat["sparse"] = self._flat["dp"]._unflatten(0, (self.dims.edp, self.dims.ep), EXPERT_VIEWS)
        return self._flat["sparse"]

    def sequence_group(self, ulysses: int = 1) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
        """Process groups of this rank's cp peers, of their own, for the sequence split: ``(ring group,
        Ulysses group)``. With ``ulysses == 1`` the ring group is the whole cp group (no Ulysses group); with
        ``ulysses == cp`` the Ulysses group is; in between (the hybrid) the Ulysses groups are ``ulysses``
        adjacent cp ranks and the ring groups the ranks at the same place in them. Not ``mesh.group("cp")``: a
        mesh dimension spanning the whole world reuses the default group, where FSDP's asynchronous
        all-gathers run on gloo's work thread while the ring's point-to-point messages go over the same
        connections, and a receive can match another operation's message (gloo: "Received data size doesn't
        match expected size"). Built once per degree; a collective call (every rank creates every group, in
        the same order).

        Raises:
            StrategyError: ``ulysses`` does not divide cp.
        """
        cp = self.dims.cp
        if cp % ulysses:
            raise StrategyError(f"Ulysses degree {ulysses} does not divide cp={cp}; choose a divisor.")
        key = f"cp_seq{ulysses}"
        if key not in self._groups:
            names = self.world.mesh_dim_names
            grid = self.world.mesh.movedim(names.index("cp"), -1).reshape(-1, cp)
            me = dist.get_rank()
            ring = uly = None
            for ranks in grid.tolist():
                for sub in ([ranks[i::ulysses] for i in range(ulysses)] if ulysses < cp else []):
                    g = dist.new_group(sub)
                    ring = g if me in sub else ring
                for sub in ([ranks[i:i + ulysses] for i in range(0, cp, ulysses)] if ulysses > 1 else []):
                    g = dist.new_group(sub)
                    uly = g if me in sub else uly
            self._groups[key] = (ring, uly)
        return self._groups[key]

    def degree(self, name: str) -> int:
        d = self.dims
        return {"dp": d.dp, "edp": d.edp, "dp_cp": d.dp * d.cp, "dp_shard_cp": d.dp_shard * d.cp}.get(name) \
            or getattr(d, name)

    @property
    def grad_view(self) -> str:
        """The view gradients (and the loss's token counts) are reduced over: ``dp``, or ``dp_cp`` under a
        sequence split (cp peers hold the same parameters and different tokens of the same samples)."""
        return "dp_cp" if self.dims.cp > 1 else "dp"

    @property
    def shard_view(self) -> str:
        """The view FSDP shards over: ``dp_shard``, or ``dp_shard_cp`` under a sequence split (torchtitan)."""
        return "dp_shard_cp" if self.dims.cp > 1 else "dp_shard"

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

"""The machines ``loom plan`` plans for: a GPU cluster from the built-in accelerator table
(``--gpu h100 --gpus 1024 --gpus-per-node 8``) or this machine, calibrated (``--local [--nproc N]``).

:func:`resolve_cluster` checks the description (every missing or inconsistent field named) and returns the
:class:`~torchloom.cost.hardware.Hardware` the cost model reads.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import TorchloomError
from .hardware import Hardware


class ClusterError(TorchloomError, ValueError):
    """A cluster description is incomplete or inconsistent (the message names the field and the fix)."""


#: GPUs per node assumed when ``--gpus`` fits in one such node and ``--gpus-per-node`` is not given
MAX_GPUS_ONE_NODE = 8


@dataclass
class ClusterSpec:
    """What the user asked for (before the hardware is built).

    Attributes:
        gpu: the accelerator's table name (``h100-sxm``), None for the local machine.
        gpus: devices in the job (ranks); for ``--local`` the process count.
        gpus_per_node: devices sharing one node's fast link; for ``--local`` = ``gpus``.
        local: plan for this machine (calibrated, cached per fingerprint).
    """

    gpu: str | None
    gpus: int
    gpus_per_node: int
    local: bool = False

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    def describe(self) -> str:
        if self.local:
            return f"this machine, {self.gpus} process{'es' if self.gpus != 1 else ''} (calibrated)"
        return f"{self.gpus} x {self.gpu} ({self.nodes} node{'s' if self.nodes != 1 else ''} of {self.gpus_per_node})"


def known_gpus() -> list[str]:
    """The accelerator table's names (``torchloom.cost.accelerators``; its aliases: ``h100`` = ``h100-sxm``,
    ``a100`` = ``a100-80gb``, ...)."""
    from .accelerators import ACCELERATORS

    return sorted(ACCELERATORS)


def canonical_gpu(name: str) -> str:
    """The accelerator table's name for ``name`` (case, spaces and underscores ignored; aliases accepted).

    Raises:
        HardwareError: an unknown GPU (the known ones listed, the closest suggested).
    """
    from .accelerators import lookup

    return lookup(name).name


def cluster_spec(*, gpu: str | None = None, gpus: int | None = None, gpus_per_node: int | None = None,
                 local: bool = False, nproc: int | None = None) -> ClusterSpec:
    """Check a cluster description and fill what follows from it.

    GPU cluster: ``gpu`` and ``gpus`` are required; ``gpus_per_node`` may be left out only when ``gpus`` fits
    one node (<= 8: then it is ``gpus``). Local: ``local=True``, ``nproc`` processes (default 1); GPU fields
    must not be given.

    Raises:
        ClusterError: a missing field (named), a non-positive count, ``gpus`` not divisible by
            ``gpus_per_node``, ``--nproc`` without ``--local``, or local and GPU fields mixed.
    """
    if local:
        given = [f for f, v in (("--gpu", gpu), ("--gpus", gpus), ("--gpus-per-node", gpus_per_node)) if v is not None]
        if given:
            raise ClusterError(f"--local plans for this machine; drop {', '.join(given)} (or drop --local to plan "
                               f"for a GPU cluster).")
        n = 1 if nproc is None else int(nproc)
        if n < 1:
            raise ClusterError(f"--nproc must be >= 1, got {n}.")
        return ClusterSpec(None, n, n, local=True)
    if nproc is not None:
        raise ClusterError("--nproc is the process count of --local; for a GPU cluster give --gpus (and "
                           "--gpus-per-node).")
    if gpu is None and gpus is None and gpus_per_node is None:
        raise ClusterError("no cluster given: pass --gpu NAME --gpus N [--gpus-per-node K] (e.g. --gpu h100 "
                           "--gpus 1024 --gpus-per-node 8), or --local [--nproc N] for this machine.")
    if gpu is None:
        raise ClusterError(f"the cluster description is missing --gpu (which accelerator: {', '.join(known_gpus())}).")
    name = canonical_gpu(gpu)
    if gpus is None:
        raise ClusterError(f"the cluster description is missing --gpus (how many {name} the job uses, e.g. --gpus 64).")
    if gpus < 1:
        raise ClusterError(f"--gpus must be >= 1, got {gpus}.")
    if gpus_per_node is None:
        if gpus > MAX_GPUS_ONE_NODE:
            raise ClusterError(f"the cluster description is missing --gpus-per-node: {gpus} GPUs span several nodes, "
                               f"and how many share a node's NVLink decides which collectives cross the network "
                               f"(8 on DGX/HGX systems: --gpus-per-node 8).")
        gpus_per_node = gpus
    if gpus_per_node < 1:
        raise ClusterError(f"--gpus-per-node must be >= 1, got {gpus_per_node}.")
    if gpus % gpus_per_node:
        raise ClusterError(f"--gpus {gpus} is not divisible by --gpus-per-node {gpus_per_node}: nodes are whole; use "
                           f"a multiple of {gpus_per_node} GPUs (e.g. {max(gpus // gpus_per_node, 1) * gpus_per_node}).")
    return ClusterSpec(name, int(gpus), int(gpus_per_node))


def cluster_hardware(spec: ClusterSpec, *, refresh: bool = False) -> Hardware:
    """The :class:`Hardware` of ``spec``: the accelerator table's model of the GPU cluster, or this machine's
    calibration for ``spec.gpus`` co-located processes (measured once per machine fingerprint, then cached)."""
    if spec.local:
        from .calibrate import local_hardware

        return local_hardware(spec.gpus, refresh=refresh)
    from . import accelerators

    return accelerators.cluster(spec.gpu, spec.gpus, spec.gpus_per_node)


def resolve_cluster(**kw) -> tuple[ClusterSpec, Hardware]:
    """:func:`cluster_spec` then :func:`cluster_hardware` (keyword arguments of :func:`cluster_spec`)."""
    spec = cluster_spec(**kw)
    return spec, cluster_hardware(spec)

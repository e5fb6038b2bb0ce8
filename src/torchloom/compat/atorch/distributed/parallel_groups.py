"""ATorch's parallel-group queries (``parallel_group``, ``parallel_group_size``, ``parallel_rank``,
``get_data_partition_rank_and_size``, ``parallel_instance_num``/``_index``) on the mesh of the last
:func:`~torchloom.compat.atorch.auto.accelerate.auto_accelerate` call in this process."""
from __future__ import annotations

_MESH = None
# ATorch group names -> torchloom mesh dimensions
_DIMS = {"data": "dp", "zero": "dp_shard", "tensor": "tp", "model": "tp", "pipeline": "pp", "pipe": "pp",
         "expert": "ep", "expert_fsdp": "edp"}  # ep x edp = dp: the expert views carved out of the data ranks


def set_current_mesh(mesh) -> None:
    """Record the :class:`~torchloom.parallel.mesh.ParallelMesh` the groups are answered from."""
    global _MESH
    _MESH = mesh


def _dim(name: str):
    if _MESH is None or name not in _DIMS:
        return None
    dim = _DIMS[name]
    if _MESH.degree(dim) <= 1 and name != "data":
        return None  # ATorch has no group for a dimension the strategy does not parallelise
    if dim == "edp" and _MESH.degree("ep") <= 1:
        return None  # no expert groups without expert parallelism (edp would just be dp)
    return dim


def parallel_group(name):
    """The process group of ATorch dimension ``name`` ("data", "zero", "tensor", "pipeline", "expert",
    "expert_fsdp"...), or None. The expert groups are the mesh's ``ep``/``edp`` views, which ``expert_parallel``
    built on every rank during ``auto_accelerate`` (so asking for them here is no collective)."""
    dim = _dim(name)
    return _MESH.group(dim) if dim is not None else None


def parallel_group_size(name):
    """The degree of ATorch dimension ``name``, or None when there is no such group."""
    dim = _dim(name)
    return _MESH.degree(dim) if dim is not None else None


def parallel_rank(name):
    """This rank's index in ATorch dimension ``name``, or None."""
    dim = _dim(name)
    return _MESH[dim].get_local_rank() if dim is not None else None


def get_data_partition_rank_and_size():
    """``(rank, size)`` of this process's data shard: the data-parallel rank and degree (tensor- and
    pipeline-parallel peers read the same data); ``(0, 1)`` before ``auto_accelerate``."""
    if _MESH is None:
        return 0, 1
    return _MESH.dp_rank, _MESH.dp_size


def parallel_instance_num():
    """How many copies of the parallel configuration the world holds: 1 (torchloom's mesh covers the world;
    ATorch's multi-instance parallel_mode is refused), None before ``auto_accelerate``."""
    return None if _MESH is None else 1


def parallel_instance_index():
    """This process's parallel-configuration copy: 0, None before ``auto_accelerate``."""
    return None if _MESH is None else 0

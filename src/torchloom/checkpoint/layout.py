"""DTensor layouts in flash snapshots: recorded without naming any rank's view, rebuilt collectively, and
resharded in memory when the live layout differs.

A flash snapshot holds each rank's *local* shard of every DTensor (a TP slice, an FSDP shard, the expert
rows of ``ep``) and a header entry describing its layout. Two things need that description:

* the saver processes rebuild the DTensors to write them with DCP (:func:`rebuild`);
* a resume from memory into another layout at the same world size (``ep=2 -> ep=4``, FSDP -> DDP for the
  experts, another ``dp_shard x tp``) must not copy a shard whose local *shape* happens to match but
  which holds other rows: with ``ep=2 x edp=2`` rank 1 holds expert 2, with ``ep=4`` it must get expert 1.

A mesh is recorded by its CuTe layout and rank map (``DeviceMesh._layout``, ``_rank_map``, torch >= 2.9):
the same on every rank, whatever sub-mesh (``ep``, ``edp``, the ``(edp, ep)`` sparse mesh unflattened
from ``dp``, a ``tp`` slice) the rank sees, so every rank rebuilds exactly the process groups the
training run had, in one agreed order (:func:`prepare_meshes`). Snapshots written before this record
(``root`` / per-rank ``mesh`` only) are still decoded the old way.
"""
from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from torchloom.errors import CheckpointError

_MESHES: dict[str, Any] = {}  # rebuilt meshes of this process, by rank-independent key


# -------------------------------------------------------------------------------------------- encode
def encode(t: torch.Tensor) -> dict | None:
    """The layout of ``t`` (``None`` for a plain tensor): ``placements``, global ``shape``/``stride``, this
    rank's sub-mesh ranks (``mesh``) and names (``dims``), and the rank-independent ``layout``/``rank_map``.

    Raises:
        CheckpointError: a placement other than Shard, _StridedShard or Replicate (e.g. Partial).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(t, DTensor):
        return None
    placements = []
    for p in t.placements:
        if isinstance(p, _StridedShard):  # FSDP over tensor or expert parallel
            placements.append(["SS", p.dim, int(p.split_factor)])
        elif isinstance(p, Shard):
            placements.append(["S", p.dim])
        elif isinstance(p, Replicate):
            placements.append(["R"])
        else:
            raise CheckpointError(f"flash checkpoints cannot store a DTensor with placement {p!r} (only Shard, "
                                  f"_StridedShard and Replicate); use torchloom.checkpoint.save for this state")
    mesh = t.device_mesh
    out = {"mesh": mesh.mesh.tolist(), "dims": list(mesh.mesh_dim_names or []), "placements": placements,
           "shape": list(t.shape), "stride": list(t.stride())}
    cute, rank_map = getattr(mesh, "_layout", None), getattr(mesh, "_rank_map", None)
    if cute is not None and rank_map is not None:
        out["layout"] = [[list(ax.shape), list(ax.stride)] for ax in cute]
        out["rank_map"] = [int(r) for r in rank_map.tolist()]
    return out


def same_local_shard(saved: dict | None, live: dict | None) -> bool:
    """Whether a shard saved with layout ``saved`` is exactly the live tensor's local shard on this rank:
    the same global shape, placements and sub-mesh (ranks, in order: they fix this rank's coordinate).
    Two plain tensors count as the same (their shapes are checked when copied)."""
    if saved is None or live is None:
        return saved is None and live is None
    return all(saved.get(k) == live.get(k) for k in ("shape", "placements", "mesh"))


# -------------------------------------------------------------------------------------------- meshes
def _key(layout: dict, device_type: str) -> str:
    if "layout" in layout:
        return json.dumps([device_type, layout["layout"], layout["rank_map"], layout["dims"]])
    return json.dumps([device_type, layout["mesh"], layout["dims"], layout.get("root")])


def prepare_meshes(layouts: list[dict], device_type: str = "cpu") -> None:
    """Build every mesh ``layouts`` name (once per process). Collective when distributed: creating a mesh
    creates process groups, which every rank must do in the same order, so the ranks first agree on the
    union of the meshes they hold (a pipeline stage may hold meshes another does not)."""
    mine = {}
    for lay in layouts:
        if lay is not None and "layout" in lay:
            mine[_key(lay, device_type)] = lay
    everyone = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    union: dict[str, dict] = {}
    for d in everyone:
        union.update(d)
    for key in sorted(union):
        if key not in _MESHES:
            _MESHES[key] = _build(union[key], device_type)


def _build(layout: dict, device_type: str) -> Any:
    from torch.distributed._mesh_layout import _FlatLayout, _MeshLayout
    from torch.distributed.device_mesh import DeviceMesh

    cute = _MeshLayout([_FlatLayout(tuple(shape), tuple(stride)) for shape, stride in layout["layout"]])
    return DeviceMesh(device_type, _layout=cute, _rank_map=torch.tensor(layout["rank_map"], dtype=torch.int),
                      mesh_dim_names=tuple(layout["dims"]) or None)


def _root_mesh(root: dict, device_type: str) -> Any:
    """Snapshots written before the rank-independent record: the world mesh, sliced by name."""
    from torch.distributed.device_mesh import init_device_mesh

    key = json.dumps(["root", device_type, root])
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, tuple(root["shape"]), mesh_dim_names=tuple(root["dims"]))
    return _MESHES[key]


def _mesh(layout: dict, device_type: str) -> Any:
    key = _key(layout, device_type)
    if key in _MESHES:
        return _MESHES[key]
    if "layout" in layout:
        raise CheckpointError("internal: flash layout mesh used before prepare_meshes built it")
    from torch.distributed.device_mesh import DeviceMesh

    root = layout.get("root")
    if root is not None:
        _MESHES[key] = _root_mesh(root, device_type)[tuple(layout["dims"])]
    else:  # old unnamed record: only correct when every rank holds the same sub-mesh
        _MESHES[key] = DeviceMesh(device_type, torch.tensor(layout["mesh"]),
                                  mesh_dim_names=tuple(layout["dims"]) or None)
    return _MESHES[key]


# -------------------------------------------------------------------------------------------- decode
def decode(local: torch.Tensor, layout: dict | None, device_type: str = "cpu") -> torch.Tensor:
    """The DTensor a local shard belongs to (``local`` itself for a plain tensor). The mesh must have been
    built by :func:`prepare_meshes` (old records are built here)."""
    if layout is None:
        return local
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = [Shard(p[1]) if p[0] == "S" else _StridedShard(p[1], split_factor=p[2]) if p[0] == "SS"
                  else Replicate() for p in layout["placements"]]
    return DTensor.from_local(local, _mesh(layout, device_type), placements, run_check=False,
                              shape=torch.Size(layout["shape"]), stride=tuple(layout["stride"]))


# ------------------------------------------------------------------------------------------- reshard
def agree_reshard(moved: list[str], held: list[str], where: str) -> list[str]:
    """The snapshot keys to gather: the union over ranks of ``moved`` (keys whose saved DTensor shard is not
    the live local shard), sorted; each is gathered collectively, so every rank takes part, also where its
    own shard matches. ``held``: the saved-DTensor keys this rank has both in its snapshot and live state.
    Collective; every rank gets the same answer or the same error.

    Raises:
        CheckpointError: a key to gather is missing on some rank (a pipelined job: stages hold different
            parameters), naming it.
    """
    everyone = [(sorted(moved), sorted(held))]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (sorted(moved), sorted(held)))
    union = sorted(set().union(*(set(m) for m, _h in everyone)))
    lacking = [(k, r) for k in union for r, (_m, h) in enumerate(everyone) if k not in set(h)]
    if lacking:
        raise CheckpointError(
            f"{where}: {lacking[0][0]!r} is laid out differently than when the snapshot was taken and must be "
            f"gathered, but rank {lacking[0][1]} does not hold it (a pipelined job); resume from the disk "
            f"checkpoint (torchloom.checkpoint.load)")
    return union


def reshard_into(live: torch.Tensor, saved_local: torch.Tensor, saved: dict | None, key: str, where: str) -> None:
    """Copy the saved value of ``key`` into the live tensor's local shard when the layouts differ.

    A saved DTensor is gathered to its full value (collective over its saved mesh, rebuilt by
    :func:`prepare_meshes`; memory: one full tensor at a time); a saved plain tensor is this rank's full
    value already (a DDP replica, a plain module). The live local shard is the box DCP uses for it
    (``compute_local_shape_and_global_offset``).

    Raises:
        CheckpointError: the saved and live global shapes differ.
    """
    from torch.distributed.tensor import DTensor

    device_type = live.device_mesh.device_type if isinstance(live, DTensor) else live.device.type
    if saved is None:
        full = saved_local
    else:
        full = decode(saved_local.to(live.device if not isinstance(live, DTensor) else live.to_local().device),
                      saved, device_type).full_tensor()
    if tuple(full.shape) != tuple(live.shape):
        raise CheckpointError(f"{where}: {key} has global shape {tuple(full.shape)} in the snapshot, the live "
                              f"state {tuple(live.shape)}")
    with torch.no_grad():
        if isinstance(live, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(live.shape, live.device_mesh, live.placements)
            box = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            live.to_local().copy_(full[box])
        else:
            live.copy_(full)


__all__ = ["agree_reshard", "decode", "encode", "prepare_meshes", "reshard_into", "same_local_shard"]

"""What a confirming trial must not leave behind: process groups, the current mesh, random state, caches.

A trial (:mod:`torchloom.search.runner`) applies a candidate strategy to a fresh model with
:func:`torchloom.auto_accelerate`, which creates DeviceMesh sub-groups, records the current mesh, re-seeds
torch and may initialise DTensor's RNG tracker. :class:`ProcessState` snapshots all of that before the trial
and :meth:`ProcessState.restore` puts it back, so a run after the trials is the run it would have been
without them.

What is restored (torch 2.13):
- process groups: every group in ``torch.distributed.distributed_c10d._world.pg_map`` created since the
  snapshot is destroyed with ``dist.destroy_process_group(group)`` (DeviceMesh keeps its groups in its root
  mesh's ``_pg_registry`` and ``_flatten_mapping``, attributes of the mesh object, not module-level caches:
  dropping the mesh and destroying its groups frees them). The group-name counter is not reset: later groups
  get fresh names, so no store key of a destroyed group is reused.
- torchloom's current mesh (:func:`torchloom.parallel.mesh.set_current_mesh`): the snapshot's value.
- random state: torch CPU, every initialised CUDA device, Python's ``random`` and NumPy's global generator,
  and DTensor's ``_rng_tracker`` (a tracker created by a trial is bound to the trial's mesh).
- caches: DTensor's sharding-propagation LRU cache (its keys hold the trial's meshes and so its groups);
  ``torch._dynamo.reset()`` when the trial compiled (its graphs guard on the trial's modules and count
  towards the recompile limit the real run would then hit).
"""
from __future__ import annotations

import gc
import random
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


def live_groups() -> list:
    """The process groups c10d knows in this process (the default group included)."""
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map)


@dataclass
class ProcessState:
    """A snapshot of the process-wide state a trial changes; :meth:`restore` undoes the trial."""

    groups: set = field(default_factory=set)
    current_mesh: Any = None
    torch_rng: torch.Tensor | None = None
    cuda_rng: list | None = None
    py_rng: Any = None
    np_rng: Any = None
    dtensor_rng: Any = None

    @classmethod
    def capture(cls) -> "ProcessState":
        from torch.distributed.tensor import _random as dtensor_random

        from ..parallel import mesh as loom_mesh

        np_state = None
        try:
            import numpy as np

            np_state = np.random.get_state()
        except ImportError:
            pass
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(groups=set(live_groups()) if dist.is_initialized() else set(), current_mesh=loom_mesh._CURRENT,
                   torch_rng=torch.get_rng_state(), cuda_rng=cuda, py_rng=random.getstate(), np_rng=np_state,
                   dtensor_rng=dtensor_random._rng_tracker)

    def restore(self, *, compiled: bool = False) -> int:
        """Destroy the groups created since :meth:`capture`, put back the mesh, RNG and caches. Call it on every
        rank at the same point (after the trial's last collective). Returns the number of groups destroyed."""
        from torch.distributed.tensor import _random as dtensor_random

        from ..parallel import mesh as loom_mesh

        loom_mesh._CURRENT = self.current_mesh
        dtensor_random._rng_tracker = self.dtensor_rng
        _clear_dtensor_caches()
        if compiled:
            torch._dynamo.reset()
        gc.collect()  # drop the trial's modules first: their hooks and DTensors hold the groups
        destroyed = 0
        if dist.is_initialized():
            from torch.distributed.distributed_c10d import _world

            new = [g for g in live_groups() if g not in self.groups and g is not dist.group.WORLD]
            for g in sorted(new, key=lambda g: _world.pg_names.get(g, "")):  # the same order on every rank
                dist.destroy_process_group(g)
                destroyed += 1
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)
        if self.np_rng is not None:
            import numpy as np

            np.random.set_state(self.np_rng)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return destroyed


def _clear_dtensor_caches() -> None:
    try:
        from torch.distributed.tensor import DTensor

        cache = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
        cache.cache_clear()
    except AttributeError:  # another torch version: nothing of ours is cached there
        pass
    # torch >= 2.10 also caches sharding decisions in C++ (the DTensor dispatch fast path). Its keys compare
    # meshes by layout, not by process group, so a later trial with an equal-shaped mesh (a tp view [[0, 1],
    # [2, 3]] of another 4-rank mesh) would get output specs naming this trial's destroyed groups
    # ("Could not resolve the process group registered under the name N").
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()

"""Run one initialisation call on full-size plain tensors and keep each rank's shard of the result.

DTensor random ops are not sharding-aware on every device (on CPU each rank draws the same local values,
so every shard of a weight came out identical), and even where they are they do not reproduce a plain
build's numbers. So a call never sees a DTensor: the tensors it touches are swapped, for its duration, for
plain full-size tensors on the shard's device; it runs exactly as on an unsharded model (same draws, same
RNG consumption); then each rank copies its own shard out (``distribute_tensor(..., src_data_rank=None)``:
no communication, any placement including ``_StridedShard``) into the *same* parameter object (FSDP2 keeps
references to it). Peak extra memory: the full tensors one call touches (normally one module's own).

Which tensors a call touches is found by a dry run on fake stand-ins (no memory, no random draws) under
a dispatch mode that records every op argument aliasing a stand-in, and whether the first op reading
or writing it overwrites it whole (``normal_``, ``copy_``, ...). A tensor an earlier call already set and
this call reads or writes only in part is all-gathered first; otherwise it starts as the sentinel, so a
part no call ever sets is still reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .init_plan import InitCall

#: in-place ops that set every element of their first argument
_OVERWRITE = {"normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_",
              "geometric_", "log_normal_", "cauchy_"}
#: ops that read a tensor's metadata only
_METADATA = {"new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "empty_like"}


@dataclass
class _Slot:
    """One ``module._parameters[name]`` / ``module._buffers[name]`` entry."""

    module: nn.Module
    store: str
    name: str
    tensor: torch.Tensor
    scratch: bool  # its values are dropped: a stand-in module, or a tied slot that does not own the weight

    @property
    def key(self) -> tuple:
        # tied slots that own the weight share one full tensor; a scratch slot gets its own
        return ("slot", id(self.module), self.name) if self.scratch else ("tensor", id(self.tensor))


def run_call(call: InitCall, scratch: set[tuple[int, str]], written: set[int], device: torch.device,
             fill: Callable[[torch.Tensor], None]) -> None:
    """Run ``call`` so that it sees plain full-size tensors wherever the model holds DTensors or the values
    must be dropped, then copy each rank's shard back.

    scratch: ``(id(module), name)`` of tied slots whose module must not write the shared weight.
    written: ids of DTensors set by an earlier call (updated here).
    device: where stand-in modules' scratch tensors live.
    fill: writes the "never initialised" sentinel into a fresh full tensor.

    Raises:
        RuntimeError: a rank's shard of the full tensor does not have its local tensor's shape.
    """
    slots = _slots(call.module, scratch, present=call.present)
    swap = [s for s in slots if s.scratch or isinstance(s.tensor, DTensor)]
    if not swap:
        call.run()  # an unsharded module: it writes its own tensors, as before
        return
    touched = _dry_run(call, slots, device)
    fulls: dict[tuple, torch.Tensor] = {}
    for s in swap:
        if touched is not None and s.key not in touched:
            continue
        if s.key not in fulls:
            fulls[s.key] = _start_value(s, touched is None or touched[s.key], written, device, fill)
    with _Swap([s for s in slots if s.key in fulls], lambda s: fulls[s.key]), _NoShardedOps(call.name):
        call.run()
    done: set[int] = set()
    for s in swap:
        if s.key in fulls and not s.scratch and id(s.tensor) not in done:
            done.add(id(s.tensor))
            _copy_shard(fulls[s.key], s.tensor, f"{type(s.module).__name__}.{s.name} (under '{call.name}')")
            written.add(id(s.tensor))


def fork_rng(device: torch.device, enabled: bool = True):
    """``torch.random.fork_rng`` over the CPU and ``device``'s generator: the state is restored on exit."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[], enabled=enabled)
    return torch.random.fork_rng(devices=[device], enabled=enabled, device_type=device.type)


def _slots(root: nn.Module, scratch: set[tuple[int, str]], present: bool) -> list[_Slot]:
    out = []
    for mod in root.modules():
        for store in ("_parameters", "_buffers"):
            for name, t in getattr(mod, store).items():
                if t is not None:
                    out.append(_Slot(mod, store, name, t, not present or (id(mod), name) in scratch))
    return out


def _start_value(s: _Slot, needs_prior: bool, written: set[int], device: torch.device,
                 fill: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """The full tensor a call starts from: the current value when it reads what an earlier call wrote
    (an all-gather over the DTensor's mesh), else fresh (sentinel-filled when its values are kept)."""
    t = s.tensor
    if s.scratch:
        return (torch.zeros if needs_prior else torch.empty)(t.shape, dtype=t.dtype, device=device)
    if needs_prior and id(t) in written:
        return t.full_tensor().clone()
    full = torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
    fill(full)
    return full


def _copy_shard(full: torch.Tensor, dt: DTensor, name: str) -> None:
    local = dt.to_local()
    piece = distribute_tensor(full, dt.device_mesh, dt.placements, src_data_rank=None).to_local()
    if piece.shape != local.shape:
        raise RuntimeError(f"meta-device init: the shard of {name} cut from the full tensor has shape "
                           f"{tuple(piece.shape)} but this rank holds {tuple(local.shape)} (placements "
                           f"{dt.placements}); this layout is not supported for meta-device initialisation.")
    local.copy_(piece)


class _Swap:
    """Context manager: put ``value(slot)`` into each slot (as a Parameter where the slot held one)."""

    def __init__(self, slots: list[_Slot], value: Callable[[_Slot], torch.Tensor]):
        self.slots, self.value = slots, value

    def __enter__(self):
        made: dict[tuple, torch.Tensor] = {}
        for s in self.slots:
            if s.key not in made:
                v = self.value(s)
                made[s.key] = nn.Parameter(v, requires_grad=s.tensor.requires_grad) \
                    if isinstance(s.tensor, nn.Parameter) else v
            getattr(s.module, s.store)[s.name] = made[s.key]
        return made

    def __exit__(self, *exc):
        for s in self.slots:
            getattr(s.module, s.store)[s.name] = s.tensor
        return False


def _dry_run(call: InitCall, slots: list[_Slot], device: torch.device) -> dict[tuple, bool] | None:
    """Run ``call`` on fake stand-ins (``FakeTensorMode``: no memory, no random draws, and unlike meta tensors
    not skipped by ``torch.nn.init``'s ``is_meta`` shortcuts) of every tensor in its subtree. Returns
    ``{slot key: needs its prior value}`` for the slots it touched, or None when it cannot run on fake tensors
    (a data-dependent initialiser such as ``trunc_normal_``'s rejection loop): then every slot counts."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    stand_ins: dict[tuple, torch.Tensor] = {}

    def fake(s: _Slot) -> torch.Tensor:
        if s.key not in stand_ins:
            t = s.tensor
            where = t.to_local().device if isinstance(t, DTensor) else (device if t.is_meta else t.device)
            with fake_mode:
                stand_ins[s.key] = torch.empty(t.shape, dtype=t.dtype, device=where)
        return stand_ins[s.key]

    try:
        # the RNG is restored afterwards in case anything still drew on a real device
        with fork_rng(device), _Swap(slots, fake) as made, fake_mode, _Recorder(made) as rec:
            call.run()
    except Exception:
        return None
    return {k: bool(v) for k, v in rec.needs_prior.items()}


class _Recorder(TorchDispatchMode):
    """Records which stand-ins the ops touch: ``needs_prior[key]`` is True when the first op reading or
    writing that tensor's data does not overwrite all of it, None while only views/metadata were taken."""

    def __init__(self, stand_ins: dict[tuple, torch.Tensor]):
        super().__init__()
        self.items = list(stand_ins.items())
        self.needs_prior: dict[tuple, bool | None] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        reads_data = not func.is_view and name not in _METADATA
        target = args[0] if args else None
        for t in pytree.tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor):
                continue
            for key, s in self.items:
                if torch._C._is_alias_of(t, s):
                    self.needs_prior.setdefault(key, None)
                    if reads_data and self.needs_prior[key] is None:
                        whole = t is target and name in _OVERWRITE and t.numel() == s.numel()
                        self.needs_prior[key] = not whole
        return func(*args, **kwargs)


class _NoShardedOps(TorchDispatchMode):
    """Safety net for the real run: an op on a DTensor means the dry run missed a tensor the call touches
    (its random values would repeat on every shard), so stop instead of initialising it wrong."""

    def __init__(self, call_name: str):
        super().__init__()
        self.call_name = call_name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(t, DTensor) for t in pytree.tree_leaves((args, kwargs))):
            raise RuntimeError(
                f"meta-device init: the initialiser of '{self.call_name}' ran {func} on a sharded tensor that its "
                "dry run on fake tensors did not touch (control flow that differs between fake and real tensors); "
                "build this model on the CPU instead of the meta device, or give the module a reset_parameters() "
                "that only sets its own tensors.")
        return func(*args, **kwargs)

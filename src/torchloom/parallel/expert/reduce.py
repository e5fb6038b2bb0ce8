"""Expert parameters under data parallelism that does not hold them (``ddp``): their gradient reduction and
their start-of-training broadcast.

Expert parameters (``ParamGroups`` group ``"expert"``, see :mod:`torchloom.parallel.param_groups`) are sharded
over ``ep`` and differ from one ep rank to the next, so DDP (which all-reduces and broadcasts over all of
``dp``) must leave them alone. Their gradient is summed over ``edp`` (the ranks holding the same experts) and
divided by ``dp``: the all-to-all's backward already summed each expert's gradient over the ep ranks whose
tokens it processed, so this is the global-batch mean that dense parameters get from DDP. Megatron-Core does
the same with its expert-data-parallel group (``_allreduce_word/expert grads`` over ``expert_data_parallel``).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _collective_device(group) -> torch.device | None:
    """gloo reduces CPU tensors only: None means "use the tensor's own device"."""
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else None


class ExpertGradReducer:
    """Sum each expert gradient's local tensor over ``group`` (edp) and divide it by ``dp``, once per
    optimizer step, before clipping and the step.

    A parameter with no gradient on this rank (its experts received no tokens, case C05) contributes zeros
    and still joins the collective, so ranks never wait on each other; it ends with the reduced gradient
    (zeros when no rank had one). Gradients are flattened per dtype into one all-reduce each.

    Runs at most once per step: :meth:`reduce` does nothing until a forward with gradients enabled ran
    after the last reduction (a forward pre-hook on the model parts resets the flag). So it can be both a
    ``train_step`` pre-step hook (before unscaling/clipping) and an optimizer step pre-hook (a plain
    ``loss.backward(); optimizer.step()`` loop) without reducing twice, and a two-pass optimizer (WSAM)
    whose replayed backward gives new gradients is reduced again.

    Args:
        params: the expert parameters (DTensors ``Shard(0)`` on ``mesh["ep"]``, or plain tensors with ep=1).
        group: the expert-data-parallel process group (``mesh.group("edp")``).
        dp: the data-parallel degree the summed gradient is divided by.
    """

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup | None, dp: int):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.dp = int(dp)
        self.reduced = False
        self.reductions = 0  # how many times gradients were reduced (tests, notes)

    def attach(self, parts: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None = None) -> "ExpertGradReducer":
        """Reset the once-per-step flag at each gradient-enabled forward of ``parts``; with ``optimizer``,
        also reduce in its step pre-hook."""
        for part in parts:
            part.register_forward_pre_hook(self._forward_started)
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._before_step)
        return self

    def _before_step(self, *_args) -> None:  # an optimizer step pre-hook must return None
        self.reduce()

    def _forward_started(self, _module, _args) -> None:
        if torch.is_grad_enabled():
            self.reduced = False

    def __call__(self, _params=None) -> None:  # the ``pre_step_hooks`` signature
        self.reduce()

    @torch.no_grad()
    def reduce(self) -> bool:
        """Reduce the gradients if this step's are not reduced yet; return True when it reduced.
        Collective over ``group``: every rank of it calls it at the same point."""
        if self.reduced:
            return False
        self.reduced = True
        if not self.params:
            return False
        for p in self.params:
            if p.grad is None:  # no tokens reached this rank's experts: a zero contribution
                p.grad = torch.zeros_like(p)
        grads = [_local(p.grad) for p in self.params]
        size = dist.get_world_size(self.group) if dist.is_initialized() else 1
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, tensors in by_dtype.items():
            if size > 1:
                dev = _collective_device(self.group) or tensors[0].device
                flat = torch.cat([t.reshape(-1).to(dev) for t in tensors])
                dist.all_reduce(flat, group=self.group)
                flat.div_(self.dp)
                offset = 0
                for t in tensors:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
            elif self.dp != 1:
                for t in tensors:
                    t.div_(self.dp)
        self.reductions += 1
        return True


def expert_tensor_ids(params: Iterable[nn.Parameter], expert_modules: Iterable[nn.Module] = ()) -> set[int]:
    """``id`` of every expert parameter and of every buffer owned directly by an expert module."""
    ids = {id(p) for p in params}
    for m in expert_modules:
        ids |= {id(b) for b in m.buffers(recurse=False)}
    return ids


@torch.no_grad()
def broadcast_states_by_group(model: nn.Module, dense_group: dist.ProcessGroup | None,
                              expert_group: dist.ProcessGroup, expert_ids: set[int]) -> tuple[int, int]:
    """Copy ``model``'s parameters and buffers from the first rank of their group to the others, in place:
    dense tensors over ``dense_group`` (dp), expert tensors (``id`` in ``expert_ids``) over
    ``expert_group`` (edp) only, because experts differ across ep ranks and a dp broadcast would overwrite
    them with rank 0's. ``dense_group=None`` leaves dense tensors alone (DDP broadcasts those itself).
    DTensors broadcast their local shard. Collective over both groups.

    Returns:
        ``(dense, expert)``: how many tensors were broadcast over each group.
    """
    seen: set[int] = set()
    counts = [0, 0]
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        expert = id(t) in expert_ids
        group = expert_group if expert else dense_group
        if group is None:
            continue
        if dist.get_world_size(group) > 1:
            local = t.to_local() if isinstance(t, DTensor) else t.data
            dist.broadcast(local, group=group, group_src=0)
        counts[expert] += 1
    return counts[0], counts[1]


def ddp_ignore_names(module: nn.Module, expert_ids: set[int]) -> list[str]:
    """Names (relative to ``module``, the one DDP wraps) of the expert parameters and buffers, in the form
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` takes."""
    names = [n for n, p in module.named_parameters() if id(p) in expert_ids]
    names += [n for n, b in module.named_buffers() if id(b) in expert_ids]
    return names

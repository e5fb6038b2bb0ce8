"""Dynamic loss scaling for fp16 whose skip decision is the same on every rank."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..errors import LossScaleError


class DynamicLossScaler:
    """Dynamic loss scaling (Micikevicius et al., "Mixed Precision Training", ICLR 2018).

    The loss is multiplied by ``scale`` before backward; at the optimizer step the gradients are
    unscaled and checked for inf/NaN. The "found inf" flag is all-reduced (MAX) over ``group`` (default:
    the world) so a single rank's overflow makes *every* rank skip the step and back off identically —
    with sharded gradients a rank only sees its own shard (fairscale 754, pytorch PR 115710).

    Args:
        init_scale: starting scale (a power of two).
        growth_factor / backoff_factor: multiply the scale after ``growth_interval`` clean steps / on overflow.
        min_scale: floor; backing off below it raises :class:`LossScaleError` (gradients overflow at every
            scale: lower the learning rate or use bf16).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0 / 2**24, group=None):
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.group = group
        self._good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide gradients by the scale in place; return True if any rank saw inf/NaN."""
        inv = 1.0 / self.scale
        found = torch.zeros(1)
        for p in params:
            g = p.grad
            if g is None:
                continue
            local = g.to_local() if isinstance(g, DTensor) else g
            local.mul_(inv)
            if not torch.isfinite(local).all():
                found.fill_(1.0)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dev = _collective_device(self.group)
            f = found.to(dev)
            dist.all_reduce(f, op=dist.ReduceOp.MAX, group=self.group)
            found = f.cpu()
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        """Back off on overflow (raising at the floor), grow after ``growth_interval`` clean steps."""
        if found_inf:
            self.skipped_steps += 1
            self._good_steps = 0
            new = self.scale * self.backoff_factor
            if new < self.min_scale:
                raise LossScaleError(
                    f"fp16 loss scale would fall below its floor min_scale={self.min_scale:g} (now {self.scale:g}): "
                    "gradients overflow at every scale. Lower the learning rate, clip gradients, or use "
                    "amp with dtype='bfloat16'."
                )
            self.scale = new
        else:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self._good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self._good_steps = int(sd.get("good_steps", 0))
        self.skipped_steps = int(sd.get("skipped_steps", 0))


def _collective_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "gloo":
        return torch.device("cpu")
    from ..utils import default_device

    return default_device()

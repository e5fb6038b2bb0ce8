"""What ATorch's result objects do in a plain training loop (``loss = loss_func(batch, out); loss.backward();
optim.step()``), on top of torchloom's native pieces.

torchloom's native ``train_step`` scales fp16 losses itself; an ATorch user calls ``backward`` and ``step``
directly, so (as ATorch's ``amp_native`` does) the returned ``loss_func`` scales the gradient of the loss it
returns and the returned optimizer unscales, skips a step whose gradients hold inf/NaN (the decision agreed
by every rank, torchloom's :class:`~torchloom.parallel.loss_scaler.DynamicLossScaler`) and updates the scale.
"""
from __future__ import annotations

import functools
from collections import abc
from typing import Any, Callable

import torch

from ...parallel.grad_norm import clip_grad_norm_ as clip_grad_norm
from ...parallel.loss_scaler import DynamicLossScaler
from .data import data_to_device


class AmpNativeOptimizer(torch.optim.Optimizer):
    """ATorch's ``AmpNativeOptimizer``: ``step()`` unscales the gradients, skips the step on inf/NaN and updates
    the loss scale; other attributes are the wrapped optimizer's.

    ``unscale_()`` (ATorch's / ``torch.amp.GradScaler``'s) divides the gradients by the scale now, e.g. before
    ``torch.nn.utils.clip_grad_norm_``; ``step()`` then does not unscale again and still skips on inf/NaN. A
    second ``unscale_()`` before ``step()`` raises ``RuntimeError``, as ``GradScaler`` does.

    Args:
        optimizer: the optimizer torchloom built (after sharding).
        scaler: the loss scaler whose ``scale`` the loss function multiplies the gradients by.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: DynamicLossScaler):  # noqa: D107
        self.optimizer = optimizer
        self.grad_scaler = scaler
        self._is_overflow = False
        self._unscaled_found_inf: bool | None = None  # set by unscale_() until the next step()

    def _params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def step(self, *args, **kwargs):
        """Unscale (unless ``unscale_()`` already did this step), step unless a rank saw inf/NaN, update the
        scale."""
        found_inf = self._unscaled_found_inf
        if found_inf is None:
            found_inf = self.grad_scaler.unscale_(self._params())
        self._unscaled_found_inf = None
        if not found_inf:
            self.optimizer.step(*args, **kwargs)
        self.grad_scaler.update(found_inf)
        self._is_overflow = found_inf

    def unscale_(self):
        """Divide the gradients by the scale now (e.g. before clipping), recording whether any rank saw inf/NaN
        (agreed over the ranks); ``step`` then does not unscale again and skips the update on inf/NaN.

        Raises:
            RuntimeError: ``unscale_()`` was already called since the last ``step()`` (as ``GradScaler``).
        """
        if self._unscaled_found_inf is not None:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        self._unscaled_found_inf = bool(self.grad_scaler.unscale_(self._params()))

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step`` was skipped because of inf/NaN gradients."""
        return self._is_overflow

    def zero_grad(self, set_to_none: bool = True):
        """The wrapped optimizer's ``zero_grad``."""
        return self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """The wrapped optimizer's state."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        """Load the wrapped optimizer's state."""
        return self.optimizer.load_state_dict(state_dict)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def __getattr__(self, attr):
        if attr in ("optimizer", "grad_scaler", "_is_overflow", "_unscaled_found_inf"):
            raise AttributeError(attr)
        return getattr(self.optimizer, attr)

    def __repr__(self):
        return f"AmpNativeOptimizer({self.optimizer!r})"


def add_clip_grad_norm(model: torch.nn.Module, extra_groups=()) -> None:
    """Give ``model`` ATorch's FSDP ``model.clip_grad_norm_(max_norm, norm_type=2.0)``: clip the gradients to
    their global norm over every FSDP shard (and ``extra_groups``) and return that norm (before clipping, as
    torch's FSDP does). Call it after ``optim.unscale_()`` under fp16."""

    def clip_grad_norm_(max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return clip_grad_norm(model.parameters(), max_norm, norm_type, extra_groups)

    model.clip_grad_norm_ = clip_grad_norm_


def scaled_loss_func(loss_func: Callable, scaler: DynamicLossScaler) -> Callable:
    """``loss_func`` whose returned loss (or first item) multiplies its gradient by ``scaler.scale`` in
    backward (the value itself is unscaled, so logging it shows the true loss)."""

    @functools.wraps(loss_func)
    def wrapper(*args, **kwargs):
        result = loss_func(*args, **kwargs)
        is_seq = isinstance(result, abc.Sequence) and not isinstance(result, (str, torch.Tensor))
        loss = result[0] if is_seq else result
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss = loss.view_as(loss)  # a fresh node, so the hook belongs to this call only
            loss.register_hook(lambda g: g * scaler.scale)
        if is_seq:
            return (loss, *result[1:])
        return loss

    return wrapper


def cast_inputs(prepare_input: Callable, dtype: torch.dtype) -> Callable:
    """ATorch ``half``: ``prepare_input`` then floating-point tensors to ``dtype``."""

    def cast(x: Any):
        if isinstance(x, torch.Tensor):
            return x.to(dtype) if x.is_floating_point() else x
        if isinstance(x, dict):
            return type(x)({k: cast(v) for k, v in x.items()})
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(cast(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(cast(v) for v in x)
        return x

    def prepare(data, device):
        return cast((prepare_input or data_to_device)(data, device))

    return prepare

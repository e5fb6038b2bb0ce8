"""``atorch.optimizers.wsam.WeightedSAM`` on torchloom's :class:`torchloom.optim.WSAM`.

ATorch's call form ``WeightedSAM(model, base_optimizer, rho=0.05, gamma=0.9, sam_eps=1e-12,
adaptive=False, decouple=True, max_norm=None)``, its exception types for invalid arguments, its gradient
clipping (each pass's gradient separately) and its gradient averaging over the world. docs/compat_atorch.md,
section "Optimizers", lists every difference from ATorch.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ....optim.wsam import WSAM as _NativeWSAM
from ....optim.wsam import _average_replicated, _check_hyperparameters

__all__ = ("WeightedSAM",)

#: ATorch's WeightedSAM state per parameter: values of the last step only, recomputed at every step
_ATORCH_STEP_STATE = ("e_w", "grad", "sharpness")


class WeightedSAM(_NativeWSAM):
    r"""ATorch's WeightedSAM (Yue et al., KDD 2023) with torchloom's update.

    Args:
        model: the model (ATorch: a DDP model is recommended, so that ``model.no_sync()`` works in the first
            pass); its parameters that require gradients are optimised.
        base_optimizer: the base optimizer built over the model's parameters (as in ATorch), or, beyond
            ATorch, an optimizer class or factory (then ``**kwargs`` are its arguments).
        rho: perturbation radius (>= 0). gamma: sharpness weight, ``alpha = gamma / (1 - gamma)``, in [0, 1).
        sam_eps: added to the gradient norm. adaptive: ASAM's perturbation. decouple: decoupled sharpness step.
        max_norm: as ATorch: the first-pass gradient (after the perturbation is computed) and the second-pass
            gradient are each clipped to this global L2 norm over ``model.parameters()``; None: no clipping.

    As in ATorch, when ``torch.distributed`` is initialised (world size > 1) the first-pass gradients are
    averaged over the world after the perturbation (so the first backward may run under ``no_sync``:
    per-replica perturbation, SAM's m-sharpness), and the second-pass gradients are averaged again.
    ``step(closure)`` runs both passes and returns the first pass's loss; it clears the gradients before each
    pass (ATorch adds those present at the call to the first pass's: a warning says so, once).

    Raises:
        AssertionError: ``rho < 0`` (ATorch's message "Invalid rho, should be non-negative: ..."), and
            :meth:`step` without a closure and without a pending :meth:`first_step`.
        ZeroDivisionError: ``gamma == 1`` (ATorch: ``alpha = gamma / (1 - gamma)``).
        ValueError: ``gamma`` outside [0, 1), ``sam_eps < 0``, ``max_norm <= 0`` (ATorch accepts these
            silently; see docs/compat_atorch.md).
        TypeError: ``**kwargs`` with a built base optimizer (ATorch ignores them).
    """

    def __init__(self, model: nn.Module, base_optimizer: Any, rho: float = 0.05, gamma: float = 0.9,
                 sam_eps: float = 1e-12, adaptive: bool = False, decouple: bool = True,
                 max_norm: float | None = None, **kwargs: Any) -> None:
        if not rho >= 0.0:
            raise AssertionError(f"Invalid rho, should be non-negative: {rho}")
        if gamma == 1:
            raise ZeroDivisionError("WeightedSAM: gamma=1 makes alpha = gamma / (1 - gamma) infinite; use gamma "
                                    "in [0, 1) (0.9 is ATorch's default, 0.5 is SAM).")
        if not isinstance(model, nn.Module):
            raise TypeError(f"WeightedSAM's first argument is the model (an nn.Module), as in ATorch; got "
                            f"{type(model).__name__}. For parameters or groups use torchloom.optim.WSAM.")
        _check_hyperparameters(rho, gamma, sam_eps, max_norm)
        # the native class clips once, the gradient the base optimizer steps on; ATorch's clipping is done
        # here (first_step/second_step), so the native max_norm stays None
        super().__init__(model, base_optimizer, rho=rho, gamma=gamma, sam_eps=sam_eps, adaptive=adaptive,
                         decouple=decouple, max_norm=None, **kwargs)
        self.max_norm = max_norm
        self._checked_leftover_grads = False
        self._sync_with_base()  # groups of an ATorch checkpoint loaded into the base optimizer carry "alpha"

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False, replica_group: dist.ProcessGroup | None = None) -> None:
        """Perturb the weights by ``e`` computed from the current (this replica's) gradients, average the
        gradients over ``replica_group`` (default: the world when ``torch.distributed`` is initialised, as
        ATorch), clip them to ``max_norm`` and keep them as the first-pass gradient ``g``."""
        if replica_group is None and self._average_over_world():
            replica_group = dist.group.WORLD
        self._sync_with_base()
        super().first_step(zero_grad=False, replica_group=replica_group)
        if self.max_norm is not None:
            self._clip_gradients(self.max_norm)
            for p, saved in self._saved.items():
                saved[1].copy_(p.grad)
        if zero_grad:
            self.zero_grad(set_to_none=True)

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False, max_norm: float | None = None) -> None:
        """Average the second-pass gradients ``g~`` over the world (ATorch, when ``torch.distributed`` is
        initialised), clip them to ``max_norm`` (``max_norm`` overrides the constructor's for this step), then
        restore the weights and update as :meth:`torchloom.optim.WSAM.second_step`."""
        if not self._saved:
            return super().second_step(zero_grad=zero_grad)  # raises: no first_step
        if self._average_over_world():
            _average_replicated([p for p in self._saved if p.grad is not None], dist.group.WORLD)
        clip = self.max_norm if max_norm is None else max_norm
        if clip is not None:
            self._clip_gradients(clip)
        own, self.max_norm = self.max_norm, None  # the native step must not clip a second time
        norm = self.last_grad_norm if clip is not None else None
        try:
            super().second_step(zero_grad=zero_grad)
        finally:
            self.max_norm, self.last_grad_norm = own, norm

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, max_norm: float | None = None) -> Any:
        """``step(closure)``: both passes, returning the first pass's loss (ATorch's form). Without a closure:
        :meth:`second_step` after a :meth:`first_step` (beyond ATorch), or a base-optimizer step when every
        gradient is zero (how ``torch.distributed.checkpoint`` initialises state).

        Raises:
            AssertionError: no closure, no pending :meth:`first_step` and non-zero gradients (ATorch's type).
        """
        if closure is None and not self._saved and not self._all_gradients_zero():
            raise AssertionError("Sharpness Aware Minimization requires closure, but it was not provided: call "
                                 "optimizer.step(closure) with a closure that computes the loss and calls "
                                 "backward(), or first_step() / a backward pass at the perturbed weights / "
                                 "second_step().")
        if closure is not None and not self._checked_leftover_grads:
            self._checked_leftover_grads = True  # once: the check costs a sync per gradient on a GPU
            if any(p.grad is not None for g in self.param_groups for p in g["params"]) \
                    and not self._all_gradients_zero():
                warnings.warn("WeightedSAM.step(closure) clears the gradients present before the first pass (the "
                              "closure computes them); ATorch adds them to the first pass's gradient (in its README's "
                              "closure example, a backward() just before step(closure) doubles it). Call zero_grad() "
                              "before step(closure) to silence this.", stacklevel=2)
        return super().step(closure, max_norm=max_norm)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this class's, the native WSAM's, the base optimizer's or ATorch's ``WeightedSAM.state_dict()``.

        ATorch's format keeps per-step values (``e_w``, ``grad``, ``sharpness``) as the state, which every step
        recomputes: they are dropped (as in ATorch, the base optimizer's moments are in the base optimizer's
        own state dict); its groups' ``alpha`` becomes ``gamma = alpha / (1 + alpha)``.
        """
        state_dict = dict(state_dict)
        state_dict["state"] = {k: {n: v for n, v in s.items() if n not in _ATORCH_STEP_STATE}
                               for k, s in state_dict["state"].items()}
        state_dict["state"] = {k: s for k, s in state_dict["state"].items() if s}
        super().load_state_dict(state_dict)
        self._sync_with_base()

    def _sync_with_base(self) -> None:
        """Share the base optimizer's groups and state again (``base_optimizer.load_state_dict`` replaces them,
        as ATorch's examples do to resume), fill WSAM's options missing from a group, and take ATorch's group
        key ``alpha`` (the sharpness weight ATorch reads at every step) as ``gamma = alpha / (1 + alpha)``."""
        base = self.base_optimizer
        self.param_groups, self.state = base.param_groups, base.state
        for group in self.param_groups:
            if "alpha" in group:
                alpha = group.pop("alpha")
                if not (alpha >= 0 and math.isfinite(alpha)):
                    raise ValueError(f"WeightedSAM: a parameter group has alpha={alpha}; ATorch's alpha = gamma / "
                                     f"(1 - gamma) must be >= 0 (gamma in [0, 1)).")
                group["gamma"] = alpha / (1.0 + alpha)
            for key in ("rho", "gamma", "sam_eps", "adaptive"):
                group.setdefault(key, self.defaults[key])

    def _perturbation_norm(self) -> torch.Tensor:
        """ATorch's norm: ``||g||`` (``||w * g||`` in adaptive groups) in the gradients' dtype (the native
        norm is fp32, which for float64 models differs from ATorch by about 1e-8 relative). DTensor gradients:
        the native global norm over every shard."""
        grads = [((p.abs() * p.grad) if group["adaptive"] else p.grad)
                 for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads or any(isinstance(g, DTensor) for g in grads):
            return super()._perturbation_norm()
        device = grads[0].device
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g).to(device) for g in grads]))

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        """ATorch: ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``; kept in
        ``last_grad_norm`` (the norm before clipping)."""
        self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return self.last_grad_norm

    def _average_over_world(self) -> bool:
        """ATorch averages plain gradients over the world whenever ``torch.distributed`` is initialised;
        DTensor gradients (FSDP2, tensor parallel) are already reduced over their mesh."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return False
        return not any(isinstance(p.grad, DTensor) for g in self.param_groups for p in g["params"])


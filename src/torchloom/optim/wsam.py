"""WSAM: sharpness-aware minimisation with the sharpness as a weighted regulariser.

Yue, Jiang, Ye, Gao, Liu, Zhang, "Sharpness-Aware Minimization Revisited: Weighted Sharpness as a
Regularization Term", KDD 2023 (arXiv 2305.15817). Official code: ATorch ``atorch/optimizers/wsam.py``
(``WeightedSAM``). See docs/optim/wsam.md for the formulas, the training-loop patterns and data parallelism.
"""
from __future__ import annotations

import contextlib
import math
from collections import namedtuple
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..parallel.grad_norm import clip_grad_norm_, global_grad_norm
from ..parallel.tensor.optim import foreach_safe_args

# global_grad_norm reads ``.grad``; the adaptive norm ||w * g|| is fed through this stand-in
_Grad = namedtuple("_Grad", "grad")


class WSAM(torch.optim.Optimizer):
    r"""Weighted sharpness-aware minimisation around any base optimizer (Yue et al., KDD 2023).

    Minimises ``L(w) + alpha * (max_{||e|| <= rho} L(w + e) - L(w))`` with ``alpha = gamma / (1 - gamma)``
    (``gamma = 0.5`` is SAM, ``gamma = 0`` the base optimizer). One step takes two forward/backward passes:

    1. ``g = grad L(w)``; ``e = rho * g / (||g|| + sam_eps)``, or with ``adaptive`` (ASAM, Kwon et al. 2021)
       ``e = rho * w^2 * g / (||w * g|| + sam_eps)``; norms over *all* parameters (DTensor shards included).
    2. ``g~ = grad L(w + e)``; the weights go back to ``w`` (restored from a copy, bit-exact), then
       - ``decouple=True`` (default; the paper's Algorithm 1): the base optimizer steps on ``g``, then
         ``w -= lr * alpha * (g~ - g)`` with each parameter group's ``lr``;
       - ``decouple=False``: the base optimizer steps on ``g + alpha * (g~ - g)``.

    Args:
        params: parameters or parameter groups, or the model (ATorch's first argument; then
            :meth:`step` also freezes BatchNorm running statistics during the second pass and, for a DDP
            model, perturbs each replica by its own gradient).
        base_optimizer: an optimizer class or factory ``fn(params, **base_kwargs)`` (e.g.
            ``torch.optim.AdamW``), or an already built optimizer over the same parameters (ATorch style;
            then ``base_kwargs`` must be empty).
        rho: perturbation radius (>= 0). gamma: sharpness weight in [0, 1). sam_eps: added to the norm.
        adaptive: ASAM's scale-invariant perturbation. decouple: see above.
        max_norm: clip the gradient the base optimizer steps on (``g`` decoupled, ``g + alpha (g~ - g)``
            coupled) to this global L2 norm; None = no clipping.
        **base_kwargs: forwarded to ``base_optimizer`` (``lr``, ``weight_decay``, ...).

    ``param_groups`` and ``state`` are the base optimizer's (LR schedulers act on both); each group also
    carries ``rho``, ``gamma``, ``sam_eps``, ``adaptive``. ``state_dict()`` is the base optimizer's format
    (DCP/``get_state_dict`` work) and is refused between :meth:`first_step` and :meth:`second_step`, when
    the parameters are perturbed. ``last_grad_norm``: the norm before clipping (fp32), when clipping ran.

    Differences from ATorch's ``WeightedSAM`` (the paper's formulas are followed): weights are restored from
    a copy rather than by subtracting ``e``; ``max_norm`` clips the gradient the base optimizer uses (ATorch
    clips each pass's gradient); gradients are averaged over an explicit ``replica_group`` (ATorch: the
    whole world, whenever ``torch.distributed`` is initialised); defaults ``gamma=0.9``, ``max_norm=None``.

    Raises:
        ValueError: ``rho < 0``, ``gamma`` outside [0, 1), ``sam_eps < 0``, ``max_norm <= 0``, a nested
            two-pass optimizer, or a built base optimizer over other parameters.
        TypeError: ``base_optimizer`` is neither an optimizer nor a callable, or ``base_kwargs`` were given
            with a built optimizer.
    """

    def __init__(self, params: Iterable[Any] | nn.Module, base_optimizer: Any, rho: float = 0.05,
                 gamma: float = 0.9, sam_eps: float = 1e-12, adaptive: bool = False, decouple: bool = True,
                 max_norm: float | None = None, **base_kwargs: Any):
        _check_hyperparameters(rho, gamma, sam_eps, max_norm)
        self.model = params if isinstance(params, nn.Module) else None
        if self.model is not None:
            params = [p for p in self.model.parameters() if p.requires_grad]
        base = _build_base(params, base_optimizer, base_kwargs, explicit_params=self.model is None)
        self.base_optimizer = base
        self.decouple = bool(decouple)
        self.max_norm = max_norm
        self.last_grad_norm: torch.Tensor | None = None
        self._saved: dict[torch.Tensor, list] = {}  # param -> [w, g] between first_step and second_step
        self._built = False
        # adds WSAM's keys to the base optimizer's group dicts (shared, so one lr schedule drives both)
        super().__init__(base.param_groups, dict(rho=rho, gamma=gamma, sam_eps=sam_eps, adaptive=adaptive))
        self.defaults = {**base.defaults, **self.defaults}
        self.param_groups = base.param_groups
        self.state = base.state
        self._built = True

    # ------------------------------------------------------------------------------------------ passes
    @torch.no_grad()
    def first_step(self, zero_grad: bool = False, replica_group: dist.ProcessGroup | None = None) -> None:
        """Perturb ``w -> w + e`` from the current gradients ``g`` and keep ``w`` and ``g``.

        Args:
            zero_grad: clear the gradients afterwards (the second pass then starts from zero).
            replica_group: the gradients are this replica's own (e.g. the first backward ran under DDP
                ``no_sync``): ``e`` is computed from them, then they are averaged over this group to form
                the ``g`` of the update (per-replica perturbation, SAM's m-sharpness). None: the gradients
                are already the ones to use (averaged by DDP/FSDP, or one process).

        Raises:
            RuntimeError: called again before :meth:`second_step`.
            ValueError: ``replica_group`` with DTensor (FSDP/tensor-parallel) gradients, which are reduced
                by their own mesh already.
        """
        if self._saved:
            raise RuntimeError("WSAM.first_step() was called twice: finish the step with second_step() (or step() "
                               "without a closure) after the backward pass at the perturbed weights.")
        if replica_group is not None and any(isinstance(p.grad, DTensor) for g in self.param_groups
                                             for p in g["params"]):
            raise ValueError("replica_group averages replicated (DDP-style) gradients; DTensor gradients (FSDP, "
                             "tensor parallel) are already reduced over their mesh: call first_step() without it.")
        norm = float(self._perturbation_norm())
        for group in self.param_groups:
            scale = group["rho"] / (norm + group["sam_eps"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                e = p.grad * scale
                if group["adaptive"]:
                    e.mul_(p).mul_(p)
                self._saved[p] = [p.detach().clone(), None]
                p.add_(e)
        if replica_group is not None:
            _average_replicated(list(self._saved), replica_group)
        for p, saved in self._saved.items():
            saved[1] = p.grad.detach().clone()
        if zero_grad:
            self.zero_grad(set_to_none=True)

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False, max_norm: float | None = None) -> None:
        """Restore ``w``, combine ``g`` and the current gradients ``g~`` (taken at ``w + e``) and update.

        Parameters without a first-pass gradient are not updated; a missing second-pass gradient counts as
        zero. Step hooks registered on this optimizer run only through :meth:`step`.

        Args:
            zero_grad: clear the gradients afterwards.
            max_norm: overrides the constructor's ``max_norm`` for this step (TrainStep's ``max_grad_norm``).

        Raises:
            RuntimeError: no :meth:`first_step` before.
        """
        if not self._saved:
            raise RuntimeError("WSAM.second_step() needs first_step() first (and a backward pass at the perturbed "
                               "weights in between).")
        sharpness: dict[torch.Tensor, tuple[torch.Tensor, float]] = {}
        for group in self.param_groups:
            alpha = group["gamma"] / (1.0 - group["gamma"])
            for p in group["params"]:
                saved = self._saved.get(p)
                if saved is None:
                    p.grad = None  # no first-pass gradient: not part of this step
                    continue
                w, g = saved
                p.copy_(w)
                if p.grad is None:
                    p.grad = torch.zeros_like(g)
                if self.decouple:
                    sharpness[p] = (p.grad - g, alpha)
                    p.grad.copy_(g)
                else:  # g + alpha (g~ - g), in place (DDP's gradient may be a bucket view)
                    p.grad.sub_(g).mul_(alpha).add_(g)
        self._saved.clear()
        clip = self.max_norm if max_norm is None else max_norm
        params = [p for group in self.param_groups for p in group["params"]]
        self.last_grad_norm = clip_grad_norm_(params, clip) if clip is not None else None
        self.base_optimizer.step()
        for group in self.param_groups:
            lr = float(group["lr"])
            for p in group["params"]:
                if p in sharpness:
                    h, alpha = sharpness[p]
                    p.add_(h, alpha=-lr * alpha)
        if zero_grad:
            self.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, max_norm: float | None = None) -> Any:
        """One WSAM step; runs the step hooks registered on this optimizer.

        * ``step(closure)``: both passes. ``closure()`` must compute the loss and call ``backward()``; it
          runs at ``w`` and at ``w + e`` (gradients are cleared before each; BatchNorm statistics frozen in
          the second when the model was given). Returns the first pass's loss.
        * ``step()`` after :meth:`first_step` and the second backward: the same as :meth:`second_step`.
        * ``step()`` when every gradient is zero: a base-optimizer step (``e = 0``, so ``g~ = g = 0``); this
          is how ``torch.distributed.checkpoint`` initialises optimizer state.

        Raises:
            ValueError: no closure and no pending :meth:`first_step` (with non-zero gradients).
            RuntimeError: a closure while a :meth:`first_step` is pending.
        """
        if closure is None:
            if self._saved:
                return self.second_step(max_norm=max_norm)
            if self._all_gradients_zero():
                return self.base_optimizer.step()
            raise ValueError(
                "WSAM needs two forward/backward passes per step: call optimizer.step(closure) with a closure "
                "that computes the loss and calls backward(), or first_step() / backward at the perturbed "
                "weights / second_step(). With auto_accelerate use res.train_step, which does both.")
        if self._saved:
            raise RuntimeError("WSAM.step(closure) while a first_step() is pending: call second_step() first.")
        no_sync, replica_group = self._replica_context()
        self.zero_grad(set_to_none=True)
        with torch.enable_grad(), no_sync:
            loss = closure()
        self.first_step(zero_grad=True, replica_group=replica_group)
        with torch.enable_grad(), frozen_running_stats(self.model):
            closure()
        self.second_step(max_norm=max_norm)
        return loss

    # ------------------------------------------------------------------------------------------ state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the base optimizer (with its defaults) and WSAM's defaults to it."""
        if not self._built:  # called by Optimizer.__init__ on the base optimizer's own groups
            return super().add_param_group(param_group)
        self.base_optimizer.add_param_group(param_group)
        for k in ("rho", "gamma", "sam_eps", "adaptive"):
            self.param_groups[-1].setdefault(k, self.defaults[k])

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state and groups (with WSAM's hyperparameters in the groups).

        Raises:
            RuntimeError: called between :meth:`first_step` and :meth:`second_step`.
        """
        if self._saved:
            raise RuntimeError("WSAM.state_dict() between first_step() and second_step(): the parameters are "
                               "perturbed; save at step boundaries.")
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into this optimizer and hand the loaded state and groups to the base optimizer."""
        super().load_state_dict(state_dict)
        self.base_optimizer.__setstate__({"state": self.state, "param_groups": self.param_groups})
        self.state, self.param_groups = self.base_optimizer.state, self.base_optimizer.param_groups

    # ------------------------------------------------------------------------------------------ helpers
    def _perturbation_norm(self) -> torch.Tensor:
        """||g|| (or ||w * g|| for adaptive groups) over all parameters, DTensor shards included (fp32)."""
        items = [(_Grad(p.abs() * p.grad) if group["adaptive"] else p)
                 for group in self.param_groups for p in group["params"] if p.grad is not None]
        return global_grad_norm(items)

    def _all_gradients_zero(self) -> bool:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        local = [(x.to_local() if isinstance(x, DTensor) else x) for x in grads]
        return bool(grads) and all(not torch.count_nonzero(x) for x in local)

    def _replica_context(self) -> tuple[Any, dist.ProcessGroup | None]:
        """DDP model: run the first closure without gradient sync and average after the perturbation."""
        m = self.model
        if isinstance(m, DistributedDataParallel) and not getattr(m, "static_graph", False) \
                and dist.get_world_size(m.process_group) > 1:
            return m.no_sync(), m.process_group
        return contextlib.nullcontext(), None


# --------------------------------------------------------------------------------------------- functions
@contextlib.contextmanager
def frozen_running_stats(model: nn.Module | None):
    """Keep the running statistics of normalisation layers (BatchNorm, SyncBatchNorm, tracked InstanceNorm:
    ``running_mean``, ``running_var``, ``num_batches_tracked``) unchanged inside the block, so WSAM's
    second forward does not count the batch twice. ``None``: does nothing."""
    saved = []
    if model is not None:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
                saved += [(b, b.detach().clone()) for b in (m.running_mean, m.running_var, m.num_batches_tracked)
                          if isinstance(b, torch.Tensor)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, copy in saved:
                buf.copy_(copy)


def _average_replicated(params: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Average plain (replicated) gradients over ``group``: one all-reduce per dtype/device."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    grads = [p.grad for p in params]
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for bucket in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)  # SUM then divide: ReduceOp.AVG is NCCL-only
        flat.div_(world)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _check_hyperparameters(rho, gamma, sam_eps, max_norm) -> None:
    if not rho >= 0.0:
        raise ValueError(f"WSAM rho must be >= 0 (the perturbation radius), got {rho}.")
    if not 0.0 <= gamma < 1.0:
        raise ValueError(f"WSAM gamma must be in [0, 1) (alpha = gamma / (1 - gamma); 0.5 is SAM), got {gamma}.")
    if not sam_eps >= 0.0:
        raise ValueError(f"WSAM sam_eps must be >= 0, got {sam_eps}.")
    if max_norm is not None and not (max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"WSAM max_norm must be a positive number or None, got {max_norm}.")


def _build_base(params, base_optimizer, base_kwargs: dict, explicit_params: bool) -> torch.optim.Optimizer:
    """The base optimizer: built from a class/factory, or checked when given built."""
    if isinstance(base_optimizer, torch.optim.Optimizer):
        if base_kwargs:
            raise TypeError(f"WSAM got a built base optimizer and also {sorted(base_kwargs)}: set these on the "
                            f"optimizer, or pass its class (e.g. torch.optim.{type(base_optimizer).__name__}).")
        base = base_optimizer
        if explicit_params:
            given = {id(p) for p in _flatten_params(params)}
            owned = {id(p) for g in base.param_groups for p in g["params"]}
            if given != owned:
                raise ValueError("WSAM's params and the built base optimizer's parameters differ: pass the same "
                                 "parameters (or the model), or pass the optimizer class instead.")
    elif callable(base_optimizer):
        params = list(params)
        # DTensor and plain parameters in one list: foreach kernels reject it (as auto_accelerate does for
        # optim_func, which cannot see through WSAM's **base_kwargs)
        base_kwargs, _ = foreach_safe_args(base_optimizer, _flatten_params(params), base_kwargs)
        try:
            base = base_optimizer(params, **base_kwargs)
        except TypeError as e:
            raise TypeError(f"could not build the base optimizer {getattr(base_optimizer, '__name__', base_optimizer)}"
                            f" with {base_kwargs}: {e}") from e
        if not isinstance(base, torch.optim.Optimizer):
            raise TypeError(f"base_optimizer must return a torch.optim.Optimizer, got {type(base).__name__}.")
    else:
        raise TypeError(f"base_optimizer must be an optimizer class, a factory fn(params, **kwargs) or a built "
                        f"optimizer, got {base_optimizer!r}.")
    if callable(getattr(base, "first_step", None)):
        raise ValueError(f"the base optimizer {type(base).__name__} is itself a two-pass (SAM-like) optimizer; WSAM "
                         "wraps a one-pass optimizer such as SGD or AdamW.")
    return base


def _flatten_params(params) -> list[torch.Tensor]:
    out = []
    for item in params:
        out.extend(item["params"] if isinstance(item, dict) else [item])
    return out


#: ATorch's name (``atorch.optimizers.wsam.WeightedSAM(model, base_optimizer, ...)``), so its code runs unchanged
WeightedSAM = WSAM

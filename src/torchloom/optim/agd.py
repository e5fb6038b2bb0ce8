"""AGD: an Auto-switchable optimizer using stepwise Gradient Difference for the preconditioning matrix.

Yue, Ye, Jiang, Liu, Zhang, NeurIPS 2023, https://arxiv.org/abs/2312.01658 (Algorithm 1). Official code:
ATorch ``atorch/optimizers/agd.py`` (DLRover) and the authors' repository; see :class:`AGD` for where
this implementation follows the paper rather than that code.
"""
from __future__ import annotations

from collections import defaultdict
from numbers import Real
from typing import Any, Callable, Iterable

import torch
from torch.optim.optimizer import Optimizer, _default_to_fused_or_foreach

__all__ = ["AGD"]

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class AGD(Optimizer):
    r"""AGD (Yue et al., NeurIPS 2023): Adam-like, preconditioned by the stepwise difference of the
    bias-corrected first moments, with a per-coordinate switch to momentum SGD.

    For every parameter :math:`x` with gradient :math:`g_t` at step :math:`t = 1, 2, ...` (paper,
    Algorithm 1; :math:`\alpha` = ``lr``, :math:`\lambda` = ``weight_decay``):

    .. math::
        m_t &= \beta_1 m_{t-1} + (1-\beta_1)\, g_t, \qquad \hat m_t = m_t / (1-\beta_1^t) \\
        s_t &= \hat m_t - \hat m_{t-1} \quad (t > 1), \qquad s_1 = \hat m_1 = g_1 \\
        b_t &= \beta_2 b_{t-1} + (1-\beta_2)\, s_t^2, \qquad \hat b_t = b_t / (1-\beta_2^t) \\
        x_{t+1} &= x_t - \alpha\, \hat m_t / \max(\sqrt{\hat b_t}, \delta)

    (the paper writes the last line as :math:`\alpha \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}
    \frac{m_t}{\max(\sqrt{b_t}, \delta\sqrt{1-\beta_2^t})}`, the same quantity). Where
    :math:`\sqrt{\hat b_t} \le \delta` the step is momentum SGD with learning rate :math:`\alpha/\delta`;
    elsewhere it is adaptive. Options:

    - ``weight_decay`` with ``weight_decouple=True`` (default): decoupled, AdamW-style,
      :math:`x_t \leftarrow x_t (1 - \alpha\lambda)` before the step (:math:`1-\lambda` with
      ``fixed_decay=True``); with ``weight_decouple=False``: L2, :math:`g_t \leftarrow g_t + \lambda x_t`
      before the moments (``p.grad`` itself is left unchanged).
    - ``amsgrad``: :math:`b_t` is replaced by :math:`\max_{k \le t} b_k` in the denominator
      (as ``torch.optim.Adam`` does; bias-corrected with :math:`1-\beta_2^t`).
    - ``clip``: every coordinate of :math:`\hat m_t / \max(\sqrt{\hat b_t}, \delta)` is clamped to
      ``[-clip, clip]``, so no coordinate moves by more than ``lr * clip`` per step.
    - ``maximize``: ascend, i.e. use :math:`-g_t`.

    Differences from the official code (this class follows the paper; both agree on :math:`s_1 = g_1`, on
    :math:`\delta` entering as :math:`\delta\sqrt{1-\beta_2^t}` against :math:`\sqrt{b_t}`, and on the
    bias corrections): ATorch clamps :math:`m_t/\max(\sqrt{b_t}, \delta\sqrt{1-\beta_2^t})`, which is the
    clipped quantity above times :math:`(1-\beta_1^t)/\sqrt{1-\beta_2^t}` (3.2 at t = 1, 6.5 at t = 10 with
    the default betas), so its ``clip`` is tighter early and the same once the bias corrections approach
    1, whereas here ``clip`` bounds the step in units of ``lr`` at every step; ATorch's L2 mode adds the
    decay to ``p.grad`` in place; ATorch's ``win`` (Win acceleration, not in the paper) is not implemented.

    Recommended settings (paper, ATorch README): ``delta=1e-14`` and ``lr`` about a tenth of AdamW's for
    Transformers; the default ``delta=1e-5`` for CV/RecSys models; ``clip=5`` if training is unstable.

    Args:
        params: parameters or parameter-group dicts (every option may be set per group).
        lr: learning rate :math:`\alpha` (>= 0).
        betas: :math:`(\beta_1, \beta_2)`, each in [0, 1).
        delta: :math:`\delta` (> 0), the switch threshold between momentum SGD and the adaptive step.
        weight_decay: :math:`\lambda` (>= 0).
        weight_decouple: decoupled (AdamW) weight decay if True, L2 regularisation if False.
        fixed_decay: with decoupled decay, multiply by :math:`1-\lambda` instead of :math:`1-\alpha\lambda`.
        amsgrad: use the running maximum of :math:`b_t`.
        clip: None, or the bound (> 0) on every coordinate of the normalised step.
        foreach: batch each group with ``torch._foreach_*`` kernels; None: on when every parameter is on an
            accelerator (as torch's optimizers decide). Same operations as the per-tensor loop: bitwise
            equal on CPU (tested); GPU foreach kernels may round the last bit differently. Lists mixing
            plain tensors and DTensors (tensor parallelism) are split into homogeneous sub-lists.
        maximize: maximise the objective.
        win: accepted for ATorch compatibility; only False is supported.

    State per parameter (ATorch's names, so its checkpoints load): ``exp_avg`` (:math:`m_t`),
    ``exp_avg_sq`` (:math:`b_t`), ``max_exp_avg_sq`` (amsgrad only), all shaped and typed like the
    parameter (DTensor shards for FSDP2/TP parameters); ``step``, a float32 0-dim CPU tensor counting the
    steps this parameter took (parameters without a gradient are skipped and do not count).

    Raises:
        ValueError: an option out of range (message names the option and its valid range).
        RuntimeError: (at step) a sparse gradient or a complex parameter.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 delta: float = 1e-5, weight_decay: float = 0.0, weight_decouple: bool = True,
                 fixed_decay: bool = False, amsgrad: bool = False, clip: float | None = None,
                 foreach: bool | None = None, maximize: bool = False, win: bool = False) -> None:
        defaults = dict(lr=lr, betas=betas, delta=delta, weight_decay=weight_decay, weight_decouple=weight_decouple,
                        fixed_decay=fixed_decay, amsgrad=amsgrad, clip=clip, foreach=foreach, maximize=maximize,
                        win=win)
        _check_options(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its options (missing ones taken from the defaults) are validated."""
        super().add_param_group(param_group)
        _check_options(self.param_groups[-1])

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        missing = dict(weight_decouple=True, fixed_decay=False, amsgrad=False, clip=None, foreach=None,
                       maximize=False, win=False)
        for group in self.param_groups:  # groups pickled before an option existed
            for key, value in missing.items():
                group.setdefault(key, value)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AGD step for every parameter that has a gradient.

        Args:
            closure: optional; re-evaluates the model and returns the loss (run with grad enabled).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                self._init_state(p, group["amsgrad"])
            foreach = group["foreach"]
            if foreach is None:
                _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
            for p in params:
                self.state[p]["step"] += 1
            if foreach:
                for batch in _homogeneous_batches(params, self.state).values():
                    self._update_foreach(batch, group)
            else:
                for p in params:
                    self._update_single(p, group)
        return loss

    def _init_state(self, p: torch.Tensor, amsgrad: bool) -> None:
        if p.grad.is_sparse:
            raise RuntimeError("AGD does not support sparse gradients; use dense gradients (e.g. "
                               "nn.Embedding(sparse=False)).")
        if torch.is_complex(p):
            raise RuntimeError("AGD does not support complex parameters; optimise torch.view_as_real(p) instead.")
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update_single(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        """The per-tensor path; :meth:`_update_foreach` runs the same operations in the same order."""
        state = self.state[p]
        k = _Coefficients(group, int(state["step"].item()))
        m, b = state["exp_avg"], state["exp_avg_sq"]
        g = p.grad.neg() if group["maximize"] else p.grad
        if k.l2:
            g = g.add(p, alpha=k.l2)
        if k.decay:
            p.add_(p, alpha=-k.decay)  # p * (1 - decay); see _update_foreach for why not mul_
        s = m.mul(k.neg_inv_bc1_prev)  # -m_{t-1} / (1 - beta1^(t-1)); zero at t = 1
        m.lerp_(g, k.one_minus_beta1)
        s.add_(m, alpha=k.inv_bc1)  # s_t = m_t / (1 - beta1^t) - m_{t-1} / (1 - beta1^(t-1))
        b.lerp_(s.mul_(s), k.one_minus_beta2)  # b_t = beta2 b_{t-1} + (1 - beta2) s_t^2
        del s
        if group["amsgrad"]:
            b = torch.maximum(state["max_exp_avg_sq"], b, out=state["max_exp_avg_sq"])
        denom = b.sqrt().div_(k.sqrt_bc2).clamp_min_(k.delta)  # max(sqrt(b_hat), delta)
        if group["clip"] is None:
            p.addcdiv_(m, denom, value=-k.lr_over_bc1)
        else:
            direction = m.mul(k.inv_bc1).div_(denom).clamp_(-group["clip"], group["clip"])
            p.add_(direction, alpha=-k.lr)

    def _update_foreach(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """``torch._foreach_*`` version of :meth:`_update_single` for tensors of one layout and step count.

        No in-place multiplication by a Python scalar: on CPU, ``_foreach_mul_(bf16/fp16 list, scalar)``
        rounds the scalar to the tensor dtype first, unlike ``Tensor.mul_`` (torch 2.13), which would make
        the two paths differ; out-of-place ``_foreach_mul``, ``add_(alpha=)`` and ``lerp_`` agree."""
        states = [self.state[p] for p in params]
        k = _Coefficients(group, int(states[0]["step"].item()))
        ms = [s["exp_avg"] for s in states]
        bs = [s["exp_avg_sq"] for s in states]
        grads = [p.grad for p in params]
        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        if k.l2:
            grads = torch._foreach_add(grads, params, alpha=k.l2)
        if k.decay:
            torch._foreach_add_(params, params, alpha=-k.decay)
        diffs = torch._foreach_mul(ms, k.neg_inv_bc1_prev)
        torch._foreach_lerp_(ms, grads, k.one_minus_beta1)
        torch._foreach_add_(diffs, ms, alpha=k.inv_bc1)
        torch._foreach_mul_(diffs, diffs)
        torch._foreach_lerp_(bs, diffs, k.one_minus_beta2)
        del diffs, grads
        if group["amsgrad"]:
            maxes = [s["max_exp_avg_sq"] for s in states]
            torch._foreach_maximum_(maxes, bs)
            bs = maxes
        denoms = torch._foreach_sqrt(bs)
        torch._foreach_div_(denoms, k.sqrt_bc2)
        torch._foreach_clamp_min_(denoms, k.delta)
        if group["clip"] is None:
            torch._foreach_addcdiv_(params, ms, denoms, value=-k.lr_over_bc1)
        else:
            directions = torch._foreach_mul(ms, k.inv_bc1)
            torch._foreach_div_(directions, denoms)
            torch._foreach_clamp_min_(directions, -group["clip"])
            torch._foreach_clamp_max_(directions, group["clip"])
            torch._foreach_add_(params, directions, alpha=-k.lr)


class _Coefficients:
    """Python-float scalars of one step ``t`` for one group (the same in both update paths)."""

    def __init__(self, group: dict[str, Any], t: int) -> None:
        beta1, beta2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        bc1, bc2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
        self.lr, self.delta = lr, group["delta"]
        self.one_minus_beta1, self.one_minus_beta2 = 1.0 - beta1, 1.0 - beta2
        self.inv_bc1 = 1.0 / bc1
        self.lr_over_bc1 = lr / bc1
        self.sqrt_bc2 = bc2 ** 0.5
        # s_1 = m_1 / (1 - beta1): the previous moment term is dropped at t = 1 (its 1 - beta1^0 is zero)
        self.neg_inv_bc1_prev = 0.0 if t == 1 else -1.0 / (1.0 - beta1 ** (t - 1))
        decoupled = group["weight_decouple"]
        self.l2 = 0.0 if decoupled else wd
        # decoupled decay multiplies the parameter by 1 - decay
        self.decay = (wd if group["fixed_decay"] else lr * wd) if decoupled else 0.0


def _layout_key(p: torch.Tensor) -> tuple:
    """Tensors with equal keys can share one foreach call (DTensors only with DTensors of one layout)."""
    spec = getattr(p, "_spec", None)
    if spec is not None:  # DTensor
        return ("dtensor", spec.mesh, tuple(spec.placements), p.dtype)
    return ("tensor", p.device, p.dtype)


def _homogeneous_batches(params: list[torch.Tensor], state) -> dict[tuple, list[torch.Tensor]]:
    batches: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        batches[(_layout_key(p), int(state[p]["step"].item()))].append(p)
    return batches


def _check_options(options: dict[str, Any]) -> None:
    """Raise ValueError naming the first option out of range."""
    def bad(name: str, want: str) -> ValueError:
        return ValueError(f"AGD: {name}={options[name]!r} is invalid; {want}.")

    def number(name: str) -> bool:
        v = options[name]
        return isinstance(v, Real) and not isinstance(v, bool) and v == v

    if not number("lr") or options["lr"] < 0:
        raise bad("lr", "use a learning rate >= 0 (the paper suggests about a tenth of AdamW's)")
    betas = options["betas"]
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(isinstance(x, Real) and 0.0 <= x < 1.0 for x in betas)):
        raise bad("betas", "use two floats in [0, 1), e.g. (0.9, 0.999)")
    if not number("delta") or options["delta"] <= 0:
        raise bad("delta", "use delta > 0 (1e-14 for Transformers, 1e-5 for CV/RecSys models)")
    if not number("weight_decay") or options["weight_decay"] < 0:
        raise bad("weight_decay", "use weight_decay >= 0")
    clip = options["clip"]
    if clip is not None and (not isinstance(clip, Real) or isinstance(clip, bool) or not clip > 0):
        raise bad("clip", "use None (no clipping) or a bound > 0, e.g. 5")
    if options["foreach"] not in (None, True, False):
        raise bad("foreach", "use None (automatic), True or False")
    if options["win"]:
        raise ValueError("AGD: win=True (ATorch's Win acceleration) is not implemented; use win=False.")

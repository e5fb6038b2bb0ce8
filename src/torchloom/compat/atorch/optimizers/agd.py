"""``atorch.optimizers.agd.AGD`` on torchloom's :class:`torchloom.optim.AGD`.

ATorch's argument names, positional order, defaults, validation messages and exception types; ATorch's
``clip`` and L2-decay semantics (see :class:`AGD`). docs/compat_atorch.md, section "Optimizers", lists
every difference from ATorch.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from ....optim.agd import AGD as _NativeAGD

__all__ = ("AGD",)


class AGD(_NativeAGD):
    r"""ATorch's AGD: ``AGD(params, lr=1e-3, betas=(0.9, 0.999), delta=1e-5, weight_decay=0.0,
    weight_decouple=True, fixed_decay=False, amsgrad=False, win=False, clip=None)``.

    The update is :class:`torchloom.optim.AGD`'s (the paper's Algorithm 1, equal to ATorch's to rounding),
    with ATorch's semantics where the native class differs:

    - ``clip`` bounds ATorch's quantity :math:`m_t / \max(\sqrt{b_t}, \delta\sqrt{1-\beta_2^t})` (not
      bias-corrected) to ``[-clip, clip]``; the native ``clip`` bounds the bias-corrected step instead, so
      here it is translated at every step to ``clip * sqrt(1 - beta2^t) / (1 - beta1^t)``.
    - L2 decay (``weight_decouple=False``, ``weight_decay > 0``) adds ``weight_decay * p`` to ``p.grad``
      in place, as ATorch does (the native class leaves ``p.grad`` unchanged).

    Args: as ATorch's (per-group overrides work for every option).

    Raises:
        ValueError: ATorch's conditions and messages (``lr <= 0``: "Invalid learning rate", ``delta < 0``,
            ``betas`` outside [0, 1), ``weight_decay < 0``); ``win=True``; ``delta == 0`` and
            ``clip <= 0`` (accepted by ATorch, refused here: see docs/compat_atorch.md).
        RuntimeError: (at step) a sparse gradient.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 delta: float = 1e-5, weight_decay: float = 0.0, weight_decouple: bool = True,
                 fixed_decay: bool = False, amsgrad: bool = False, win: bool = False,
                 clip: float | None = None) -> None:
        _check_atorch_options(lr, betas, delta, weight_decay, win)
        super().__init__(params, lr=lr, betas=betas, delta=delta, weight_decay=weight_decay,
                         weight_decouple=weight_decouple, fixed_decay=fixed_decay, amsgrad=amsgrad, clip=clip)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; ``win=True`` in it is refused with the same message as in the constructor."""
        if param_group.get("win"):
            raise ValueError(_WIN_MESSAGE)
        super().add_param_group(param_group)

    def _update_single(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        group = self._native_group(group, int(self.state[p]["step"].item()), [p])
        super()._update_single(p, group)

    def _update_foreach(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        # the native class batches parameters of one step count per call
        group = self._native_group(group, int(self.state[params[0]]["step"].item()), params)
        super()._update_foreach(params, group)

    @staticmethod
    def _native_group(group: dict[str, Any], t: int, params: list[torch.Tensor]) -> dict[str, Any]:
        """The group options that make the native update equal ATorch's at step ``t``; applies ATorch's
        in-place L2 decay to the gradients of ``params``."""
        changes: dict[str, Any] = {}
        if group["win"]:  # set on a group after construction
            raise ValueError(_WIN_MESSAGE)
        if not group["weight_decouple"] and group["weight_decay"] != 0:
            for p in params:
                p.grad.add_(p, alpha=group["weight_decay"])  # ATorch: grad.add_(p.data, alpha=weight_decay)
            changes["weight_decay"] = 0.0
        if group["clip"] is not None:
            beta1, beta2 = group["betas"]
            changes["clip"] = group["clip"] * (1.0 - beta2 ** t) ** 0.5 / (1.0 - beta1 ** t)
        return {**group, **changes} if changes else group


_WIN_MESSAGE = (
    "AGD: win=True (ATorch's Win variant) is not supported by torchloom.compat.atorch: ATorch's Win "
    "update starts its auxiliary sequence z at zero, so the first step shrinks every weight to about a "
    "third (x_1 = (x_0 + 2 z_1 - 2 lr u) / 3 with z_1 = -lr u); use win=False (the AGD paper's algorithm).")


def _check_atorch_options(lr, betas, delta, weight_decay, win) -> None:
    """ATorch's checks, in its order and with its messages; then the options ATorch takes but torchloom
    refuses, each with the reason and what to use instead."""
    if lr <= 0.0:
        raise ValueError("Invalid learning rate: {}".format(lr))
    if delta < 0.0:
        raise ValueError("Invalid delta value: {}".format(delta))
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError("Invalid beta parameter at index 0: {}".format(betas[0]))
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError("Invalid beta parameter at index 1: {}".format(betas[1]))
    if weight_decay < 0.0:
        raise ValueError("Invalid weight_decay value: {}".format(weight_decay))
    if delta == 0.0:
        raise ValueError("Invalid delta value: 0 is not supported (ATorch accepts it, but its update is then "
                         "0/0 = NaN wherever a coordinate's gradient has stayed zero); use delta=1e-14 for "
                         "Transformers or the default 1e-5.")
    if win:
        raise ValueError(_WIN_MESSAGE)

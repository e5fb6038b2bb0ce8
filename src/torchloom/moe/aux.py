"""Auxiliary MoE losses and how their gradient reaches the parameters.

* :func:`load_balancing_loss`: Switch Transformer (Fedus et al. 2021) eq. 4-6 / GShard (Lepikhin et al. 2020):
  ``E * sum_e f_e * P_e``.
* :func:`router_z_loss`: ST-MoE (Zoph et al. 2022) eq. 5: ``mean_t logsumexp(logits_t)^2``.
* :class:`MoEAuxLossAutoScaler` (Megatron-Core's ``MoEAuxLossAutoScaler``): the aux loss rides on the MoE
  layer's output. Forward returns the output unchanged; backward passes ``grad_output`` through and gives the
  aux loss the gradient :func:`aux_scale`, read *at backward time*. So no code has to collect the aux losses
  and add them to the loss: a plain ``loss.backward()`` trains on ``loss + sum(weight * aux)`` (scale 1.0),
  and pipeline stages and activation checkpointing need nothing special. A loop that divides its loss (grad
  accumulation, fp16 loss scaling) sets the same factor with :func:`aux_loss_scale`; ``TrainStep`` does.

The scale is process-wide (not thread-local): autograd may run backward on its own device threads.
"""
from __future__ import annotations

import contextlib
import threading

import torch

_lock = threading.Lock()
_scale = 1.0


def aux_scale() -> float:
    """The factor the aux losses' gradient gets in backward (default 1.0)."""
    return _scale


def set_aux_scale(scale: float) -> float:
    """Set the aux-loss gradient factor; returns the previous one. Prefer :func:`aux_loss_scale`."""
    global _scale
    scale = float(scale)
    if not scale == scale or scale in (float("inf"), float("-inf")):
        raise ValueError(f"the MoE aux-loss scale must be finite, got {scale}")
    with _lock:
        old, _scale = _scale, scale
    return old


@contextlib.contextmanager
def aux_loss_scale(scale: float):
    """Within the block, backward gives the MoE aux losses the gradient ``scale`` (e.g. ``1 / accum`` when the
    main loss is divided by the accumulation steps, times the fp16 loss scale). Restores the previous scale."""
    old = set_aux_scale(scale)
    try:
        yield
    finally:
        set_aux_scale(old)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """``apply(output, aux_loss) -> output``: attaches the 0-dim ``aux_loss`` to ``output``'s graph; backward
    returns ``(grad_output, aux_scale() * ones)`` (Megatron-Core ``moe_utils.MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, aux_scale())


def load_balancing_loss(probs: torch.Tensor, indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch / GShard load-balancing loss ``E * sum_e f_e * P_e`` (0-dim, fp32 if ``probs`` is).

    Args:
        probs: ``[T, E]`` router probabilities per token (rows sum to 1: softmax over all experts, or the
            normalised sigmoid scores).
        indices: ``[T, k]`` int64 selected experts *before* capacity dropping.
        num_experts: ``E``.

    ``f_e = #{(t, j): indices[t, j] == e} / (T * k)`` (no gradient), ``P_e = mean_t probs[t, e]``; the value is 1
    for perfectly uniform routing whatever k is. (Hugging Face's ``load_balancing_loss_func`` divides the
    counts by ``T`` instead, so its value is ``k`` times this one.) 0 for ``T == 0``.
    """
    t, k = indices.shape
    if t == 0:
        return probs.sum() * 0.0
    counts = torch.bincount(indices.reshape(-1), minlength=num_experts)[:num_experts]
    f = counts.to(probs.dtype) / float(t * k)
    return num_experts * torch.sum(f * probs.mean(dim=0))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss ``mean_t logsumexp(logits_t)^2`` of ``[T, E]`` logits (0-dim; 0 for ``T == 0``)."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits, dim=-1).square().mean()

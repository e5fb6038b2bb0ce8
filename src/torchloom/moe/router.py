"""`TopKRouter`: token -> top-k experts, with optional capacity dropping."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig


class Routing(NamedTuple):
    """One routing decision for ``T`` tokens (see :meth:`TopKRouter.route`)."""

    weights: torch.Tensor  # [T, k] combine weights, x's dtype; 0 where dropped
    indices: torch.Tensor  # [T, k] int64 experts; E (protocol.dropped) where dropped
    logits: torch.Tensor  # [T, E] router_dtype
    probs: torch.Tensor  # [T, E] router_dtype, rows sum to 1 (the P of the load-balancing loss)
    selected: torch.Tensor  # [T, k] int64 experts before capacity dropping (the f of the load-balancing loss)


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Per-expert capacity ``ceil(capacity_factor * tokens * top_k / num_experts)`` (GShard / Switch)."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def keep_within_capacity(selected: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """``[T, k]`` bool: which assignments fit each expert's capacity ``cap``. Priority: every token's first
    choice before any second choice, and so on; within one choice rank, token order (GShard sec. 3.2,
    Switch Transformer sec. 2.2). Deterministic (a cumulative count, no sort)."""
    t, k = selected.shape
    by_priority = selected.t().reshape(-1)  # choice-major: all first choices, then all second choices...
    onehot = F.one_hot(by_priority, num_experts)  # [k*T, E]
    position = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1  # 0-based slot in the chosen expert
    return (position < cap).reshape(k, t).t()


class TopKRouter(nn.Module):
    """Linear gate ``[E, D]`` then top-k selection, following :class:`MoEConfig`.

    Scores: ``softmax`` with ``softmax_before_topk`` (softmax over E, top-k, optional renormalisation:
    Mixtral / GShard), ``softmax`` without (top-k of the logits, softmax over those k), or ``sigmoid``
    (top-k of ``sigmoid(logits)``, optional renormalisation: DeepSeek-V3). The math runs in
    ``config.router_dtype`` with autocast disabled. With ``capacity_factor`` the assignments over capacity are
    dropped (:func:`keep_within_capacity`): index ``E`` and weight 0. Deterministic.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.config.init_std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, D] -> (weights [T, k] in x's dtype, indices [T, k] int64, logits [T, E] router_dtype)``;
        dropped assignments have index ``E`` and weight 0."""
        r = self.route(x)
        return r.weights, r.indices, r.logits

    def route(self, x: torch.Tensor) -> Routing:
        """The full decision for ``x [T, D]`` (also the probabilities and pre-drop choices the aux losses need).

        Raises:
            ValueError: ``x`` is not 2-D with ``D`` columns.
        """
        c = self.config
        if x.dim() != 2 or x.shape[1] != c.dim:
            raise ValueError(f"TopKRouter expects x of shape [T, {c.dim}], got {tuple(x.shape)}")
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(c.router_dtype), self.weight.to(c.router_dtype))
            if c.score_func == "sigmoid":
                scores = torch.sigmoid(logits)
                top, selected = torch.topk(scores, self.top_k, dim=-1)
                probs = scores / scores.sum(dim=-1, keepdim=True)  # DeepSeek-V3's normalised affinities
                weights = top / top.sum(dim=-1, keepdim=True) if c.norm_topk_prob else top
            elif c.softmax_before_topk:
                probs = torch.softmax(logits, dim=-1)
                top, selected = torch.topk(probs, self.top_k, dim=-1)
                weights = top / top.sum(dim=-1, keepdim=True) if c.norm_topk_prob else top
            else:
                probs = torch.softmax(logits, dim=-1)
                top_logits, selected = torch.topk(logits, self.top_k, dim=-1)
                weights = torch.softmax(top_logits, dim=-1)
        indices = selected
        if c.capacity_factor is not None:
            keep = keep_within_capacity(selected, self.num_experts,
                                        capacity(x.shape[0], self.top_k, self.num_experts, c.capacity_factor))
            indices = torch.where(keep, selected, torch.full_like(selected, self.num_experts))
            weights = weights * keep.to(weights.dtype)
        return Routing(weights.to(x.dtype), indices, logits, probs, selected)

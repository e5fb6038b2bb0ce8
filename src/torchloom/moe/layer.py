"""`MoE`: router -> experts (+ shared experts), with the aux losses attached to the output's graph."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .aux import MoEAuxLossAutoScaler, load_balancing_loss, router_z_loss
from .config import MoEConfig
from .experts import GroupedExperts
from .router import TopKRouter

AUX_NAMES = ("load_balance_loss", "z_loss")  # keys of the recorded aux values (weighted)


def in_backward() -> bool:
    """True while autograd runs a backward pass: a forward now is activation-checkpoint recomputation, which
    must not be recorded a second time (the routing is the same: recomputation is deterministic)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)  # private; present since torch 1.13
    return task_id is not None and task_id() != -1


class SwiGLU(nn.Module):
    """Dense ``w2(silu(w1 x) * w3 x)`` MLP: the shared experts (DeepSeekMoE / Qwen2-MoE, without Qwen's
    sigmoid gate on the shared output)."""

    def __init__(self, dim: int, hidden_dim: int, init_std: float = 0.02):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; a method so meta-device materialisation replays it (after the
        Linear children's own init, as the plain build runs them)."""
        for lin in (self.w1, self.w2, self.w3):
            nn.init.normal_(lin.weight, std=self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """A Mixture-of-Experts layer ``[..., D] -> [..., D]`` (same dtype), configured by :class:`MoEConfig`.

    Submodules: ``router`` (:class:`TopKRouter`), ``experts`` (:class:`GroupedExperts`, the protocol module
    expert parallelism shards) and ``shared`` (:class:`SwiGLU` or None).

    The weighted aux losses (``aux_loss_weight * load_balancing_loss + z_loss_weight * router_z_loss``,
    computed per call over the call's tokens, as HF / Megatron do per micro-batch and rank) reach the gradient
    through :class:`~torchloom.moe.aux.MoEAuxLossAutoScaler` on the output, with the factor
    :func:`~torchloom.moe.aux.aux_scale` at backward time (1.0 unless set).

    Recorded after each forward (not during checkpoint recomputation), detached, on the input's device:
    ``last_aux`` (dict of the weighted values, keys in ``AUX_NAMES`` whose weight is > 0), ``last_load``
    ([E] int64 assignments per expert on this rank *before* dropping), ``last_dropped`` ([E] int64 assignments
    dropped by the capacity limit); and window sums since :meth:`reset_window` (``window_aux``,
    ``window_forwards``, ``window_load``, ``window_dropped``) that ``TrainStep`` reports per optimizer step.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.router = TopKRouter(config)
        self.experts = GroupedExperts(config.num_experts, config.dim, config.hidden_dim, config.init_std)
        self.shared = (SwiGLU(config.dim, config.num_shared_experts * config.hidden_dim, config.init_std)
                       if config.num_shared_experts else None)
        self.last_aux: dict[str, torch.Tensor] = {}
        self.last_load: torch.Tensor | None = None
        self.last_dropped: torch.Tensor | None = None
        self.reset_window()

    def reset_window(self) -> None:
        """Zero the window sums (``TrainStep`` calls it after each optimizer step)."""
        self.window_aux: dict[str, torch.Tensor] = {}
        self.window_forwards = 0
        self.window_load: torch.Tensor | None = None
        self.window_dropped: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if x.shape[-1] != c.dim:
            raise ValueError(f"MoE expects inputs of shape [..., {c.dim}], got {tuple(x.shape)}")
        h = x.reshape(-1, c.dim)
        r = self.router.route(h)
        out = self.experts(h, r.indices, r.weights)
        if self.shared is not None:
            out = out + self.shared(h)
        aux = {}
        if c.aux_loss_weight > 0:
            aux["load_balance_loss"] = c.aux_loss_weight * load_balancing_loss(r.probs, r.selected, c.num_experts)
        if c.z_loss_weight > 0:
            aux["z_loss"] = c.z_loss_weight * router_z_loss(r.logits)
        if aux and torch.is_grad_enabled():
            out = MoEAuxLossAutoScaler.apply(out, sum(aux.values()))
        if not in_backward():
            self._record(aux, r.selected, r.indices)
        return out.reshape(x.shape)

    @torch.no_grad()
    def _record(self, aux: dict[str, torch.Tensor], selected: torch.Tensor, indices: torch.Tensor) -> None:
        e = self.config.num_experts
        self.last_aux = {k: v.detach().float() for k, v in aux.items()}
        self.last_load = torch.bincount(selected.reshape(-1), minlength=e)[:e]
        routed = torch.bincount(indices.reshape(-1), minlength=e + 1)[:e]
        self.last_dropped = self.last_load - routed
        for k, v in self.last_aux.items():
            self.window_aux[k] = self.window_aux[k] + v if k in self.window_aux else v.clone()
        self.window_forwards += 1
        self.window_load = self.last_load.clone() if self.window_load is None else self.window_load + self.last_load
        self.window_dropped = (self.last_dropped.clone() if self.window_dropped is None
                               else self.window_dropped + self.last_dropped)

"""Reading what the MoE layers recorded: aux losses, per-expert token counts, and a tracker for any
experts-protocol module (Hugging Face Mixtral / Qwen-MoE included)."""
from __future__ import annotations

import torch
from torch import nn

from .layer import MoE, in_backward
from .protocol import find_experts_modules


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every :class:`MoE` layer in ``model`` (model order; through DDP / FSDP / pipeline wrappers)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_losses(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weighted aux losses of the last forward, summed over the model's :class:`MoE` layers: 0-dim fp32
    detached tensors keyed ``load_balance_loss`` / ``z_loss`` (those with weight > 0); ``{}`` without MoE
    layers or before the first forward. Under pipeline parallelism: this rank's stages only."""
    out: dict[str, torch.Tensor] = {}
    for m in moe_layers(model):
        for k, v in m.last_aux.items():
            out[k] = out[k] + v if k in out else v.clone()
    return out


def _stack(rows: list[torch.Tensor | None], what: str) -> torch.Tensor:
    if not rows or any(r is None for r in rows):
        raise RuntimeError(f"no {what} recorded yet: run a forward pass of the model first.")
    if len({r.numel() for r in rows}) > 1:
        raise ValueError(f"the MoE layers have different expert counts {sorted({r.numel() for r in rows})}; "
                         f"read each layer's {what} separately.")
    return torch.stack([r.to(rows[0].device) for r in rows])


def expert_load(model: nn.Module) -> torch.Tensor:
    """``[layers, E]`` int64: assignments per expert in each :class:`MoE` layer's last forward on this rank,
    before capacity dropping (sums to ``T * top_k`` per layer).

    Raises:
        RuntimeError: a layer has not run yet.  ValueError: layers with different ``E``.
    """
    return _stack([m.last_load for m in moe_layers(model)], "expert load")


def dropped_load(model: nn.Module) -> torch.Tensor:
    """``[layers, E]`` int64: assignments the capacity limit dropped, per expert, in the last forward."""
    return _stack([m.last_dropped for m in moe_layers(model)], "dropped load")


class ExpertLoadTracker:
    """Per-expert token counts of every experts-protocol module, accumulated by forward pre-hooks that read
    ``top_k_index`` (see :func:`track_expert_load`)."""

    def __init__(self, modules: list[tuple[str, nn.Module]]):
        self.names = [q for q, _ in modules]
        self._experts = [int(m.num_experts) for _, m in modules]
        self._counts: list[torch.Tensor | None] = [None] * len(modules)
        self._handles = [m.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                         for i, (_, m) in enumerate(modules)]

    def _hook(self, i: int):
        e = self._experts[i]

        def hook(module, args, kwargs):
            if in_backward():  # activation-checkpoint recomputation: already counted
                return None
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if index is None:
                return None
            with torch.no_grad():
                c = torch.bincount(index.reshape(-1).long(), minlength=e + 1)[:e]  # index E: dropped
                self._counts[i] = c if self._counts[i] is None else self._counts[i] + c
            return None

        return hook

    def counts(self) -> torch.Tensor:
        """``[layers, E]`` int64 CPU: tokens each expert received since the last :meth:`reset` (dropped
        assignments excluded). Zeros for modules that have not run.

        Raises:
            ValueError: the modules have different expert counts.
        """
        if len(set(self._experts)) > 1:
            raise ValueError(f"the experts modules have different expert counts {sorted(set(self._experts))}.")
        e = self._experts[0] if self._experts else 0
        return torch.stack([c.cpu() if c is not None else torch.zeros(e, dtype=torch.long)
                            for c in self._counts]) if self._counts else torch.zeros(0, e, dtype=torch.long)

    def reset(self) -> None:
        """Zero the counts."""
        self._counts = [None] * len(self._counts)

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


def track_expert_load(model: nn.Module, class_names: list[str] | None = None) -> ExpertLoadTracker:
    """Count, per experts module (:func:`torchloom.moe.protocol.find_experts_modules`: torchloom's
    :class:`GroupedExperts`, HF ``MixtralExperts`` / ``Qwen2MoeExperts`` / ``Qwen3MoeExperts``...), the
    tokens each expert receives, from the ``top_k_index`` its forward is called with. This rank's tokens only;
    checkpoint recomputation is not counted twice.

    Raises:
        ValueError: the model has no experts module.
        torchloom.errors.StrategyError: a named class is absent or not an experts module.
    """
    modules = find_experts_modules(model, class_names)
    if not modules:
        raise ValueError("track_expert_load: the model has no experts module (torchloom.moe.protocol: "
                         "`num_experts` and fused [E, ...] parameters with forward(hidden, top_k_index, "
                         "top_k_weights)).")
    return ExpertLoadTracker(modules)


def window_metrics(layers: list[MoE]) -> dict[str, float]:
    """Aux values of the accumulation window (per layer averaged over its forwards, summed over layers), their
    total ``aux_loss``, and ``dropped_fraction`` (dropped / routed assignments); ``{}`` without forwards."""
    out: dict[str, float] = {}
    routed = dropped = 0
    for m in layers:
        if not m.window_forwards:
            continue
        for k, v in m.window_aux.items():
            out[k] = out.get(k, 0.0) + float(v) / m.window_forwards
        routed += int(m.window_load.sum())
        dropped += int(m.window_dropped.sum())
    if not routed and not out:
        return {}
    out["aux_loss"] = sum(out.values())
    out["dropped_fraction"] = dropped / max(routed, 1)
    return out


def window_load(layers: list[MoE]) -> torch.Tensor | None:
    """``[layers, E]`` int64 CPU assignments per expert summed over the window (before dropping), one row per
    layer that ran in the window (model order), or None when none did."""
    rows = [m.window_load for m in layers if m.window_load is not None]
    if not rows:
        return None
    return _stack([r.cpu() for r in rows], "expert load")


class frozen_windows:
    """Context manager: forwards inside (evaluation) leave the layers' window sums as they were."""

    def __init__(self, layers: list[MoE]):
        self.layers = layers

    def __enter__(self):
        self._saved = [(dict(m.window_aux), m.window_forwards, m.window_load, m.window_dropped) for m in self.layers]
        return self

    def __exit__(self, *exc):
        for m, (aux, n, load, drop) in zip(self.layers, self._saved):
            m.window_aux, m.window_forwards, m.window_load, m.window_dropped = aux, n, load, drop
        return False

"""Mixture-of-Experts: :class:`MoE` layers (router, grouped SwiGLU experts, shared experts), the Switch /
GShard load-balancing and ST-MoE z aux losses, and per-expert load tracking (docs/moe.md)."""
from .aux import (MoEAuxLossAutoScaler, aux_loss_scale, aux_scale, load_balancing_loss, router_z_loss,
                  set_aux_scale)
from .config import MoEConfig, MoEConfigError
from .experts import GroupedExperts
from .layer import MoE, SwiGLU
from .load import (ExpertLoadTracker, aux_losses, dropped_load, expert_load, moe_layers, track_expert_load)
from .protocol import dropped, find_experts_modules, is_experts_module
from .router import Routing, TopKRouter, capacity, keep_within_capacity

__all__ = [
    "MoE", "MoEConfig", "MoEConfigError", "TopKRouter", "Routing", "GroupedExperts", "SwiGLU", "capacity",
    "keep_within_capacity", "MoEAuxLossAutoScaler", "aux_scale", "set_aux_scale", "aux_loss_scale",
    "load_balancing_loss", "router_z_loss", "aux_losses", "expert_load", "dropped_load", "moe_layers",
    "track_expert_load", "ExpertLoadTracker", "is_experts_module", "find_experts_modules", "dropped",
]

"""`MoEConfig`: the hyper-parameters of one :class:`torchloom.moe.MoE` layer, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TorchloomError

SCORE_FUNCS = ("softmax", "sigmoid")


class MoEConfigError(TorchloomError, ValueError):
    """An :class:`MoEConfig` value is out of range or two values conflict; the message names the fix."""


@dataclass
class MoEConfig:
    """One MoE layer: a top-k router over ``num_experts`` SwiGLU experts (plus optional shared experts).

    Attributes:
        dim: model (hidden) width ``D``; the layer maps ``[..., D] -> [..., D]``.
        hidden_dim: inner width of each expert's SwiGLU MLP.
        num_experts: ``E`` routed experts.
        top_k: experts per token (``1 <= top_k <= E``).
        score_func: ``"softmax"`` (Mixtral, GShard, Switch) or ``"sigmoid"`` (DeepSeek-V3: independent
            per-expert affinities, top-k of the sigmoid scores).
        softmax_before_topk: softmax only. True: softmax over all E logits, then the top-k probabilities
            (Mixtral / GShard); False: top-k of the raw logits, then a softmax over those k (some Switch /
            Mistral-style variants; the k weights then already sum to 1).
        norm_topk_prob: renormalise the k selected weights to sum to 1 (Mixtral: True; Qwen2-MoE: False).
            No effect with ``softmax_before_topk=False`` (already normalised).
        capacity_factor: None = dropless (every assignment is processed). Otherwise each expert takes at most
            ``C = ceil(capacity_factor * T * top_k / E)`` of this rank's ``T`` tokens' assignments; the rest
            are dropped by priority (all first choices before all second choices, then token order; GShard
            sec. 3.2, Switch Transformer sec. 2.2). A dropped assignment contributes nothing (the residual
            carries the token); the kept weights are not renormalised.
        aux_loss_weight: weight of the load-balancing loss ``E * sum_e f_e * P_e`` (Switch Transformer eq. 4-6,
            GShard), ``f_e`` the fraction of the ``T*k`` assignments routed to expert e before dropping and
            ``P_e`` the mean router probability of e. 0 disables it.
        z_loss_weight: weight of the router z-loss ``mean_t logsumexp(logits_t)^2`` (ST-MoE, Zoph et al.
            2022, eq. 5; they use 1e-3). 0 disables it.
        num_shared_experts: shared experts (DeepSeekMoE, Qwen2-MoE) as one dense SwiGLU MLP of width
            ``num_shared_experts * hidden_dim`` added to every token's output; 0 = none.
        router_dtype: dtype of the router math (logits, softmax, aux losses); float32 keeps routing stable
            under bf16/fp16 autocast (standard practice: Switch, ST-MoE "selective precision").
        init_std: standard deviation of the normal initialisation of every weight (torchtitan / HF
            ``initializer_range``).

    Raises:
        MoEConfigError: a value out of range or a conflicting pair (the message says which and the fix).
    """

    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int = 2
    score_func: str = "softmax"
    softmax_before_topk: bool = True
    norm_topk_prob: bool = True
    capacity_factor: float | None = None
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0
    num_shared_experts: int = 0
    router_dtype: torch.dtype = torch.float32
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("dim", "hidden_dim", "num_experts", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MoEConfigError(f"MoEConfig.{name} must be a positive int, got {v!r}.")
        if self.top_k > self.num_experts:
            raise MoEConfigError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                                 "choose top_k <= num_experts.")
        if self.score_func not in SCORE_FUNCS:
            raise MoEConfigError(f"MoEConfig.score_func={self.score_func!r} is not one of {SCORE_FUNCS}.")
        if self.score_func == "sigmoid" and not self.softmax_before_topk:
            raise MoEConfigError("MoEConfig.softmax_before_topk=False applies to score_func='softmax' only "
                                 "(sigmoid scores are per expert); leave it True with 'sigmoid'.")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
            raise MoEConfigError(f"MoEConfig.capacity_factor must be None (dropless) or a number > 0, got {cf!r}.")
        for name in ("aux_loss_weight", "z_loss_weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise MoEConfigError(f"MoEConfig.{name} must be a number >= 0, got {v!r}.")
        n = self.num_shared_experts
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise MoEConfigError(f"MoEConfig.num_shared_experts must be an int >= 0, got {n!r}.")
        if not isinstance(self.router_dtype, torch.dtype) or not self.router_dtype.is_floating_point:
            raise MoEConfigError(f"MoEConfig.router_dtype must be a floating torch.dtype, got {self.router_dtype!r}.")
        if not (isinstance(self.init_std, (int, float)) and self.init_std > 0):
            raise MoEConfigError(f"MoEConfig.init_std must be > 0, got {self.init_std!r}.")

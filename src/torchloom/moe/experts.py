"""`GroupedExperts`: E SwiGLU experts in fused 3-D parameters, following :mod:`torchloom.moe.protocol`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupedExperts(nn.Module):
    """``E`` SwiGLU MLPs ``w2 @ (silu(w1 @ x) * (w3 @ x))`` (Shazeer 2020; LLaMA/Mixtral experts) with fused
    parameters ``w1, w3 [E, hidden_dim, dim]`` and ``w2 [E, dim, hidden_dim]`` (torchtitan's layout).

    ``forward(hidden [T, dim], top_k_index [T, k] int64, top_k_weights [T, k]) -> [T, dim]`` in hidden's dtype:
    token t gets ``sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden[t])``; index ``E`` means
    dropped (nothing). Expert parallelism calls this on the received tokens with a local shard of the rows.

    Every expert runs, also on zero tokens (an empty matmul), so every expert row is in the autograd graph
    and gets a gradient (zeros when idle), never None: data-parallel collectives then match on all ranks
    (case C05). Deterministic: assignments are grouped by a stable sort and combined by a gather-free
    un-permutation back to the ``[T, k]`` slots and a sum over k (no atomic ``index_add``).
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, init_std: float = 0.02):
        super().__init__()
        self.num_experts, self.dim, self.hidden_dim, self.init_std = num_experts, dim, hidden_dim, init_std
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=self.init_std)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        t, k = top_k_index.shape
        e = self.w1.shape[0]  # the rows present (all E, or this rank's shard under expert parallelism)
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # grouped by expert; dropped (index >= rows) last
        counts = torch.bincount(flat, minlength=e + 1)[:e].tolist()
        token = order // k  # the token each sorted assignment belongs to
        x = hidden[token[:sum(counts)]]
        outs = []
        for i, xi in enumerate(torch.split(x, counts)):  # every expert, also with 0 tokens
            h = F.silu(xi @ self.w1[i].t()) * (xi @ self.w3[i].t())
            outs.append(h @ self.w2[i].t())
        y = torch.cat(outs) if outs else hidden.new_zeros(0, hidden.shape[1])
        y = y * top_k_weights.reshape(-1)[order[:y.shape[0]]].to(y.dtype).unsqueeze(-1)
        y = torch.cat([y, y.new_zeros(t * k - y.shape[0], y.shape[1])])  # dropped assignments: nothing
        unsort = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=order.device))
        return y[unsort].reshape(t, k, y.shape[1]).sum(dim=1).to(hidden.dtype)

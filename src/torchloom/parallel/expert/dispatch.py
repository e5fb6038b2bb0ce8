"""All-to-all token dispatch over the expert-parallel group (Megatron-Core's ``MoEAlltoAllTokenDispatcher``,
torchtitan's ``TokenDispatcher``; GShard, Lepikhin et al. 2020, section 2.2).

Every rank of the ``ep`` group holds ``E_local = E / ep`` consecutive experts (rank ``r``: experts
``[r * E_local, (r + 1) * E_local)``) and routes its own tokens. :meth:`AllToAllDispatcher.dispatch` sends each
(token, choice) row to the rank holding its expert; the experts run on the received rows;
:meth:`AllToAllDispatcher.combine` sends the outputs back and sums them at the source,
``out[t] = sum_j w[t, j] * y[t, j]``, so the router's weights get their gradient where they were computed.

Steps of a dispatch (``T`` tokens, ``k`` choices, ``S`` kept rows, ``N`` received rows):

1. drop the rows whose expert index is ``E`` (tokens the capacity limit dropped: they contribute nothing);
2. sort the kept rows by expert (stable, so the order is deterministic and a recomputation under activation
   checkpointing routes identically), which also sorts them by destination rank;
3. exchange the per-expert row counts (an ``int64`` all-to-all of ``E`` counts: each rank learns how many rows
   of each of its local experts every source sends);
4. exchange the hidden rows with variable splits (differentiable: the backward is the reverse all-to-all,
   so an expert's gradient is summed over every ep rank whose tokens it processed);
5. regroup the received rows (ordered by source, then local expert) by local expert.

Wall time spent in the all-to-all calls (forward and backward, counts included) accumulates in a
module-level counter, read with :func:`alltoall_seconds` and cleared with :func:`reset_alltoall_seconds`
(``benchmarks/moe.py``). It is host time: on an accelerator whose collectives are asynchronous it is the
launch time unless the caller synchronises.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

_SECONDS = [0.0]  # wall time inside the all-to-all calls of this process


def alltoall_seconds() -> float:
    """Seconds this process spent in expert-parallel all-to-all calls (forward and backward) since the last
    :func:`reset_alltoall_seconds`."""
    return _SECONDS[0]


def reset_alltoall_seconds() -> None:
    """Set the all-to-all time counter back to 0."""
    _SECONDS[0] = 0.0


def _timed_all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group) -> None:
    t0 = time.perf_counter()
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    _SECONDS[0] += time.perf_counter() - t0


class _AllToAll(torch.autograd.Function):
    """Differentiable variable-split all-to-all of rows (what ``torch.distributed.nn.functional.
    all_to_all_single`` does, with its time counted in both directions): the backward sends the gradient
    rows back along the reverse splits."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = inp.new_empty((sum(out_splits), *inp.shape[1:]))
        _timed_all_to_all(out, inp.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        _timed_all_to_all(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        return back, None, None, None


def all_to_all_rows(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Send ``rows[sum(in_splits[:i]) : sum(in_splits[:i+1])]`` to rank ``i`` of ``group`` and receive
    ``out_splits[i]`` rows from it; differentiable. ``rows``: ``[sum(in_splits), ...]``; returns
    ``[sum(out_splits), ...]``, same dtype and device."""
    return _AllToAll.apply(rows, list(out_splits), list(in_splits), group)


@dataclass
class Routing:
    """What :meth:`AllToAllDispatcher.combine` needs from the matching dispatch.

    Attributes:
        rows: ``[S]`` int64 flat ``token * k + choice`` index of each kept row, sorted by expert.
        send_splits: rows sent to each ep rank (``len == ep``, sums to ``S``).
        recv_splits: rows received from each ep rank (sums to ``N``).
        regroup: ``[N]`` int64 permutation: grouped row ``i`` is received row ``regroup[i]``.
        num_tokens: ``T``; k: choices per token.
    """

    rows: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    regroup: torch.Tensor
    num_tokens: int
    k: int


class AllToAllDispatcher:
    """Dispatch (token, choice) rows to the ep rank holding their expert and combine the results.

    Args:
        num_experts: ``E``, the global number of experts (divisible by the group size).
        group: the expert-parallel process group (``mesh["ep"].get_group()``); rank ``r`` of it holds experts
            ``[r * E / ep, (r + 1) * E / ep)``.

    Raises:
        ValueError: ``num_experts`` is not divisible by the group size.
    """

    def __init__(self, num_experts: int, group):
        self.num_experts = int(num_experts)
        self.group = group
        self.ep = dist.get_world_size(group)
        if self.num_experts % self.ep:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the expert-parallel degree "
                             f"ep={self.ep}.")
        self.local_experts = self.num_experts // self.ep

    def dispatch(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, Routing]:
        """Send each kept (token, choice) row to its expert's rank.

        Args:
            hidden: ``[T, H]`` this rank's token hidden states.
            top_k_index: ``[T, k]`` int64 global expert per choice; ``E`` means dropped.
            top_k_weights: unused here (the weights stay at the source; see :meth:`combine`).

        Returns:
            ``(x [N, H], local_index [N] int64 in [0, E_local), routing)``: the rows this rank's experts must
            process, grouped by local expert, and the state :meth:`combine` needs.

        Raises:
            ValueError: an expert index outside ``[0, E]``.
        """
        E, El, ep = self.num_experts, self.local_experts, self.ep
        T, k = top_k_index.shape
        flat = top_k_index.reshape(-1).long()
        # one histogram of E + 2 bins checks the range and counts the experts (one host sync)
        counts = torch.bincount((flat.clamp(-1, E + 1) + 1), minlength=E + 3)
        if int(counts[0]) or int(counts[E + 2]):
            bad = flat[(flat < 0) | (flat > E)][:4].tolist()
            raise ValueError(f"expert indices must lie in [0, {E}] ({E} = dropped); got {bad}.")
        counts = counts[1:E + 1].contiguous()  # rows per global expert (dropped ones excluded)
        kept = (flat < E).nonzero().squeeze(1)
        order = torch.sort(flat[kept], stable=True).indices
        rows = kept[order]
        recv = torch.empty_like(counts)
        _timed_all_to_all(recv, counts, None, None, self.group)  # equal splits: E_local counts per rank
        send_splits = counts.view(ep, El).sum(1).tolist()
        recv_by_src = recv.view(ep, El)
        recv_splits = recv_by_src.sum(1).tolist()
        x = all_to_all_rows(hidden[rows // k], recv_splits, send_splits, self.group)
        # received rows come ordered by source, then local expert: label them and group by local expert
        local = torch.repeat_interleave(torch.arange(El, device=recv.device).repeat(ep), recv_by_src.reshape(-1))
        regroup = torch.sort(local, stable=True).indices
        local = local[regroup].to(hidden.device)
        regroup = regroup.to(hidden.device)
        return x[regroup], local, Routing(rows, send_splits, recv_splits, regroup, T, k)

    def combine(self, y: torch.Tensor, routing: Routing, top_k_weights: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Send the experts' outputs back and sum them per token at the source.

        Args:
            y: ``[N, H]`` expert outputs for the rows :meth:`dispatch` returned (same order), unweighted.
            routing: the matching dispatch's :class:`Routing`.
            top_k_weights: ``[T, k]`` router weights (the gradient of the routing weights flows here).
            out_dtype: dtype of the result (default ``y``'s; the model's experts return ``hidden``'s dtype).

        Returns:
            ``[T, H]``: ``out[t] = sum_j w[t, j] * y[t, j]`` over the kept choices; 0 for a token with none.
        """
        inverse = torch.empty_like(routing.regroup)
        inverse[routing.regroup] = torch.arange(routing.regroup.numel(), device=inverse.device)
        back = all_to_all_rows(y[inverse], routing.send_splits, routing.recv_splits, self.group)
        w = top_k_weights.reshape(-1)[routing.rows].unsqueeze(1)
        dtype = out_dtype or y.dtype
        out = back.new_zeros((routing.num_tokens, *y.shape[1:]), dtype=dtype)
        return out.index_add(0, routing.rows // routing.k, (back * w).to(dtype))

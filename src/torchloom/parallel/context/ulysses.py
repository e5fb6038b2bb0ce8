"""Ulysses attention (Jacobs et al., "DeepSpeed Ulysses", 2023): an all-to-all turns the cp ranks' sequence
shards of all heads into full sequences of ``H / cp`` heads each; attention runs locally on whole sequences;
a second all-to-all returns the output to sequence shards. Needs the contiguous layout (the gathered chunks
concatenate in sequence order) and ``cp`` dividing the query heads; key/value heads that ``cp`` does not divide
(grouped-query attention with fewer key/value heads than ranks) are replicated to their query-head groups
first (verl and DeepSpeed do the same).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .ring import expand_heads, ring_attention
from .sequence import SequenceInfo


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    b, h, sl, d = x.shape
    send = x.reshape(b, cp, h // cp, sl, d).transpose(0, 1).contiguous()  # [cp (head group), B, H/cp, Sl, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[s]: rank s's sequence chunk of my head group
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * sl, d)


def _heads_to_seq(y: torch.Tensor, group, cp: int) -> torch.Tensor:
    b, hc, s, d = y.shape
    send = y.reshape(b, hc, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp (seq chunk), B, H/cp, Sl, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[s]: head group s's output for my sequence chunk
    return recv.permute(1, 0, 2, 3, 4).reshape(b, cp * hc, s // cp, d)


class _AllToAll(torch.autograd.Function):
    """``to_heads``: sequence shards -> head shards (``_seq_to_heads``), else the reverse; the backward of one
    direction is the other."""

    @staticmethod
    def forward(ctx, x, group, cp, to_heads: bool):
        ctx.group, ctx.cp, ctx.to_heads = group, cp, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group, cp)

    @staticmethod
    def backward(ctx, g):
        back = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return back(g.contiguous(), ctx.group, ctx.cp), None, None, None


def masked_attention(q, k, v, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention with a bool mask (True: attend) in fp32 math; rows with no visible key give 0 (SDPA gives
    NaN there). Differentiable by autograd."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is None:
        return torch.matmul(torch.softmax(s, -1), v.float()).to(q.dtype)
    seen = mask.any(-1, keepdim=True)
    s = s.masked_fill(~mask, float("-inf")).masked_fill(~seen, 0.0)
    p = torch.softmax(s, -1) * seen
    return torch.matmul(p, v.float()).to(q.dtype)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: SequenceInfo, *, causal: bool,
                      scale: float | None = None, sdpa=F.scaled_dot_product_attention) -> torch.Tensor:
    """Exact attention of sequence-sharded ``q`` ``[B, H, S/cp, D]`` and ``k``, ``v`` ``[B, H_kv, S/cp, D]``
    (the Ulysses degree divides ``H``; checked by the method). Returns ``[B, H, S/cp, D]``. In the ring x
    Ulysses hybrid (``info.layout.ulysses < cp``) the all-to-all gathers the ring rank's tokens and
    :func:`~.ring.ring_attention` runs over the ring ranks with ``H / ulysses`` heads.

    Causal attention without per-sample masks runs the original SDPA (``sdpa``: a flash kernel on GPUs);
    padding and documents run :func:`masked_attention`."""
    cp = info.layout.ulysses if info.layout.ulysses > 1 else info.layout.cp
    group = info.ulysses_group if info.ulysses_group is not None else info.group
    if q.shape[1] % cp:
        raise ValueError(f"ulysses: cp={cp} must divide the {q.shape[1]} query heads of this rank's attention; choose "
                         "a cp that divides them, or use context_parallel.")
    if k.shape[1] % cp:
        # fewer key/value heads than cp (or not a multiple): replicate each to its query-head group (GQA order),
        # so every rank's query heads meet the key/value head the grouping assigns them; the backward of the
        # replication sums the gradients over the copies
        k, v = expand_heads(k, q.shape[1] // k.shape[1]), expand_heads(v, q.shape[1] // k.shape[1])
    if scale is None:
        scale = q.shape[-1] ** -0.5
    qh, kh, vh = (_AllToAll.apply(t, group, cp, True) for t in (q, k, v))
    groups = qh.shape[1] // kh.shape[1]
    kh, vh = expand_heads(kh, groups), expand_heads(vh, groups)
    if cp < info.layout.cp:  # the hybrid: the ring ranks' tokens, H/ulysses heads, around the ring
        ring = dataclasses.replace(info, layout=info.layout.ring, _pos={})
        oh = ring_attention(qh, kh, vh, ring, causal=causal, scale=scale)
    elif info.document is None and info.valid is None and (info.window is None or info.window >= info.seq_len):
        oh = sdpa(qh, kh, vh, is_causal=causal, scale=scale)
    else:
        idx = torch.arange(info.seq_len, device=q.device)
        oh = masked_attention(qh, kh, vh, info.mask(idx, idx, causal, q.shape[0]), scale)
    return _AllToAll.apply(oh.contiguous(), group, cp, False)

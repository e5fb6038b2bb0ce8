"""Ring attention over the cp ranks: exact attention of this rank's queries against every rank's keys/values.

Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers" (2023); the online-softmax merge of
blockwise partial results follows Milakov & Gimelshein (2018) / FlashAttention (Dao et al. 2022); the
backward (recompute the block's probabilities from the saved log-sum-exp; the key/value gradients travel
around the ring with their keys and values and arrive home after ``cp`` hops) is FlashAttention's, per block,
as Megatron-Core's and PyTorch's ring attention do it.

Forward: ``cp`` steps; at step ``i`` a rank holds the keys/values of cp rank ``(r - i) mod cp`` and starts
sending them on to ``r + 1`` (receiving the next ones from ``r - 1``) before computing with them, so the
transfer overlaps the block's attention. Blocks a causal mask hides entirely are skipped. The merged output
and its log-sum-exp are kept in fp32. Masks come from :class:`~.sequence.SequenceInfo` (global token
indices, documents, key padding), never from the model.

The block product is plain ``matmul``/``exp`` math (any device, any backend, gloo included); on GPUs a fused
kernel returning the log-sum-exp would be faster, at the same results.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .sequence import SequenceInfo


class _Ring:
    """Neighbour exchange on a process group: send to ``rank + 1``, receive from ``rank - 1``."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, t: torch.Tensor, tag: int = 0):
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group, tag),
               dist.P2POp(dist.irecv, buf, self.prev, self.group, tag)]
        return dist.batch_isend_irecv(ops), buf

    @staticmethod
    def finish(pending) -> torch.Tensor:
        reqs, buf = pending
        for r in reqs:
            r.wait()
        return buf


def expand_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: key/value head ``j`` serves query heads ``j * groups ... (j + 1) * groups - 1``
    (HF's ``repeat_kv`` order)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def collapse_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`expand_heads`: sum over each key/value head's query-head group."""
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _scores(q, k, mask, scale):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _merge(out, lse, out2, lse2):
    if out is None:
        return out2, lse2
    new = torch.logaddexp(lse, lse2)
    base = _finite(new)
    return out * torch.exp(lse - base)[..., None] + out2 * torch.exp(lse2 - base)[..., None], new


def _hidden(info: SequenceInfo, q_rank: int, k_rank: int, causal: bool) -> bool:
    """True when a causal mask hides every key of ``k_rank`` from every query of ``q_rank`` (checked on the
    host, no device sync)."""
    if not causal:
        return False
    q = info.positions(q_rank, "cpu")
    k = info.positions(k_rank, "cpu")
    return int(q.max()) < int(k.min())


class RingAttention(torch.autograd.Function):
    """``out = softmax(q k^T * scale + mask) v`` over the whole sequence, with ``q`` this rank's queries and
    the keys/values spread over the cp group.

    Args (to ``apply``):
        q: ``[B, H, S/cp, D]``; k, v: ``[B, H_kv, S/cp, D]`` (``H_kv`` divides ``H``), any float dtype.
        info: the active :class:`SequenceInfo` (layout, masks, group).
        causal: causal masking by global token index.
        scale: the softmax scale (``1/sqrt(D)`` by default in :func:`ring_attention`).

    Returns ``[B, H, S/cp, D]`` in ``q``'s dtype; rows with no visible key are 0.
    """

    @staticmethod
    def forward(ctx, q, k, v, info: SequenceInfo, causal: bool, scale: float):
        ring = _Ring(info.group)
        cp, r = ring.size, ring.rank
        groups = q.shape[1] // k.shape[1]
        q_idx = info.positions(r, q.device)
        qf = q.float()
        out = lse = None
        cur = torch.stack([k, v])
        for i in range(cp):
            src = (r - i) % cp
            pending = ring.start(cur) if i < cp - 1 else None
            if not _hidden(info, r, src, causal):
                mask = info.mask(q_idx, info.positions(src, q.device), causal, q.shape[0])
                s = _scores(qf, expand_heads(cur[0].float(), groups), mask, scale)
                blk_lse = torch.logsumexp(s, -1)
                p = torch.exp(s - _finite(blk_lse)[..., None])
                out, lse = _merge(out, lse, torch.matmul(p, expand_heads(cur[1].float(), groups)), blk_lse)
            if pending is not None:
                cur = ring.finish(pending)
        if out is None:
            out = torch.zeros_like(qf)
            lse = torch.full(qf.shape[:-1], float("-inf"), device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.info, ctx.causal, ctx.scale, ctx.groups = info, causal, scale, groups
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        info, causal, scale, groups = ctx.info, ctx.causal, ctx.scale, ctx.groups
        ring = _Ring(info.group)
        cp, r = ring.size, ring.rank
        q_idx = info.positions(r, q.device)
        qf, do = q.float(), dout.float()
        delta = (do * out).sum(-1, keepdim=True)
        base = _finite(lse)[..., None]
        dq = torch.zeros_like(qf)
        cur = torch.stack([k, v])
        dkv = torch.zeros(cur.shape, dtype=torch.float32, device=k.device)  # travels with its keys/values
        for i in range(cp):
            src = (r - i) % cp
            pending = ring.start(cur) if i < cp - 1 else None
            if not _hidden(info, r, src, causal):
                mask = info.mask(q_idx, info.positions(src, q.device), causal, q.shape[0])
                kf, vf = expand_heads(cur[0].float(), groups), expand_heads(cur[1].float(), groups)
                p = torch.exp(_scores(qf, kf, mask, scale) - base)
                dv = torch.matmul(p.transpose(-1, -2), do)
                ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta)
                dq += torch.matmul(ds, kf) * scale
                dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
                dkv[0] += collapse_heads(dk, groups)
                dkv[1] += collapse_heads(dv, groups)
            dkv = ring.finish(ring.start(dkv, tag=1))  # on to the next rank, with the keys/values it follows
            if pending is not None:
                cur = ring.finish(pending)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: SequenceInfo, *, causal: bool,
                   scale: float | None = None) -> torch.Tensor:
    """:class:`RingAttention` with the default scale ``1/sqrt(D)``."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return RingAttention.apply(q, k, v, info, causal, float(scale))

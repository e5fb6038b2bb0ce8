"""Ring attention over the cp ranks: exact attention of this rank's queries against every rank's keys/values.

Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers" (2023); the online-softmax merge of
blockwise partial results follows Milakov & Gimelshein (2018) / FlashAttention (Dao et al. 2022); the
backward (recompute the block's probabilities from the saved log-sum-exp; the key/value gradients travel
around the ring with their keys and values and arrive home after ``cp`` hops) is FlashAttention's, per block,
as Megatron-Core's and PyTorch's ring attention do it.

Forward: ``cp`` steps; at step ``i`` a rank holds the keys/values of cp rank ``(r - i) mod cp`` and starts
sending them on to ``r + 1`` (receiving the next ones from ``r - 1``) before computing with them, so the
transfer overlaps the block's attention. Work is done per (query chunk, key chunk) pair: with the
load-balanced layout every pair is fully visible, causal on its diagonal or hidden (skipped), so causal
attention needs no mask. The merged output and its log-sum-exp are kept in fp32. Masks for documents,
padding and sliding windows come from :class:`~.sequence.SequenceInfo`, never from the model. The block
kernels are :mod:`.blocks` (PyTorch's fused flash kernel on CPU, fp32 math elsewhere).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .blocks import block_backward, block_forward, merge
from .sequence import SequenceInfo


#: seconds this process spent waiting for ring transfers (the exposed part of the exchange: a transfer that
#: finished during the block's attention costs nothing here); benchmarks/long_context.py reports its share
RING_WAIT = {"seconds": 0.0}


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
        t0 = time.perf_counter()
        for r in reqs:
            r.wait()
        RING_WAIT["seconds"] += time.perf_counter() - t0
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


def _chunks(info: SequenceInfo, rank: int) -> list[tuple[int, slice]]:
    """``(chunk index, slice of the rank's local tokens)`` of each chunk a rank holds (two load-balanced, or one)."""
    lay = info.layout
    c = info.seq_len // lay.chunks
    if lay.load_balance:
        return [(rank, slice(0, c)), (2 * lay.cp - 1 - rank, slice(c, 2 * c))]
    return [(rank, slice(0, c))]


def _pairs(info: SequenceInfo, r: int, src: int, causal: bool, device):
    """The (query chunk, key chunk) blocks of ranks ``r`` x ``src`` that a causal mask does not hide entirely:
    ``(q slice, k slice, q chunk, mask, diagonal)``. Chunk ``i`` precedes chunk ``j`` for ``i < j``, so a block
    is fully visible (``i > j``), causal on its diagonal (``i == j``) or hidden (``i < j``, skipped). Masks
    (bool, per block) only when the batch has documents, padding or a sliding window."""
    masked = info.document is not None or info.valid is not None or bool(info.window)
    q_idx, k_idx = info.positions(r, device), info.positions(src, device)
    for qc, qs in _chunks(info, r):
        for kc, ks in _chunks(info, src):
            if causal and kc > qc:
                continue
            mask = info.mask(q_idx[qs], k_idx[ks], causal, info.batch) if masked else None
            yield qs, ks, qc, mask, causal and kc == qc


class RingAttention(torch.autograd.Function):
    """``out = softmax(q k^T * scale + mask) v`` over the whole sequence, with ``q`` this rank's queries and
    the keys/values spread over the cp group.

    Args (to ``apply``):
        q: ``[B, H, S/cp, D]``; k, v: ``[B, H_kv, S/cp, D]`` (``H_kv`` divides ``H``), any float dtype.
        info: the active :class:`SequenceInfo` (layout, masks, group).
        causal: causal masking by global token index.
        scale: the softmax scale (``1/sqrt(D)`` by default in :func:`ring_attention`).

    Returns ``[B, H, S/cp, D]`` in ``q``'s dtype; rows with no visible key are 0. Blocks are computed per
    (query chunk, key chunk) pair by :mod:`.blocks` (PyTorch's fused flash kernel on CPU).
    """

    @staticmethod
    def forward(ctx, q, k, v, info: SequenceInfo, causal: bool, scale: float):
        if q.shape[0] != info.batch and (info.document is not None or info.valid is not None):
            raise ValueError(
                f"sequence split: the attention call has {q.shape[0]} samples but the split micro-batch has "
                f"{info.batch}; per-sample masks (padding, packed documents) cannot follow a further split of the "
                "micro-batch (pipeline micro-batches).")
        ring = _Ring(info.ring_group if info.ring_group is not None else info.group)
        cp, r = ring.size, ring.rank
        groups = q.shape[1] // k.shape[1]
        parts: dict[int, tuple] = {}
        cur = torch.stack([k, v])
        for i in range(cp):
            src = (r - i) % cp
            pending = ring.start(cur) if i < cp - 1 else None
            kk, vv = expand_heads(cur[0], groups), expand_heads(cur[1], groups)
            for qs, ks, qc, mask, diag in _pairs(info, r, src, causal, q.device):
                o, lse = block_forward(q[:, :, qs], kk[:, :, ks], vv[:, :, ks], mask, diag, scale)
                parts[qc] = merge(*parts.get(qc, (None, None)), o, lse)
            if pending is not None:
                cur = ring.finish(pending)
        outs, lses = [], []
        for qc, qs in _chunks(info, r):
            o, lse = parts.get(qc, (None, None))
            n = qs.stop - qs.start
            outs.append(o if o is not None else q.new_zeros((*q.shape[:2], n, q.shape[3]), dtype=torch.float32))
            lses.append(lse if lse is not None else q.new_full((*q.shape[:2], n), float("-inf"), dtype=torch.float32))
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.info, ctx.causal, ctx.scale, ctx.groups = info, causal, scale, groups
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        info, causal, scale, groups = ctx.info, ctx.causal, ctx.scale, ctx.groups
        ring = _Ring(info.ring_group if info.ring_group is not None else info.group)
        cp, r = ring.size, ring.rank
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        cur = torch.stack([k, v])
        dkv = torch.zeros(cur.shape, dtype=torch.float32, device=k.device)  # travels with its keys/values
        for i in range(cp):
            src = (r - i) % cp
            pending = ring.start(cur) if i < cp - 1 else None
            kk, vv = expand_heads(cur[0], groups), expand_heads(cur[1], groups)
            for qs, ks, _, mask, diag in _pairs(info, r, src, causal, q.device):
                dq_b, dk_b, dv_b = block_backward(dout[:, :, qs], q[:, :, qs], kk[:, :, ks], vv[:, :, ks],
                                                  out[:, :, qs], lse[:, :, qs], mask, diag, scale)
                dq[:, :, qs] += dq_b
                dkv[0][:, :, ks] += collapse_heads(dk_b, groups)
                dkv[1][:, :, ks] += collapse_heads(dv_b, groups)
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

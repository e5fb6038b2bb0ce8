"""One attention block with its log-sum-exp, forward and backward: the unit ring attention merges.

``block_forward`` returns ``(out, lse)`` of ``softmax(q k^T * scale + mask) v`` over this block's keys only;
``block_backward`` gives the block's ``dq, dk, dv`` from the *merged* output and log-sum-exp (FlashAttention's
backward: ``P = exp(S - lse)``, ``dS = P * (dO V^T - rowsum(dO * O))``), so summing the blocks' gradients gives
the gradients of the whole attention.

On CPU the blocks run PyTorch's fused flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and
its backward: blockwise, no ``[S, S]`` score matrix, the log-sum-exp returned); elsewhere plain fp32
``matmul``/``exp`` math (correct on every device; a fused GPU kernel returning the log-sum-exp would be faster).
Masks are bool ``[B or 1, 1, Sq, Sk]`` (True: attend); ``causal`` alone means the square block's diagonal.
"""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, _NEG_INF)


def _math_mask(mask, causal, sq, sk, device):
    if mask is None and causal:
        return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()[None, None]
    return mask


def block_forward(q, k, v, mask: torch.Tensor | None, causal: bool, scale: float):
    """``(out fp32 [B, H, Sq, D], lse fp32 [B, H, Sq])`` of one block (``k``, ``v`` with ``q``'s head count);
    rows that see no key of the block: out 0, lse -inf."""
    if _fused(q):
        if mask is None:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        else:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=_additive(mask, q.dtype), scale=scale)
            lse = lse.masked_fill(~mask.any(-1).expand_as(lse), _NEG_INF)  # the kernel reports 0 there
        return out.float(), lse.float()
    mask = _math_mask(mask, causal, q.shape[-2], k.shape[-2], q.device)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, _NEG_INF)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - _finite(lse)[..., None]), v.float()), lse


def block_backward(do, q, k, v, out, lse, mask: torch.Tensor | None, causal: bool, scale: float):
    """``(dq, dk, dv)`` fp32 of one block given the merged ``out`` (fp32) and ``lse``."""
    lse = _finite(lse)  # a row no block shows a key has P = 0 everywhere
    if _fused(q):
        attn = None if mask is None else _additive(mask, q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, causal and mask is None, attn_mask=attn, scale=scale)
        return dq.float(), dk.float(), dv.float()
    mask = _math_mask(mask, causal, q.shape[-2], k.shape[-2], q.device)
    qf, kf, vf, do = q.float(), k.float(), v.float(), do.float()
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, _NEG_INF)
    p = torch.exp(s - lse[..., None])
    delta = (do * out).sum(-1, keepdim=True)
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta)
    return torch.matmul(ds, kf) * scale, torch.matmul(ds.transpose(-1, -2), qf) * scale, torch.matmul(
        p.transpose(-1, -2), do)


def merge(out, lse, out2, lse2):
    """Online-softmax merge of two partial results over disjoint keys (Milakov & Gimelshein 2018)."""
    if out is None:
        return out2, lse2
    new = torch.logaddexp(lse, lse2)
    base = _finite(new)
    return out * torch.exp(lse - base)[..., None] + out2 * torch.exp(lse2 - base)[..., None], new

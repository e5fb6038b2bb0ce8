"""Route ``torch.nn.functional.scaled_dot_product_attention`` to ring or Ulysses attention while a split batch
is active, so unchanged models run under a sequence split: Hugging Face's SDPA attention (Llama, Mistral,
Qwen2/3, Mixtral, ...) and anything else that calls SDPA through ``torch.nn.functional`` at run time.
PyTorch's experimental ``context_parallel`` takes the same route (it swaps SDPA for a ring version).

A model that computes attention some other way (its own matmuls, a flash-attn import bound at import
time) would attend within the rank's tokens only: a silent wrong result. The split therefore counts the
routed calls and :class:`~.split.SequenceSplitter` raises after a forward that made none.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .ring import ring_attention
from .sequence import active_sequence
from .ulysses import ulysses_attention

_ORIGINAL = F.scaled_dot_product_attention


def _routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
            **kwargs):
    info = active_sequence()
    if info is None:
        return _ORIGINAL(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa, **kwargs)
    local = info.local_len
    if query.shape[-2] != local or key.shape[-2] != local:
        raise ValueError(
            f"sequence split (cp={info.layout.cp}): an attention call got {query.shape[-2]} queries and "
            f"{key.shape[-2]} keys, but each rank holds {local} tokens of every sample; generation with a KV cache "
            "and cross-attention do not run under a sequence split (run them on the unsplit model).")
    if dropout_p and torch.is_grad_enabled():
        raise ValueError(f"sequence split: attention dropout ({dropout_p}) is not supported under cp; set the model's "
                         "attention_dropout to 0.")
    if query.dim() != 4:
        raise ValueError(f"sequence split: attention inputs must be [batch, heads, tokens, head_dim], got "
                         f"{tuple(query.shape)}.")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"sequence split: {key.shape[1]} key/value heads do not divide {query.shape[1]} query heads.")
    g = info.kv_groups
    if g > 1 and key.shape[1] == query.shape[1] and query.shape[1] % g == 0:
        # HF repeats key/value heads (repeat_kv) or lets SDPA do it (enable_gqa) depending on whether it built a
        # mask, which differs between cp ranks: take every g-th head back (the gradient still reaches each key/value
        # head once through repeat_kv's backward), so every rank sends the same, smaller, tensors
        key, value = key[:, ::g], value[:, ::g]
    # a mask the model passes was built from its rank-local tokens: replaced by the global one
    causal = bool(is_causal) or (attn_mask is not None and info.causal)
    info.calls += 1
    if info.layout.ulysses > 1:  # Ulysses, or the ring x Ulysses hybrid
        return ulysses_attention(query, key, value, info, causal=causal, scale=scale, sdpa=_ORIGINAL)
    return ring_attention(query, key, value, info, causal=causal, scale=scale)


def attention_calls() -> int:
    """Attention calls routed through the active split batch so far (0 outside one)."""
    info = active_sequence()
    return info.calls if info is not None else 0


@contextlib.contextmanager
def sequence_attention():
    """While entered, ``torch.nn.functional.scaled_dot_product_attention`` is routed (only while a split batch
    is active; otherwise it is the original). Re-entrant."""
    if F.scaled_dot_product_attention is _routed:
        yield
        return
    F.scaled_dot_product_attention = _routed
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _ORIGINAL

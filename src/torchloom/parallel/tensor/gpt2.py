"""Tensor-parallel plan for GPT-2 (``Conv1D`` layers, fused ``c_attn`` = [q | k | v], tied ``wte``/``lm_head``).

``c_attn`` uses ``fused_qkv`` (each rank holds its heads' q, k and v; the parameter keeps the original
layout), ``c_proj`` row-wise, ``c_fc`` column-wise. GPT-2 attention splits ``c_attn``'s output with
``split_size``, so each rank's attention gets ``split_size`` (and ``num_heads``) divided by tp. The token
embedding and the tied head are both vocabulary-parallel (``Shard(0)`` of the same ``(vocab, hidden)``
weight), so the tie survives. No sequence-parallel variant: the learned position embeddings are added to
the token embeddings outside any module boundary where the stream could be split.
"""
from __future__ import annotations

from .plans import TPPlan, register_family


@register_family("gpt2")
def gpt2_plan(model, cfg) -> TPPlan:
    styles = {
        "wte": "vocab_embedding",
        "h.*.attn.c_attn": "fused_qkv",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    }
    return TPPlan(
        "gpt2", styles, local_attrs={"h.*.attn": ("split_size", "num_heads")},
        divisible={"config.n_head (heads)": cfg.n_head, "config.vocab_size": cfg.vocab_size,
                   "MLP width (config.n_inner or 4 * n_embd)": cfg.n_inner or 4 * cfg.n_embd},
        sequence_parallel=False,
    )

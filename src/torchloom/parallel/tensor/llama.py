"""Tensor-parallel plans for Llama-like decoders: Llama, Mistral, Qwen2 (dense) and Mixtral (MoE).

Attention: q/k/v column-wise, o row-wise; MLP: gate/up column-wise, down row-wise (Megatron). These
models' attention reshapes with ``view(..., -1, head_dim)`` and keeps ``num_heads / num_kv_heads`` as a
ratio, so no module attribute changes; the head and kv-head counts must be divisible by tp (grouped-query
attention: every rank keeps whole kv heads with their query heads). Mixtral's experts are split inside
every expert (``moe_experts``); its router stays replicated. The same module names as transformers'
``config.base_model_tp_plan`` (checked by the unit tests).
"""
from __future__ import annotations

from .plans import TPPlan, register_family

_ATTENTION = {
    "layers.*.self_attn": "sp_gather_input",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}
_NORMS = {
    "layers.*.input_layernorm": "sequence_parallel",
    "layers.*.post_attention_layernorm": "sequence_parallel",
    "norm": "sequence_parallel",
}


def _divisible(cfg) -> dict[str, int]:
    return {
        "config.num_attention_heads (query heads)": cfg.num_attention_heads,
        "config.num_key_value_heads (key/value heads)": cfg.num_key_value_heads or cfg.num_attention_heads,
        "config.vocab_size": cfg.vocab_size,
    }


@register_family("llama", "mistral", "qwen2")
def dense_plan(model, cfg) -> TPPlan:
    styles = {
        "embed_tokens": "vocab_embedding",
        **_ATTENTION,
        "layers.*.mlp": "sp_gather_input",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        **_NORMS,
    }
    return TPPlan(cfg.model_type, styles,
                  divisible={**_divisible(cfg), "config.intermediate_size": cfg.intermediate_size})


@register_family("mixtral")
def moe_plan(model, cfg) -> TPPlan:
    styles = {
        "embed_tokens": "vocab_embedding",
        **_ATTENTION,
        "layers.*.mlp": "sp_gather_input_scatter_output",
        "layers.*.mlp.experts": "moe_experts",
        **_NORMS,
    }
    return TPPlan(cfg.model_type, styles,
                  divisible={**_divisible(cfg), "config.intermediate_size (per expert)": cfg.intermediate_size})

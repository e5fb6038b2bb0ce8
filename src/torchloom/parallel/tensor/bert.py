"""Tensor-parallel plan for BERT encoders (masked LM, sequence classification, ...).

Self-attention query/key/value column-wise, attention output and FFN output ``dense`` row-wise, FFN
intermediate column-wise, word embeddings vocabulary-parallel; the masked-LM decoder (tied to the word
embeddings, with a tied bias) is the ``lm_head``. Classifier and pooler heads stay replicated (small).
BERT attention reshapes with ``view(..., -1, head_size)``; ``num_attention_heads``/``all_head_size`` are
divided anyway so the module describes its local shard. No sequence-parallel variant (post-norm blocks
whose residual enters the norm inside the output module).
"""
from __future__ import annotations

from .plans import TPPlan, register_family


@register_family("bert")
def bert_plan(model, cfg) -> TPPlan:
    styles = {
        "embeddings.word_embeddings": "vocab_embedding",
        "encoder.layer.*.attention.self.query": "colwise",
        "encoder.layer.*.attention.self.key": "colwise",
        "encoder.layer.*.attention.self.value": "colwise",
        "encoder.layer.*.attention.output.dense": "rowwise",
        "encoder.layer.*.intermediate.dense": "colwise",
        "encoder.layer.*.output.dense": "rowwise",
    }
    return TPPlan(
        "bert", styles,
        local_attrs={"encoder.layer.*.attention.self": ("num_attention_heads", "all_head_size")},
        divisible={"config.num_attention_heads (heads)": cfg.num_attention_heads,
                   "config.intermediate_size": cfg.intermediate_size, "config.vocab_size": cfg.vocab_size},
        sequence_parallel=False,
    )

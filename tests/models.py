"""Tiny real Hugging Face models and fixed data for the tests (built from configs; no downloads)."""
from __future__ import annotations

import torch


def tiny_llama_config(tie: bool = False, layers: int = 2, vocab: int = 128, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=tie, **kw)


def tiny_llama(seed: int = 0, tie: bool = False, layers: int = 2, **kw):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(tie=tie, layers=layers, **kw))


def tiny_gpt2(seed: int = 0, dropout: float = 0.0, layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=128, n_positions=128, n_embd=64, n_layer=layers, n_head=4,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return GPT2LMHeadModel(cfg)


def tiny_t5(seed: int = 0):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg)


def token_batches(n: int, seq: int = 16, vocab: int = 128, seed: int = 1234) -> torch.Tensor:
    """``n`` fixed sequences of random token ids, shape (n, seq), int64."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, seq), generator=g)


def lm_loss(batch, output):
    return output.loss


def full_params(model) -> dict[str, torch.Tensor]:
    """Unsharded fp32 CPU copy of every parameter, keyed like the plain model (collective for FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cpu_offload=True would leave the full dict on rank 0 only; every rank needs it here
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: v.detach().float().cpu().clone() for k, v in sd.items()}


def tiny_moe_config(family: str = "mixtral", experts: int = 4, top_k: int = 2, layers: int = 2, vocab: int = 128,
                    **kw):
    """A tiny Hugging Face MoE config: ``family`` in ``mixtral``, ``qwen2_moe``, ``qwen3_moe`` (fused 3-D
    experts in the pinned transformers). ``output_router_logits=True`` so the model adds its load-balancing
    loss to ``output.loss``."""
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, output_router_logits=True,
                  num_experts_per_tok=top_k)
    if family == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(intermediate_size=48, num_local_experts=experts, **{**common, **kw})
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=32,
                              num_experts=experts, decoder_sparse_step=1, norm_topk_prob=False, **{**common, **kw})
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=experts,
                              decoder_sparse_step=1, norm_topk_prob=True, head_dim=8, **{**common, **kw})
    raise ValueError(f"unknown MoE family {family!r}")


def tiny_moe(family: str = "mixtral", seed: int = 0, **kw):
    """A tiny HF MoE causal LM (see :func:`tiny_moe_config`), initialised from ``seed``, fp32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_moe_config(family, **kw))

"""Hugging Face attention -> PyTorch SDPA (``torch.nn.functional.scaled_dot_product_attention``).

In transformers 5.x every attention module of a model reads the shared ``config._attn_implementation``
at each forward, so the switch is model-wide: ``model.set_attn_implementation("sdpa")`` (which also
updates sub-configs, e.g. an encoder-decoder's). Llama, GPT-2, BERT and T5 support it in 5.24, and a model
built from a config already defaults to SDPA; models loaded with ``attn_implementation="eager"`` (or
classes that default to eager) are the ones this changes. Models that cannot switch at runtime
(``_can_set_attn_implementation()`` False) or do not support SDPA are left alone.
"""
from __future__ import annotations

from torch import nn


def eager_hf_model(module: nn.Module) -> bool:
    """A Hugging Face model that supports SDPA, can switch at runtime, and does not use it yet."""
    cfg = getattr(module, "config", None)
    can_set = getattr(module, "_can_set_attn_implementation", None)
    return (
        cfg is not None and getattr(module, "_supports_sdpa", False) and callable(can_set) and can_set()
        and getattr(cfg, "_attn_implementation", None) != "sdpa"
    )


def use_sdpa(model: nn.Module) -> nn.Module:
    """Switch ``model`` (in place) to SDPA attention; returns it."""
    model.set_attn_implementation("sdpa")
    return model

"""What a Hugging Face config says about a model, for planning: loading a config, building the model on the
meta device (no memory), the architecture sizes (``dims``) and the tensor-parallel family."""
from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn


def build_meta_model(cfg) -> nn.Module:
    """A transformers model for ``cfg`` on the meta device (fp32 parameters, no storage).

    Raises:
        ValueError: no auto class of transformers supports ``cfg.model_type``.
    """
    import transformers as tf

    errors = []
    for auto in (tf.AutoModelForCausalLM, tf.AutoModelForSeq2SeqLM, tf.AutoModel):
        try:
            with torch.device("meta"):
                return auto.from_config(cfg, dtype=torch.float32)
        except ValueError as e:  # "Unrecognized configuration class ..."
            errors.append(str(e).splitlines()[0])
    raise ValueError(f"transformers cannot build a model for model_type '{cfg.model_type}': {errors[-1]}")


def hf_config_of(model: nn.Module):
    """The Hugging Face config of ``model`` or of its first submodule that has one, else None."""
    from ..parallel.tensor.plans import hf_config

    return hf_config(model)


def model_family(model: nn.Module, cfg) -> str | None:
    """The tensor-parallel family of ``cfg.model_type`` when torchloom has a built-in plan for it, else None."""
    from ..parallel.tensor.plans import supported_families

    mt = getattr(cfg, "model_type", None)
    return mt if mt in supported_families() else None


#: ModelInfo.dims key -> config attributes that hold it, first found wins (GPT-2, T5, MoE spellings)
_DIM_ATTRS = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim", "d_kv"),
    "intermediate_size": ("intermediate_size", "n_inner", "d_ff", "ffn_dim"),
    "vocab_size": ("vocab_size",),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "experts_per_token": ("num_experts_per_tok", "moe_topk"),
}


def model_dims(cfg) -> dict[str, int]:
    """Architecture sizes from a Hugging Face config (missing ones derived the way the models do)."""
    if cfg is None:
        return {}
    dims = {}
    for key, attrs in _DIM_ATTRS.items():
        for a in attrs:
            v = getattr(cfg, a, None)
            if isinstance(v, int) and not isinstance(v, bool):
                dims[key] = v
                break
    if "num_heads" in dims:
        dims.setdefault("num_kv_heads", dims["num_heads"])
        if "hidden_size" in dims:
            dims.setdefault("head_dim", dims["hidden_size"] // dims["num_heads"])
    if "intermediate_size" not in dims and getattr(cfg, "model_type", None) == "gpt2" and "hidden_size" in dims:
        dims["intermediate_size"] = 4 * dims["hidden_size"]  # GPT-2's n_inner=None
    return dims


def load_config(hf_config: Any):
    """A ``PretrainedConfig`` from a config object, a ``config.json`` dict with ``model_type``, or its path.

    Raises:
        ValueError: no ``model_type``, or one transformers does not know; a dict or file leaving out a size that
            defines the model (``ModelSpecError``: :func:`~torchloom.cost.config_checks.check_required_fields`).
    """
    from pathlib import Path

    import transformers as tf

    if isinstance(hf_config, tf.PretrainedConfig):
        return hf_config
    if isinstance(hf_config, (str, Path)):
        hf_config = json.loads(Path(hf_config).read_text())
    if not isinstance(hf_config, dict) or "model_type" not in hf_config:
        raise ValueError("hf_config must be a transformers PretrainedConfig, a config.json dict with "
                         "'model_type', or the path to a config.json.")
    d = dict(hf_config)
    if d["model_type"] in tf.CONFIG_MAPPING:  # a size left out would be another model's default: refused
        from .config_checks import check_required_fields

        check_required_fields(d, f"the {d['model_type']} config")
    try:
        return tf.AutoConfig.for_model(d.pop("model_type"), **d)
    except ValueError as e:
        raise ValueError(f"unknown model_type in hf_config: {e}") from e

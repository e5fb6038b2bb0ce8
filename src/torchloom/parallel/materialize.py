"""Materialise a model built on the meta device: allocate real storage, then initialise parameters
*and buffers* (non-persistent buffers such as rotary ``inv_freq`` are not in any state dict, so they
must be recomputed, not loaded; huggingface/transformers 34234)."""
from __future__ import annotations

import torch
from torch import nn


def materialize_meta_model(model: nn.Module, device: torch.device) -> None:
    """``to_empty`` then initialise in place. Works on FSDP-sharded models (each rank fills its shard).

    Initialisation order: Hugging Face ``PreTrainedModel.initialize_weights`` / ``init_weights`` (also
    recomputes rotary buffers), else the model's own ``init_weights()``, else ``reset_parameters()`` on
    every submodule that has it. Modules with non-persistent buffers may define ``_init_buffers()``.

    Raises:
        RuntimeError: a parameter or buffer is still on the meta device afterwards (name listed).
    """
    model.to_empty(device=device)
    with torch.no_grad():
        if hasattr(model, "initialize_weights") and hasattr(model, "_init_weights"):
            _hf_init(model)
        elif hasattr(model, "init_weights") and callable(model.init_weights):
            model.init_weights()
        else:
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        for m in model.modules():
            if hasattr(m, "_init_buffers"):
                m._init_buffers()
    still = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still:
        raise RuntimeError(f"tensors still on the meta device after materialisation: {still[:5]}")


def _hf_init(model: nn.Module) -> None:
    # transformers skips modules flagged as initialised; after to_empty nothing is.
    for m in model.modules():
        if hasattr(m, "_is_hf_initialized"):
            m._is_hf_initialized = False
    model.initialize_weights()

"""Tensor-parallel plans: which module gets which style, per model family, and how a plan is chosen.

A plan's patterns are ``fnmatch`` patterns, matched per dotted component, on module names of the
*unwrapped* model (pipeline stages keep those names). Built-in plans are written relative to the Hugging
Face base model (``layers.*.mlp``) and prefixed with the model's ``base_model_prefix`` (``model.``,
``transformer.``, ``bert.``); the output head is found with ``get_output_embeddings()`` and gets the
``lm_head`` style.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from ...errors import StrategyError
from .styles import check_style_name


@dataclass
class TPPlan:
    """What tensor parallelism does to one model.

    Attributes:
        family: model family name (for notes and errors), or "custom".
        styles: module-name pattern -> style name (see ``styles.STYLES``), applied in this order.
        local_attrs: module-name pattern -> attribute names that count heads/widths and are divided by tp on
            each matched module whose projections are sharded (e.g. GPT-2 attention's ``split_size``).
        divisible: dimension description -> size; each must be divisible by tp (heads, kv heads, ...).
        sequence_parallel: the plan has a sequence-parallel variant.
    """

    family: str
    styles: dict[str, str]
    local_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    divisible: dict[str, int] = field(default_factory=dict)
    sequence_parallel: bool = True


#: Hugging Face ``config.model_type`` -> builder ``(model, config) -> TPPlan`` (relative to the base model)
FAMILIES: dict[str, Callable[[nn.Module, object], TPPlan]] = {}


def register_family(*model_types: str):
    """Decorator: register a plan builder for Hugging Face ``model_type`` names."""

    def deco(fn):
        for t in model_types:
            FAMILIES[t] = fn
        return fn

    return deco


def hf_config(model: nn.Module):
    """The Hugging Face config of ``model`` (or of its first submodule that has one), else None."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "model_type"):
            return cfg
    return None


def supported_families() -> list[str]:
    _load_builtin_families()
    return sorted(FAMILIES)


def auto_plan(model: nn.Module) -> TPPlan:
    """The built-in plan for ``model`` (one part: the whole model or a pipeline stage), with absolute names.

    Raises:
        StrategyError: the model is not a supported Hugging Face family (the message lists the families and
            shows how to pass a plan).
    """
    _load_builtin_families()
    cfg = hf_config(model)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in FAMILIES:
        raise StrategyError(
            f"tensor_parallel has no built-in plan for {type(model).__name__}"
            + (f" (model_type '{model_type}')" if model_type else "")
            + f". Supported Hugging Face families: {', '.join(supported_families())}. For another model pass a "
            "plan mapping module-name patterns to styles, e.g. ('tensor_parallel', {'plan': "
            "{'blocks.*.attn.qkv': 'fused_qkv', 'blocks.*.attn.proj': 'rowwise', 'blocks.*.mlp.fc1': 'colwise', "
            "'blocks.*.mlp.fc2': 'rowwise'}}); see docs/methods/tensor_parallel.md."
        )
    plan = FAMILIES[model_type](model, cfg)
    prefix = _base_prefix(model)
    plan.styles = {prefix + k: v for k, v in plan.styles.items()}
    plan.local_attrs = {prefix + k: v for k, v in plan.local_attrs.items()}
    head = output_head_name(model)
    if head is not None:
        plan.styles[head] = "lm_head"
    return plan


def custom_plan(model: nn.Module, styles: dict[str, str]) -> TPPlan:
    """A user plan; the family's head-count attributes and divisibility checks still apply when the model
    is a known family (they describe the model, not the plan)."""
    for pattern, style in styles.items():
        check_style_name(style, f"pattern '{pattern}'")
    try:
        known = auto_plan(model)
    except StrategyError:
        return TPPlan("custom", dict(styles))
    return TPPlan("custom", dict(styles), local_attrs=known.local_attrs, divisible=known.divisible)


def output_head_name(model: nn.Module) -> str | None:
    """Name of the output (vocabulary) projection via Hugging Face's ``get_output_embeddings()``, else None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return None
    return next((n for n, m in model.named_modules() if m is head), None)


def _base_prefix(model: nn.Module) -> str:
    prefix = getattr(model, "base_model_prefix", "")
    return f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""


_LOADED = False


def _load_builtin_families() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        from . import bert, gpt2, llama  # noqa: F401  (register their families)

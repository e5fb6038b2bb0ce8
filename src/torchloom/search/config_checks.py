"""The architecture fields of a Hugging Face config that the planner reads, checked before anything is built
or traced: a bad field is a :class:`~torchloom.search.presets.ModelSpecError` naming the field, its value and
the rule it breaks (``loom plan`` exit 2), never a traceback from deep inside the model's forward.

The same checks run on a ``config.json`` dict (the user's spelling of each field, before transformers fills
defaults) and on a built config object (the defaults included). What transformers itself checks when it builds
the config or the model (``hidden_size`` divisible by the heads where the model has no ``head_dim`` of its own,
an even rotary dimension, ...) is reported by :func:`torchloom.search.presets.hf_config_from_dict` and
:func:`torchloom.search.analysis.analyze_config` as the same kind of error: many models set their own head size,
so a rule of ours there would refuse valid configs (GLM-4-MoE: 96 heads over a hidden size of 4,096).
"""
from __future__ import annotations

from typing import Any, Callable

from .presets import ModelSpecError

_MISSING = object()

#: fields that must be positive integers when set (every spelling the analysis reads: Llama, GPT-2, T5, MoE)
POSITIVE_INT_FIELDS = (
    "hidden_size", "n_embd", "d_model",
    "num_attention_heads", "n_head", "num_heads",
    "num_key_value_heads", "head_dim", "d_kv",
    "intermediate_size", "n_inner", "d_ff", "ffn_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
    "vocab_size",
    "num_hidden_layers", "n_layer", "num_layers",
    "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_topk",
    "max_position_embeddings", "n_positions", "n_ctx",
)
#: fields that may not be null in a config.json (the model cannot be built without them)
REQUIRED_IF_GIVEN = ("hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head", "num_heads",
                     "vocab_size", "num_hidden_layers", "n_layer", "num_layers")
_HEADS = ("num_attention_heads", "n_head", "num_heads")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk")
_DTYPE = ("torch_dtype", "dtype")
#: the sizes checked on a built config too (the analysis builds its tensors from them)
_CORE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
                "num_hidden_layers", "num_local_experts", "num_experts", "num_experts_per_tok")
_ACT = ("hidden_act", "activation_function")


def check_config_dict(d: dict[str, Any], where: str) -> None:
    """Check a ``config.json`` dict's architecture fields (only those present; transformers fills the rest).

    Raises:
        ModelSpecError: ``"<where>: <field> <value> <rule>"`` for the first bad field.
    """
    _check(lambda k: d.get(k, _MISSING), where, json_names=True)


def check_config(cfg: Any, where: str) -> None:
    """Check a built ``transformers.PretrainedConfig``'s architecture fields (defaults included).

    Raises:
        ModelSpecError: ``"<where>: <field> <value> <rule>"`` for the first bad field.
    """
    _check(_getter(cfg), where, json_names=False)


def _check(get: Callable[[str], Any], where: str, json_names: bool) -> None:
    def fail(msg: str) -> None:
        raise ModelSpecError(f"{where}: {msg}")

    # a built config's own defaults are transformers' business (some are 0/-1 placeholders, per-layer lists):
    # there only the sizes the analysis builds tensors from are checked
    for k in POSITIVE_INT_FIELDS if json_names else _CORE_FIELDS:
        v = get(k)
        if v is _MISSING or (v is None and not (json_names and k in REQUIRED_IF_GIVEN)):
            continue
        if v is None:
            fail(f"{k} is null; it must be a positive integer.")
        if isinstance(v, (list, tuple, dict)):  # per-layer or per-stage values (Gemma-3n, Swin, ...)
            continue
        if isinstance(v, bool) or isinstance(v, str) or (isinstance(v, float) and not v.is_integer()):
            if json_names:
                fail(f"{k} {v!r} must be a positive integer (got a {_kind(v)}).")
            continue
        if isinstance(v, (int, float)) and v < 1:
            fail(f"{k} {v:g} must be a positive integer (>= 1).")

    heads_key, heads = _first(get, _HEADS)
    kv = get("num_key_value_heads")
    if heads is not None and _is_int(kv) and heads % kv:
        fail(f"{heads_key} {heads} is not divisible by num_key_value_heads {kv} (each key/value head serves a "
             f"whole number of query heads); use a divisor of {heads}.")
    experts_key, experts = _first(get, _EXPERTS)
    top_key, top_k = _first(get, _TOP_K)
    if experts is not None and top_k is not None and top_k > experts:
        fail(f"{top_key} {top_k} is more than {experts_key} {experts}: each token is routed to {top_key} of the "
             f"experts; use at most {experts}.")

    for k in _DTYPE if json_names else ("dtype",):  # a built config's torch_dtype is a deprecated alias (warns)
        v = get(k)
        if not isinstance(v, str) or v == "auto":
            continue
        import torch

        dt = getattr(torch, v, None)
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            fail(f"{k} {v!r} is not a torch floating-point dtype; use float32, bfloat16 or float16.")
    for k in _ACT:
        v = get(k)
        if isinstance(v, str):
            from transformers.activations import ACT2FN

            if v not in ACT2FN:
                fail(f"{k} {v!r} is not an activation transformers knows (e.g. silu, gelu, gelu_new, relu).")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _getter(obj: Any) -> Callable[[str], Any]:
    """``getattr`` that reads a failing property (per-layer attributes of some configs raise) as missing."""
    def get(k: str) -> Any:
        try:
            return getattr(obj, k, _MISSING)
        except Exception:  # noqa: BLE001  (transformers raises AttributeError/ValueError for per-layer fields)
            return _MISSING
    return get


def _first(get: Callable[[str], Any], names: tuple[str, ...]) -> tuple[str, int | None]:
    """The first of ``names`` set to an int (its name and value), else ``(names[0], None)``."""
    for k in names:
        v = get(k)
        if _is_int(v):
            return k, v
    return names[0], None


def _kind(v: Any) -> str:
    return {str: "string", float: "float", list: "list", dict: "mapping"}.get(type(v), type(v).__name__)

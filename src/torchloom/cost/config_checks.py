"""The architecture fields of a Hugging Face config that the planner reads, checked before anything is built
or traced: a bad field is a :class:`~torchloom.cost.presets.ModelSpecError` naming the field, its value and
the rule it breaks (``loom plan`` exit 2), never a traceback from deep inside the model's forward.

The same checks run on a ``config.json`` dict (the user's spelling of each field, before transformers fills
defaults) and on a built config object (the defaults included). What transformers itself checks when it builds
the config or the model (``hidden_size`` divisible by the heads where the model has no ``head_dim`` of its own,
an even rotary dimension, ...) is reported by :func:`torchloom.cost.presets.hf_config_from_dict` and
:func:`torchloom.cost.analysis.analyze_config` as the same kind of error: many models set their own head size,
so a rule of ours there would refuse valid configs (GLM-4-MoE: 96 heads over a hidden size of 4,096).

A ``config.json`` dict must also set every size that defines the parameters and FLOPs where transformers' default
is a number (:func:`check_required_fields`): a missing or misspelled ``hidden_size`` would otherwise plan
Llama's 4,096 without a word.
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
#: the sizes that define a model's parameters and FLOPs, by their standard names (a config class spells some its
#: own way, through its ``attribute_map``: GPT-2's ``n_embd``, T5's ``d_model``). A config.json must set each
#: one its ``model_type``'s class declares with a number for default: that number is some reference model's size
#: (Llama's ``hidden_size`` 4096), not the user's. A None default is one transformers derives and is kept:
#: ``num_key_value_heads`` = ``num_attention_heads`` (noted: no grouped-query attention), ``head_dim`` = hidden
#: size / heads, GPT-2's ``n_inner`` = 4 x ``n_embd``.
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
               "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_topk")
_CLOSE = 0.6  # difflib ratio above which an unknown key is taken for a misspelling ("hidden_dim" ~ "hidden_size")


def check_config_dict(d: dict[str, Any], where: str) -> None:
    """Check a ``config.json`` dict's architecture fields (only those present; transformers fills the rest).

    Raises:
        ModelSpecError: ``"<where>: <field> <value> <rule>"`` for the first bad field.
    """
    _check(lambda k: d.get(k, _MISSING), where, json_names=True)


def check_required_fields(d: dict[str, Any], where: str) -> list[str]:
    """Refuse a ``config.json`` dict (with a known ``model_type``) that leaves out a size transformers would
    silently fill with another model's number (:data:`SIZE_FIELDS`: the ones the ``model_type``'s class declares
    with a numeric default), suggesting the keys of ``d`` that look like misspellings of them.

    Returns:
        notes: each derived default kept (``num_key_value_heads`` unset: = ``num_attention_heads``).

    Raises:
        ModelSpecError: ``"<where>: hidden_size is not set ..."`` naming every missing size (as the config class
            spells it), the default that would have been used, and the close matches among the keys the class
            does not know (``'hidden_dim' is not a llama config field: did you mean hidden_size?``).
    """
    import difflib

    from transformers import CONFIG_MAPPING

    mt = d.get("model_type")
    cls = CONFIG_MAPPING[mt]
    try:
        default = cls()
    except Exception:  # noqa: BLE001  (a class without defaults: transformers names what it lacks when building)
        return []
    amap = dict(getattr(cls, "attribute_map", None) or {})
    # the class's declared defaults, not the built instance's values: a built LlamaConfig holds head_dim=128,
    # derived from its default sizes, where the declaration says None (derived from the user's sizes)
    declared = _declared_defaults(cls)
    missing: dict[str, tuple[Any, set[str]]] = {}  # the class's name -> (its default, every spelling)
    notes: list[str] = []
    for std in SIZE_FIELDS:
        name = amap.get(std, std)
        spellings = {std, name, *(k for k, v in amap.items() if v == name)}
        if name in missing or spellings & d.keys():
            continue
        if name not in declared:  # not a parameter of this class (or only through **kwargs): nothing defaulted
            continue
        value = declared[name]
        if _is_int(value):
            missing[name] = (value, spellings)
        elif value is None and name == "num_key_value_heads":
            notes.append("num_key_value_heads not set: transformers uses num_attention_heads (multi-head attention, "
                         "no grouped-query sharing); set it if the model shares key/value heads")
    if not missing:
        return notes
    known = _known_fields(default) | set(amap)
    hints = []
    for k in (k for k in d if k not in known and not _has(default, k)):  # keys transformers would keep unused
        for name, (_, spellings) in missing.items():
            if difflib.get_close_matches(k, sorted(spellings), n=1, cutoff=_CLOSE):
                hints.append(f" {k!r} is not a {mt} config field: did you mean {name}?")
                break
    one = len(missing) == 1
    raise ModelSpecError(
        f"{where}: {', '.join(missing)} {'is' if one else 'are'} not set, so transformers would fill "
        f"{'it' if one else 'them'} with its {mt} default{'' if one else 's'} "
        f"({', '.join(f'{n}={v}' for n, (v, _) in missing.items())}), another model's size{'' if one else 's'}; "
        f"set {'it' if one else 'them'} in the config.{''.join(hints)}")


def _declared_defaults(cls: type) -> dict[str, Any]:
    """The keyword defaults a config class's ``__init__`` declares (``{"hidden_size": 4096, "head_dim": None}``)."""
    import inspect

    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _known_fields(cfg: Any) -> set[str]:
    """The field names of a built config (what ``to_dict`` holds), {} if it cannot say."""
    try:
        return set(cfg.to_dict())
    except Exception:  # noqa: BLE001
        return set()


def _has(cfg: Any, k: str) -> bool:
    return _getter(cfg)(k) is not _MISSING


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

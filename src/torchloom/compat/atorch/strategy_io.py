"""Reading and writing ATorch strategies without unpickling arbitrary classes.

``save_strategy`` writes JSON whatever the file name (ATorch pickles). Tuples, torch dtypes and module
classes are tagged so a strategy reads back equal: ``{"__tuple__": [...]}``, ``{"__dtype__": "float16"}``,
``{"__class__": "torch.nn.modules.linear.Linear"}``. Only ``torch.nn`` classes are resolved on reading;
another class (a model's block, e.g. ``GPT2Block``) reads back as its class name, which the checkpoint and
FSDP options accept as well (torchloom matches blocks by class name).

ATorch's own strategy files and ``pickle.dumps(strategy)`` bytes are read by :func:`restricted_loads`,
whose unpickler admits plain containers, strings, numbers, torch dtypes, ``torch.nn`` module classes and
the ``Strategy`` class (ATorch's ``atorch.auto.strategy.Strategy`` or ours, both read as ours). Any other
global (a function, ``os.system``, a class of another package) is refused with :class:`StrategyPickleError`.
"""
from __future__ import annotations

import io
import json
import pickle
import sys
from typing import Any

import torch
from torch import nn

from ...errors import StrategyError

JSON_FORMAT = "torchloom.compat.atorch.strategy"
JSON_VERSION = 1
_STRATEGY_CLASSES = {("atorch.auto.strategy", "Strategy"), ("torchloom.compat.atorch.auto.strategy", "Strategy")}


class StrategyPickleError(StrategyError):
    """A pickled strategy names a global the restricted unpickler does not admit."""


# -- JSON -------------------------------------------------------------------------------------------
def encode_value(v: Any) -> Any:
    """A strategy config as JSON-able data (tuples, dtypes and classes tagged).

    Raises:
        StrategyError: a value JSON cannot hold (a function, a module instance, a non-string dict key...).
    """
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tuple):
        return {"__tuple__": [encode_value(x) for x in v]}
    if isinstance(v, list):
        return [encode_value(x) for x in v]
    if isinstance(v, dict):
        bad = [k for k in v if not isinstance(k, str)]
        if bad:
            raise StrategyError(f"cannot save a strategy config with non-string key(s) {bad!r}: JSON keys are strings.")
        if any(k.startswith("__") and k.endswith("__") for k in v):
            raise StrategyError(f"cannot save config keys of the form '__x__' ({sorted(v)}): they are JSON tags here.")
        return {k: encode_value(x) for k, x in v.items()}
    if isinstance(v, torch.dtype):
        return {"__dtype__": str(v).removeprefix("torch.")}
    if isinstance(v, type):
        return {"__class__": f"{v.__module__}.{v.__qualname__}"}
    raise StrategyError(
        f"cannot save {type(v).__name__} {v!r:.80} in a strategy: strategy files are JSON and hold plain values, "
        "torch dtypes and classes only (write a module class, or its name, instead of an instance or a function)."
    )


def decode_value(v: Any) -> Any:
    """Inverse of :func:`encode_value`; a non-``torch.nn`` class comes back as its class name."""
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if isinstance(v, dict):
        if set(v) == {"__tuple__"}:
            return tuple(decode_value(x) for x in v["__tuple__"])
        if set(v) == {"__dtype__"}:
            return _dtype(v["__dtype__"])
        if set(v) == {"__class__"}:
            return _class_or_name(v["__class__"])
        return {k: decode_value(x) for k, x in v.items()}
    return v


def to_json(strategy) -> str:
    """The JSON text :func:`save_strategy` writes."""
    items = []
    for item in strategy.opt_list:
        if not isinstance(item, (tuple, list)) or len(item) != 3:
            raise StrategyError(f"cannot save strategy item {item!r:.120}: each item is (name, config, tunable).")
        items.append([item[0], encode_value(item[1]), item[2]])
    return json.dumps({"format": JSON_FORMAT, "version": JSON_VERSION, "opt_list": items}, indent=2) + "\n"


def from_json(text: str):
    """A :class:`Strategy` from :func:`to_json` text.

    Raises:
        StrategyError: not this format, another version, or malformed items.
    """
    from .auto.strategy import Strategy

    data = json.loads(text)
    if not isinstance(data, dict) or data.get("format") != JSON_FORMAT:
        raise StrategyError(f"not an ATorch-compat strategy file (expected 'format': '{JSON_FORMAT}').")
    if data.get("version") != JSON_VERSION:
        raise StrategyError(f"ATorch-compat strategy file version {data.get('version')!r} is not supported "
                            f"(reads version {JSON_VERSION}).")
    out = []
    for item in data.get("opt_list", []):
        if not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], str):
            raise StrategyError(f"malformed strategy item {item!r:.120} (expected [name, config, tunable]).")
        out.append((item[0], decode_value(item[1]), item[2]))
    return Strategy(out)


def _dtype(name: str) -> torch.dtype:
    d = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(d, torch.dtype):
        raise StrategyError(f"unknown torch dtype {name!r} in strategy file.")
    return d


def _class_or_name(path: str):
    module, _, name = path.rpartition(".")
    cls = _torch_nn_class(module, name)
    return cls if cls is not None else name


def _torch_nn_class(module: str, name: str):
    """The ``torch.nn`` module class ``module.name``, or None (only torch.nn's own modules are looked at)."""
    if not (module == "torch.nn" or module.startswith("torch.nn.")) or not name.isidentifier():
        return None
    mod = sys.modules.get(module)  # only modules already imported: reading a strategy imports nothing
    obj = getattr(mod, name, None) if mod is not None else None
    return obj if isinstance(obj, type) and issubclass(obj, nn.Module) else None


# -- restricted pickle ------------------------------------------------------------------------------
class _ClassRef:
    """A ``torch.nn`` class named by a pickle, admitted as a value only: calling it while loading (a pickle
    that builds ``nn.Linear(10000, 10000)``) raises; after loading it is replaced by the class itself."""

    __slots__ = ("cls",)

    def __init__(self, cls: type):
        self.cls = cls

    def __call__(self, *args, **kwargs):
        raise StrategyPickleError(
            f"the pickle constructs {self.cls.__module__}.{self.cls.__qualname__} while loading: refused (a strategy "
            "holds module classes as values, never instances)."
        )

    def __reduce__(self):  # never re-pickled as a reference
        raise StrategyPickleError("a class reference from a strategy pickle cannot be pickled")


def _resolve_refs(v: Any) -> Any:
    """``v`` with every :class:`_ClassRef` replaced by its class (containers rebuilt)."""
    if isinstance(v, _ClassRef):
        return v.cls
    if isinstance(v, tuple):
        return tuple(_resolve_refs(x) for x in v)
    if isinstance(v, list):
        return [_resolve_refs(x) for x in v]
    if isinstance(v, dict):
        return {_resolve_refs(k): _resolve_refs(x) for k, x in v.items()}
    if isinstance(v, (set, frozenset)):
        return type(v)(_resolve_refs(x) for x in v)
    return v


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        from .auto.strategy import Strategy

        if (module, name) in _STRATEGY_CLASSES:
            return Strategy
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        cls = _torch_nn_class(module, name)
        if cls is not None:
            return _ClassRef(cls)
        raise StrategyPickleError(
            f"refused to unpickle the strategy: it names '{module}.{name}', which is not admitted. Strategy "
            "pickles may hold only plain containers, strings, numbers, torch dtypes, torch.nn module classes "
            "and the Strategy class; a strategy naming other classes or callables could run code when loaded. "
            "Give a model class by its name instead (e.g. ('checkpoint', 'GPT2Block')), or save the strategy "
            "with torchloom.compat.atorch.save_strategy, which writes JSON."
        )


def restricted_loads(data: bytes):
    """Unpickle ATorch strategy bytes with the restricted unpickler and check the result is a Strategy.

    Raises:
        StrategyPickleError: a global that is not admitted.
        StrategyError: bytes that are not a pickled Strategy.
    """
    from .auto.strategy import Strategy

    try:
        obj = _RestrictedUnpickler(io.BytesIO(data)).load()
    except StrategyError:
        raise
    except Exception as e:  # truncated or corrupt bytes, a bad state
        raise StrategyError(f"cannot read the pickled strategy: {type(e).__name__}: {e}") from e
    if not isinstance(obj, Strategy):
        raise StrategyError(f"the pickle holds a {type(obj).__name__}, not an ATorch Strategy.")
    obj.opt_list = _resolve_refs(list(obj.opt_list))
    leftover = [k for k in vars(obj) if k != "opt_list"] if hasattr(obj, "__dict__") else []
    for k in leftover:
        setattr(obj, k, _resolve_refs(getattr(obj, k)))
    for item in obj.opt_list:
        if not isinstance(item, (tuple, list)) or len(item) != 3 or not isinstance(item[0], str):
            raise StrategyError(f"a Strategy item must be a (name, config, tunable) triple; got {item!r:.200}")
    return obj


def read_strategy_bytes(data: bytes, source: str = "strategy"):
    """A Strategy from a file's bytes: this module's JSON, else an ATorch pickle (restricted)."""
    head = data.lstrip()[:1]
    if head == b"{":
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise StrategyError(f"{source} is neither JSON text nor a pickle: {e}") from e
        try:
            return from_json(text)
        except ValueError as e:
            raise StrategyError(f"{source}: {e}") from e
    return restricted_loads(data)

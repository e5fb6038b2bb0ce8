"""Config values from plain data (YAML, JSON, Python literals), typed by dataclass annotations.

The one value coercer behind method configs (``strategy/config.py``) and the training config
(``train/config.py``), so a type is read the same way wherever a user writes it.

Rules (``coerce_value``):

* ``bool``: only ``True``/``False`` (never 0/1 or "yes"); ``str``: only strings.
* ``int``: an int (not a bool), or a float with an integral value (``2.0`` -> ``2``).
* ``float``: an int or a float (not a bool), or a string that parses as a float (YAML 1.1 reads ``3e-4``
  without a dot as a string).
* ``Literal[...]``: one of the values, with the same type (``True`` is not ``1``).
* ``X | Y`` / ``Optional[X]``: the first member the value fits exactly; only if none does, the first one it
  converts to (so ``float | str`` keeps ``"1e3"`` a string).
* ``list[X]`` / ``tuple[X, ...]`` / ``tuple[X, Y]`` / ``Sequence[X]``: a list or tuple, item by item
  (errors name the item: ``data.eval_plays[1]``); a tuple annotation gives a tuple.
* ``dict[K, V]``: a mapping, key by key and value by value.
* another class: an instance of it. ``Any`` and annotations not listed: the value unchanged.
"""
from __future__ import annotations

import collections.abc
import types
import typing
from typing import Any, Literal, Union


class _Mismatch(Exception):
    def __init__(self, where: str, tp: Any, value: Any):
        super().__init__(where)
        self.where, self.tp, self.value = where, tp, value


def coerce_value(value: Any, tp: Any, name: str, error: type[Exception] = TypeError) -> Any:
    """``value`` as the annotation ``tp`` (see the module docstring for the rules).

    Args:
        value: plain data (from YAML/JSON or Python).
        tp: a type annotation (resolved, e.g. from ``typing.get_type_hints``).
        name: how the value is named in errors (``"train.lr"``, ``"method 'ddp': config key 'x'"``).
        error: the exception class raised on a mismatch (``StrategyError``, ``ConfigError``, ...).

    Raises:
        error: ``"<name>[<item>] expects <type>, got <value> (<its type>)."``, naming the innermost item
            that does not fit.
    """
    try:
        return _convert(tp, value, "", lenient=False)
    except _Mismatch:
        pass
    try:
        return _convert(tp, value, "", lenient=True)
    except _Mismatch as m:
        raise error(f"{name}{m.where} expects {describe_type(m.tp)}, got {m.value!r} "
                    f"({type(m.value).__name__}).") from None


def describe_type(tp: Any) -> str:
    """A short readable name of an annotation: ``one of 'a', 'b'``, ``int or None``, ``list of str``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(describe_type(a) for a in args)
    if tp is type(None):
        return "None"
    if tp is bool:
        return "bool (true or false)"
    if _is_sequence(tp):
        items = _sequence_items(tp)
        kind = "tuple" if _is_tuple(tp) else "list"
        if items is None:
            return kind
        if isinstance(items, list):
            return f"{kind} of ({', '.join(describe_type(a) for a in items)})"
        return f"{kind} of {describe_type(items)}"
    if origin is dict or tp is dict or origin is collections.abc.Mapping:
        return "mapping" if not args else f"mapping of {describe_type(args[0])} to {describe_type(args[1])}"
    return getattr(tp, "__name__", str(tp))


def _is_tuple(tp: Any) -> bool:
    return tp is tuple or typing.get_origin(tp) is tuple


def _is_sequence(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    return tp in (list, tuple) or origin in (list, tuple, collections.abc.Sequence)


def _sequence_items(tp: Any):
    """The item annotation (one for all items), a list (a fixed-length tuple), or None (unchecked)."""
    args = typing.get_args(tp)
    if not args:
        return None
    if _is_tuple(tp) and not (len(args) == 2 and args[1] is Ellipsis):
        return list(args)
    return args[0]


def _convert(tp: Any, value: Any, where: str, lenient: bool) -> Any:
    if tp is Any or tp is object:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        for a in args:
            if value == a and type(value) is type(a):
                return a
        raise _Mismatch(where, tp, value)
    if origin in (Union, types.UnionType):
        misses = []
        for convert in ((False, True) if lenient else (False,)):  # an exact fit first, then a conversion
            for a in args:
                try:
                    return _convert(a, value, where, convert)
                except _Mismatch as m:
                    misses.append(m)
        inner = max(misses, key=lambda m: len(m.where))  # the member whose shape fitted (a list, a mapping)
        raise inner if len(inner.where) > len(where) else _Mismatch(where, tp, value)
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch(where, tp, value)
    if _is_sequence(tp):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch(where, tp, value)
        items = _sequence_items(tp)
        if isinstance(items, list):
            if len(value) != len(items):
                raise _Mismatch(where, tp, value)
            out = [_convert(a, v, f"{where}[{i}]", lenient) for i, (a, v) in enumerate(zip(items, value))]
        else:
            item = Any if items is None else items
            out = [_convert(item, v, f"{where}[{i}]", lenient) for i, v in enumerate(value)]
        return tuple(out) if _is_tuple(tp) else out
    if origin is dict or tp is dict or origin is collections.abc.Mapping:
        if not isinstance(value, collections.abc.Mapping):
            raise _Mismatch(where, tp, value)
        if not args:
            return dict(value)
        kt, vt = args
        return {_convert(kt, k, f"{where}[{k!r}]", lenient): _convert(vt, v, f"{where}[{k!r}]", lenient)
                for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch(where, tp, value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if lenient and isinstance(value, float) and value.is_integer():
            return int(value)
        raise _Mismatch(where, tp, value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if lenient and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise _Mismatch(where, tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch(where, tp, value)
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _Mismatch(where, tp, value)
    return value  # an annotation these rules do not cover (a TypeVar, a Protocol, ...): unchecked

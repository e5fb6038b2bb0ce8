"""Build a method's config dataclass from a plain dict, with errors that name the fix."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

from ..errors import StrategyError
from ..utils import did_you_mean


def build_config(method: str, cls: type, values: dict[str, Any] | None, key_aliases: dict[str, str] | None = None):
    """Instantiate dataclass ``cls`` from ``values``.

    Raises:
        StrategyError: an unknown key (the message lists the valid keys and the closest one) or a value
            of the wrong type (the message names the key, the expected type and the value given).
    """
    values = dict(values or {})
    for old, new in (key_aliases or {}).items():
        if old in values:
            values[new] = values.pop(old)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in fields:
            raise StrategyError(
                f"method '{method}' has no config key '{key}'.{did_you_mean(key, fields)} "
                f"Valid keys: {', '.join(sorted(fields)) or '(none)'}."
            )
        values[key] = _check(method, key, hints[key], value)
    return cls(**values)


def _check(method: str, key: str, tp: Any, value: Any) -> Any:
    ok, coerced = _coerce(tp, value)
    if not ok:
        raise StrategyError(
            f"method '{method}': config key '{key}' expects {_type_name(tp)}, got {value!r} "
            f"({type(value).__name__})."
        )
    return coerced


def _coerce(tp: Any, value: Any) -> tuple[bool, Any]:
    if tp is Any:
        return True, value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return (value in args), value
    if origin in (Union, types.UnionType):
        for a in args:
            ok, v = _coerce(a, value)
            if ok:
                return True, v
        return False, value
    if tp is type(None):
        return value is None, value
    if origin in (list, tuple, typing.Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        inner = args[0] if args else Any
        out = []
        for v in value:
            ok, c = _coerce(inner, v)
            if not ok:
                return False, value
            out.append(c)
        return True, (tuple(out) if (origin is tuple or tp is tuple) else out)
    if origin is dict or tp is dict:
        return isinstance(value, dict), value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return (isinstance(value, int) and not isinstance(value, bool)), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if callable(tp) and isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def config_to_dict(config: Any) -> dict[str, Any]:
    """Only the fields that differ from their defaults (keeps saved strategies short)."""
    out = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING
        )
        if v != default:
            out[f.name] = list(v) if isinstance(v, tuple) else v
    return out

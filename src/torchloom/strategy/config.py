"""Build a method's config dataclass from a plain dict, with errors that name the fix."""
from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

from ..config_values import coerce_value
from ..errors import StrategyError
from ..utils import did_you_mean


def build_config(method: str, cls: type, values: dict[str, Any] | None, key_aliases: dict[str, str] | None = None):
    """Instantiate dataclass ``cls`` from ``values``.

    Raises:
        StrategyError: an unknown key (the message lists the valid keys and the closest one) or a value
            of the wrong type (the message names the key, the expected type and the value given). Values
            are read by :func:`torchloom.config_values.coerce_value`, the same rules as ``loom train``'s config.
    """
    values = dict(values or {})
    for old, new in (key_aliases or {}).items():
        if old in values:
            values[new] = values.pop(old)
    fields, hints = _schema(cls)
    for key, value in values.items():
        if key not in fields:
            raise StrategyError(
                f"method '{method}' has no config key '{key}'.{did_you_mean(key, fields)} "
                f"Valid keys: {', '.join(sorted(fields)) or '(none)'}."
            )
        values[key] = coerce_value(value, hints[key], f"method '{method}': config key '{key}'", StrategyError)
    return cls(**values)


@functools.lru_cache(maxsize=None)
def _schema(cls: type) -> tuple[dict[str, dataclasses.Field], dict[str, Any]]:
    """Fields and resolved type hints of a config class (``get_type_hints`` re-evaluates every annotation
    string on each call: the search builds a strategy per candidate, thousands for a large cluster)."""
    return {f.name: f for f in dataclasses.fields(cls)}, typing.get_type_hints(cls)


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

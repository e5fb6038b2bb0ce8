"""`Strategy`: an ordered list of named methods with configs. Parses ATorch-style lists, JSON/YAML
files (versioned, never pickle) and round-trips through them."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Union

import torch

from ..errors import StrategyError
from .config import build_config, config_to_dict
from .registry import Method, resolve_name

FORMAT_VERSION = 1
FILE_SUFFIXES = (".json", ".yaml", ".yml")
ACCEPTED_FORMS = ("Accepted: a list of methods (['fsdp', ('amp', {'dtype': 'bfloat16'})]), one method name ('fsdp'), "
                  "a Strategy, a .json/.yaml/.yml file path (str or Path), a {'version': 1, 'methods': [...]} dict, "
                  "or None (docs/strategy.md).")

MethodSpecLike = Union[str, tuple, list, dict, Method]
StrategyLike = Union["Strategy", str, Path, Iterable[MethodSpecLike], None]


@dataclass
class MethodEntry:
    """One method of a strategy: canonical ``name`` and a validated ``config`` dataclass."""

    name: str
    config: Any
    #: True when added because another method implies it (shown in repr, not saved).
    implied: bool = False

    def instantiate(self) -> Method:
        cls, _ = resolve_name(self.name)
        return cls(self.config)

    def to_dict(self) -> dict[str, Any]:
        cfg = config_to_dict(self.config)
        return {"name": self.name, "config": cfg} if cfg else {"name": self.name}


class Strategy:
    """A validated, ordered list of methods.

    Args:
        methods: each item is a name (``"fsdp"``), a ``(name, config)`` pair (ATorch style; ``config`` a
            dict, or the ATorch tuple form for ``parallel_mode``), a ``{"name": ..., "config": ...}`` dict,
            or a one-key ``{name: config}`` dict. Aliases (``zero2``, ``amp_native``, ...) resolve to their
            canonical method with the config they imply.

    Raises:
        StrategyError: ``methods`` not a list/tuple/iterable of items (a name, a path, a dict, a set, an
            int...), unknown method (closest names suggested), unknown config key (valid keys listed),
            bad value type, a method listed twice, a missing requirement, or a conflicting pair (both
            names and the reason).
    """

    def __init__(self, methods: Iterable[MethodSpecLike] = ()):
        if isinstance(methods, (str, bytes, Path, dict, set, frozenset)) or not isinstance(methods, Iterable):
            raise StrategyError(
                f"Strategy(methods) takes a list of methods; got {type(methods).__name__} {_short_repr(methods)}. "
                "Strategy.parse(...) reads a method name, a file path or a file dict. " + ACCEPTED_FORMS
            )
        entries: list[MethodEntry] = []
        for item in methods:
            entries.append(_parse_item(item))
        seen: dict[str, int] = {}
        for e in entries:
            if e.name in seen:
                raise StrategyError(
                    f"method '{e.name}' is listed twice (an alias counts as its method); merge the two configs "
                    "into one entry."
                )
            seen[e.name] = 1
        entries = _add_implied(entries)
        _check_requires_and_conflicts(entries)
        self.entries = entries

    # -- queries -------------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def __contains__(self, name: str) -> bool:
        return any(e.name == name for e in self.entries)

    def config(self, name: str) -> Any | None:
        """The config of method ``name`` (canonical name), or None if absent."""
        for e in self.entries:
            if e.name == name:
                return e.config
        return None

    def ordered(self) -> list[Method]:
        """Method instances in application order (by stage; ties keep list order)."""
        insts = [e.instantiate() for e in self.entries]
        return sorted(insts, key=lambda m: type(m).stage)

    def with_method(self, item: MethodSpecLike) -> "Strategy":
        """A copy with one more method (validated)."""
        return Strategy([*self.to_list(explicit_only=True), item])

    # -- serialisation -------------------------------------------------------------------------------
    def to_list(self, explicit_only: bool = False) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.entries if not (explicit_only and e.implied)]

    def to_dict(self) -> dict[str, Any]:
        return {"version": FORMAT_VERSION, "methods": self.to_list(explicit_only=True)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Strategy":
        if not isinstance(data, dict) or "methods" not in data:
            raise StrategyError(
                "a strategy file must be a mapping with keys 'version' and 'methods' "
                "(e.g. {version: 1, methods: [fsdp, amp]})."
            )
        version = data.get("version", FORMAT_VERSION)
        if not isinstance(version, int) or isinstance(version, bool):
            raise StrategyError(f"strategy file 'version' must be an integer (e.g. version: {FORMAT_VERSION}), got {version!r}.")
        if version != FORMAT_VERSION:
            raise StrategyError(
                f"strategy file version {version} is not supported by this torchloom (reads version "
                f"{FORMAT_VERSION}); upgrade torchloom or rewrite the file."
            )
        extra = set(data) - {"version", "methods", "plan"}
        if extra:
            raise StrategyError(f"unknown top-level key(s) {sorted(extra)} in strategy file; valid: version, methods "
                                "(and plan, in plan files written by the strategy search).")
        methods = data["methods"] or []
        if not isinstance(methods, list):
            raise StrategyError(
                f"strategy file 'methods' must be a list (e.g. methods: [fsdp, amp]), got {type(methods).__name__} "
                f"{methods!r}."
            )
        return cls(methods)

    def save(self, path: str | Path) -> Path:
        """Write the strategy as JSON (``.json``) or YAML (``.yaml``/``.yml``)."""
        path = Path(path)
        data = self.to_dict()
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            path.write_text(yaml.safe_dump(data, sort_keys=False))
        elif path.suffix.lower() == ".json":
            path.write_text(json.dumps(data, indent=2) + "\n")
        else:
            raise StrategyError(f"cannot save a strategy to '{path}': use a .json, .yaml or .yml file name.")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Strategy":
        """Read a JSON/YAML strategy file (safe loaders only; pickle is never accepted).

        Raises:
            StrategyError: naming the file: missing, unsupported suffix, unreadable (a directory, no
                permission), not UTF-8 text (e.g. pickle bytes under a .json name), unparsable content, or an
                invalid strategy inside it.
        """
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in FILE_SUFFIXES:
            raise StrategyError(
                f"strategy file '{path}' must end in .json, .yaml or .yml (pickle files are never loaded; a string "
                "with '.' or '/' is read as a file path, a method name has neither)."
            )
        if not path.exists():
            raise StrategyError(f"strategy file '{path}' does not exist.")
        try:
            raw = path.read_bytes()
        except OSError as e:  # a directory, no permission, ...
            raise StrategyError(f"cannot read strategy file '{path}': {e.strerror or e}.") from e
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            hint = " It looks like a pickle;" if raw[:1] == b"\x80" else " Is it a binary file?"
            raise StrategyError(
                f"strategy file '{path}' is not UTF-8 text ({e.reason} at byte {e.start}).{hint} strategy files "
                "are JSON or YAML (Strategy.save writes them); pickle files are never loaded."
            ) from e
        try:
            if suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except ValueError as e:  # json.JSONDecodeError
            raise StrategyError(f"cannot parse strategy file '{path}': {e}") from e
        except Exception as e:
            if type(e).__module__.startswith("yaml"):  # yaml.YAMLError
                raise StrategyError(f"cannot parse strategy file '{path}': {e}") from e
            raise
        try:
            return cls.from_dict(data)
        except StrategyError as e:
            raise StrategyError(f"strategy file '{path}': {e}") from e

    @classmethod
    def parse(cls, strategy: StrategyLike) -> "Strategy":
        """Accept a Strategy, a file path, a method name, a list (or tuple) of methods, a file dict, or None
        (empty strategy).

        A string is a file path when it ends in .json/.yaml/.yml or looks like a path (it contains '.',
        '/' or '\\', which no method name does); any other string is one method name.

        Raises:
            StrategyError: a value of another type (named, with the accepted forms), a path-like string
                with another suffix, or any error of :meth:`load` / :class:`Strategy`.
        """
        if strategy is None:
            return cls([])
        if isinstance(strategy, Strategy):
            return strategy
        if isinstance(strategy, (str, Path)):
            if isinstance(strategy, str) and strategy == "auto":
                raise StrategyError(
                    "strategy='auto' runs the strategy search, which needs the model, the world size and the batch: "
                    "pass it to auto_accelerate(..., strategy='auto') or `loom train --set strategy=auto` (or plan "
                    "with `loom plan`); here give a list of methods, e.g. ['fsdp', 'amp'], or a strategy file."
                )
            if isinstance(strategy, str) and not _is_path_like(strategy):
                # a single method name is a convenient shorthand
                return cls([strategy])
            return cls.load(strategy)
        if isinstance(strategy, dict):
            return cls.from_dict(strategy)
        if isinstance(strategy, (set, frozenset)):
            raise StrategyError(
                f"strategy is a {type(strategy).__name__} {sorted(strategy, key=repr)}: its order is arbitrary, and "
                "the order of methods matters (ties in the application order keep it). Pass a list. "
                + ACCEPTED_FORMS
            )
        if isinstance(strategy, (bytes, bytearray, memoryview)) or not isinstance(strategy, Iterable):
            raise StrategyError(
                f"strategy must be a list of methods, a Strategy, a file path or None; got "
                f"{type(strategy).__name__} {_short_repr(strategy)}. " + ACCEPTED_FORMS
            )
        return cls(list(strategy))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Strategy) and self.to_list() == other.to_list()

    def __repr__(self) -> str:
        parts = []
        for e in self.entries:
            cfg = config_to_dict(e.config)
            s = e.name + (f"({', '.join(f'{k}={v!r}' for k, v in cfg.items())})" if cfg else "")
            parts.append(s + (" [implied]" if e.implied else ""))
        return f"Strategy[{', '.join(parts)}]"


def _is_path_like(s: str) -> bool:
    """A string with a .json/.yaml/.yml suffix, or with '.', '/' or '\\' that is not a registered method
    name or alias (the built-in names are identifiers), names a file."""
    from .registry import _ALIASES, _REGISTRY

    if s.lower().endswith(FILE_SUFFIXES):
        return True
    return s not in _REGISTRY and s not in _ALIASES and any(c in s for c in "./\\")


def _short_repr(v: Any, limit: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _normalise_value(v: Any) -> Any:
    """ATorch configs carry torch dtypes and module classes; store them by name so files stay plain."""
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    if isinstance(v, type):
        return v.__name__
    if isinstance(v, (list, tuple, set)):
        return [_normalise_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _normalise_value(x) for k, x in v.items()}
    return v


def _parse_item(item: MethodSpecLike) -> MethodEntry:
    if isinstance(item, Method):
        return MethodEntry(type(item).name, item.config)
    if isinstance(item, str):
        name, raw = item, None
    elif isinstance(item, (tuple, list)):
        if len(item) == 1:
            name, raw = item[0], None
        elif len(item) == 2:
            name, raw = item
        else:
            raise StrategyError(f"a strategy item must be a name or a (name, config) pair; got {item!r}.")
    elif isinstance(item, dict):
        if "name" in item:
            extra = set(item) - {"name", "config"}
            if extra:
                raise StrategyError(f"strategy item {item!r} has unknown keys {sorted(extra)}; use 'name' and 'config'.")
            name, raw = item["name"], item.get("config")
        elif len(item) == 1:
            (name, raw), = item.items()
        else:
            raise StrategyError(f"a strategy item dict needs a 'name' key (or exactly one {{name: config}}); got {item!r}.")
    else:
        raise StrategyError(f"cannot read strategy item {item!r}: use a method name or a (name, config) pair.")
    if not isinstance(name, str):
        raise StrategyError(f"a method name must be a string; got {name!r}.")
    if name == "auto":
        raise StrategyError(
            "'auto' is not a method: strategy='auto' (the strategy search) stands alone, not inside a list. To pin "
            "or exclude methods in the search use search={'include': [...], 'exclude': [...], 'fixed': {'tp': 2}}."
        )
    cls, overrides = resolve_name(name)
    raw = cls.normalise_config(raw) if hasattr(cls, "normalise_config") else raw
    if raw is not None and not isinstance(raw, dict):
        raise StrategyError(f"the config of method '{cls.name}' must be a mapping of options; got {raw!r}.")
    values = {**overrides, **_normalise_value(raw or {})}
    return MethodEntry(cls.name, build_config(cls.name, cls.Config, values, cls.key_aliases))


def _add_implied(entries: list[MethodEntry]) -> list[MethodEntry]:
    names = {e.name for e in entries}
    out = list(entries)
    i = 0
    while i < len(out):
        cls, _ = resolve_name(out[i].name)
        for dep in cls.implies:
            dep_cls, over = resolve_name(dep)
            if dep_cls.name not in names and not _has_conflict(dep_cls.name, names):
                out.append(MethodEntry(dep_cls.name, build_config(dep_cls.name, dep_cls.Config, over), implied=True))
                names.add(dep_cls.name)
        i += 1
    return out


def _conflict_reason(a: str, b: str) -> str | None:
    ca, _ = resolve_name(a)
    cb, _ = resolve_name(b)
    return ca.conflicts.get(b) or cb.conflicts.get(a)


def _has_conflict(name: str, names: set[str]) -> bool:
    return any(_conflict_reason(name, n) for n in names)


def _check_requires_and_conflicts(entries: list[MethodEntry]) -> None:
    names = [e.name for e in entries]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            why = _conflict_reason(a, b)
            if why:
                raise StrategyError(f"methods '{a}' and '{b}' cannot be combined: {why}")
    for e in entries:
        cls, _ = resolve_name(e.name)
        for req in cls.requires:
            options = req.split("|")
            if not any(o in names for o in options):
                need = " or ".join(f"'{o}'" for o in options)
                raise StrategyError(f"method '{e.name}' requires {need}; add it to the strategy.")

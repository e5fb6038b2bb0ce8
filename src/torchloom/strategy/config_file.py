"""The torchloom config file that ``loom config`` writes: a default strategy for ``auto_accelerate(strategy=None)``
and launch settings for ``loom run`` (docs/config.md).

Lookup order, first match wins (:func:`locate`):

1. an explicit path (``loom run --config-file PATH``, ``loom config --file PATH``): it must exist;
2. ``$TORCHLOOM_CONFIG_FILE``: a path, which must exist, or ``none`` (any case): no config file at all;
3. ``./torchloom.yaml`` in the working directory (a per-project file);
4. the user default ``<cache>/default_config.yaml``, ``<cache>`` being ``$TORCHLOOM_CACHE_DIR``, else
   ``$TORCHLOOM_CACHE``, else ``$XDG_CACHE_HOME/torchloom``, else ``~/.cache/torchloom``.

An empty ``$TORCHLOOM_CONFIG_FILE`` counts as unset. The file is YAML::

    config_version: 1
    strategy: [fsdp, {amp: {dtype: bfloat16}}]   # as auto_accelerate(strategy=...) takes a list; null = none
    launch: {nproc: 2, nnodes: "1"}               # loom run's options, underscored; its flags win

It is validated when written and when read; every problem is a :class:`ConfigFileError` naming the file,
how it was found, and the fix.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import StrategyError
from ..utils import did_you_mean
from .strategy import Strategy, _is_path_like

log = logging.getLogger("torchloom")

CONFIG_VERSION = 1
ENV_VAR = "TORCHLOOM_CONFIG_FILE"
PROJECT_FILE = "torchloom.yaml"
DEFAULT_NAME = "default_config.yaml"
TOP_KEYS = ("config_version", "strategy", "launch")
OFF = "none"
_HEADER = ("# torchloom config, written by `loom config` (docs/config.md).\n"
           "# strategy: used by auto_accelerate(strategy=None); launch: used by `loom run` (its flags win).\n"
           f"# Ignore this file with {ENV_VAR}=none, or per call with auto_accelerate(strategy=[]).\n")


class ConfigFileError(StrategyError):
    """The torchloom config file is missing (when named explicitly), unreadable or invalid."""


def launch_keys() -> tuple[str, ...]:
    """``loom run``'s settings a config file may hold: the fields of ``LaunchOptions`` but ``extra``."""
    from ..elastic.launcher import LaunchOptions

    return tuple(f.name for f in dataclasses.fields(LaunchOptions) if f.name != "extra")


@dataclass
class LoomConfig:
    """A validated config file.

    Attributes:
        strategy: the default strategy (a validated :class:`Strategy`), or None when the file gives none.
        launch: ``loom run`` settings by ``LaunchOptions`` field name (``nproc``, ``nnodes``, ...), only
            those the file sets.
        path: where it was read from (absolute), or None before it is saved.
        source: how it was found: ``"--file"``, ``"$TORCHLOOM_CONFIG_FILE"``, ``"working directory"`` or
            ``"user default"``.
    """

    strategy: Strategy | None = None
    launch: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"config_version": CONFIG_VERSION,
                "strategy": None if self.strategy is None else compact_methods(self.strategy),
                "launch": {k: int(v) if k == "nnodes" and v.isdigit() else v for k, v in self.launch.items()}}

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the file (creating its directory); returns the absolute path. Validates first, so a file
        ``loom config`` writes always reads back."""
        path = Path(path).expanduser().absolute()
        parse(self.to_dict(), path, "--file")  # the same checks as on read
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_HEADER + self.to_yaml())
        self.path = path
        return path

    def describe(self) -> str:
        """One line: ``strategy Strategy[fsdp, amp]; launch nproc=2, nnodes=1``."""
        launch = ", ".join(f"{k}={v}" for k, v in self.launch.items()) or "none"
        return f"strategy {'none' if self.strategy is None else repr(self.strategy)}; launch {launch}"


def compact_methods(strategy: Strategy) -> list[Any]:
    """The explicit methods as the shortest list a file reads back: ``fsdp`` or ``{amp: {dtype: float16}}``."""
    out: list[Any] = []
    for item in strategy.to_list(explicit_only=True):
        out.append({item["name"]: item["config"]} if "config" in item else item["name"])
    return out


# ------------------------------------------------------------------------------------------------ lookup
def cache_root() -> Path:
    """Where the user default lives (see the module docstring)."""
    for env in ("TORCHLOOM_CACHE_DIR", "TORCHLOOM_CACHE"):
        if os.environ.get(env):
            return Path(os.environ[env]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "torchloom"


def default_path() -> Path:
    """The user default file, ``<cache>/default_config.yaml`` (it need not exist)."""
    return cache_root() / DEFAULT_NAME


def write_target(explicit: str | os.PathLike | None = None) -> Path:
    """Where ``loom config`` writes: ``explicit``, else ``$TORCHLOOM_CONFIG_FILE`` when it names a path, else
    the user default.

    Raises:
        ConfigFileError: ``$TORCHLOOM_CONFIG_FILE=none`` and no explicit path (nowhere to write).
    """
    if explicit is not None:
        return Path(explicit).expanduser().absolute()
    env = os.environ.get(ENV_VAR, "").strip()
    if env.lower() == OFF:
        raise ConfigFileError(f"{ENV_VAR}=none turns the config file off, so there is no file to write; give "
                              f"--file PATH, or unset {ENV_VAR}.")
    return Path(env).expanduser().absolute() if env else default_path()


def locate(explicit: str | os.PathLike | None = None) -> tuple[Path, str] | None:
    """``(absolute path, how it was found)`` of the config file in use, or None (the lookup order is in the
    module docstring).

    Raises:
        ConfigFileError: an explicit path or ``$TORCHLOOM_CONFIG_FILE`` names a file that does not exist.
    """
    if explicit is not None:
        return _must_exist(Path(explicit), "the path given"), "--file"
    env = os.environ.get(ENV_VAR, "").strip()
    if env.lower() == OFF:
        return None
    if env:
        return _must_exist(Path(env), f"{ENV_VAR}={env}"), f"${ENV_VAR}"
    here = Path.cwd() / PROJECT_FILE
    if here.is_file():
        return here.absolute(), "working directory"
    user = default_path()
    if user.is_file():
        return user.absolute(), "user default"
    return None


def lookup_order() -> list[str]:
    """The places :func:`locate` looks, in order, for messages (``loom config show``)."""
    env = os.environ.get(ENV_VAR, "").strip()
    return [f"${ENV_VAR} ({'unset' if not env else env})", f"{Path.cwd() / PROJECT_FILE}", str(default_path())]


def _must_exist(path: Path, given: str) -> Path:
    path = path.expanduser().absolute()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigFileError(f"config file {path} ({given}) {what}; write one with `loom config --file {path}`, "
                              f"or point {ENV_VAR} elsewhere (none: no config file).")
    return path


def find(explicit: str | os.PathLike | None = None) -> LoomConfig | None:
    """The validated config file in use (:func:`locate`, then :func:`load`), or None when there is none."""
    where = locate(explicit)
    return None if where is None else load(*where)


# ------------------------------------------------------------------------------------------ read/validate
def load(path: str | os.PathLike, source: str = "--file") -> LoomConfig:
    """Read and validate the config file at ``path`` (``source``: how it was found, shown in errors).

    Raises:
        ConfigFileError: unreadable, not YAML, or invalid content (:func:`parse`).
    """
    path = Path(path).absolute()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"{_where(path, source)}: cannot read it ({e}).{_fix(path, source)}") from e
    import yaml

    try:
        data = yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigFileError(f"{_where(path, source)}: not valid YAML: {e}.{_fix(path, source)}") from e
    return parse(data, path, source)


def parse(data: Any, path: Path | None = None, source: str = "--file") -> LoomConfig:
    """Validate the parsed content of a config file.

    Raises:
        ConfigFileError: not a mapping; an unknown key (closest one suggested, valid keys listed); a missing or
            unsupported ``config_version``; a strategy that is not a list of methods or a method name, or an
            invalid one (the strategy check's message: unknown method, bad option, conflict); an unknown
            launch key, or a launch value of the wrong type or a bad ``nproc``/``nnodes``.
    """
    where, fix = _where(path, source), _fix(path, source)

    def bad(msg: str) -> ConfigFileError:
        return ConfigFileError(f"{where}: {msg}{fix}")

    if not isinstance(data, dict):
        raise bad(f"expected a mapping with keys {', '.join(TOP_KEYS)}, got {type(data).__name__} {data!r:.60}.")
    for key in data:
        if key not in TOP_KEYS:
            raise bad(f"unknown key {key!r}.{did_you_mean(str(key), TOP_KEYS)} Valid keys: {', '.join(TOP_KEYS)}.")
    version = data.get("config_version")
    if version is None:
        raise bad(f"no config_version (this torchloom reads config_version: {CONFIG_VERSION}).")
    if version != CONFIG_VERSION or isinstance(version, bool):
        raise bad(f"config_version {version!r} is not supported (this torchloom reads {CONFIG_VERSION}; a newer "
                  "torchloom may read it).")
    try:
        strategy = _parse_strategy(data.get("strategy"))
    except StrategyError as e:
        raise bad(f"strategy: {e}") from None
    launch = data.get("launch") or {}
    if not isinstance(launch, dict):
        raise bad(f"launch must be a mapping of loom run settings (e.g. launch: {{nproc: 2}}), got {launch!r}.")
    try:
        items = [_launch_item(k, v) for k, v in launch.items()]
        launch = dict(items)
        if len(launch) < len(items):
            raise ValueError("nproc is given twice (nproc and nproc_per_node); keep one")
    except ValueError as e:
        raise bad(f"launch: {str(e).rstrip('.')}.") from None
    return LoomConfig(strategy=strategy, launch=launch, path=path, source=source)


def _where(path: Path | None, source: str) -> str:
    if path is None:
        return "config"
    how = {"--file": "", "$TORCHLOOM_CONFIG_FILE": f" (from ${ENV_VAR})",
           "working directory": f" (./{PROJECT_FILE} in the working directory)",
           "user default": " (the user default)"}.get(source, f" ({source})")
    return f"config file {path}{how}"


def _fix(path: Path | None, source: str) -> str:
    if path is None:
        return ""
    off = "" if source == "--file" else f", or ignore it with {ENV_VAR}=none"
    return f" Fix the file, rewrite it with `loom config --file {path}`{off} (docs/config.md)."


def _parse_strategy(value: Any) -> Strategy | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value == "auto" or _is_path_like(value):
            raise StrategyError(f"{value!r} is not read from a config file: give a list of methods (e.g. "
                                "[fsdp, amp]); pass strategy='auto' or a strategy/plan file to auto_accelerate.")
        value = [value]
    if not isinstance(value, list):
        raise StrategyError(f"expected a list of methods (e.g. [fsdp, {{amp: {{dtype: bfloat16}}}}]), got "
                            f"{type(value).__name__} {value!r:.60}.")
    return Strategy(value)


def _launch_item(key: Any, value: Any) -> tuple[str, Any]:
    """One launch setting ``(key, value)``, typed as ``LaunchOptions`` declares it; ``nproc``/``nnodes`` checked as
    ``loom run`` would (so a bad file fails before any process starts)."""
    from ..config_values import coerce_value
    from ..elastic.launcher import LaunchOptions, _check_nproc

    keys = launch_keys()
    if key == "nproc_per_node":
        key = "nproc"
    if key not in keys:
        raise ValueError(f"unknown key {key!r}.{did_you_mean(str(key), keys)} Valid keys: {', '.join(keys)} "
                         "(loom run's options, with underscores).")
    if key == "nproc":
        try:  # the launcher's own check, as loom run applies it
            if isinstance(value, bool):
                raise ValueError(f"--nproc must be a positive integer; got {value!r}")
            s = _check_nproc(value)
        except ValueError as e:
            raise ValueError(str(e).removeprefix("--")) from None
        return key, int(s) if s.isdigit() else s
    if key == "nnodes":
        s = str(value).strip()
        if isinstance(value, bool) or not re.fullmatch(r"[1-9][0-9]*(:[1-9][0-9]*)?", s):
            raise ValueError(f"nnodes must be N or MIN:MAX (positive integers), got {value!r}.")
        return key, s
    hint = typing.get_type_hints(LaunchOptions)[key]
    return key, coerce_value(value, hint, key, ValueError)


@functools.lru_cache(maxsize=None)
def _loader():
    """PyYAML's SafeLoader without YAML 1.1's base-60 integers: unquoted ``nnodes: 1:2`` would read as 62."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    int_tag = "tag:yaml.org,2002:int"
    Loader.yaml_implicit_resolvers = {
        k: [(tag, rx) for tag, rx in v if tag != int_tag] for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(
        int_tag, re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
        list("-+0123456789"))
    return Loader


# ------------------------------------------------------------------------------- auto_accelerate pickup
def default_strategy(strategy: Any, model: Any) -> tuple[Any, str | None]:
    """``auto_accelerate``'s strategy: ``strategy`` itself unless it is None; for None, the config file's
    strategy when one is found, with a note for ``res.notes`` (also logged on rank 0). Call on every rank after
    the process group exists: with several ranks, they check that they all read the same strategy (a file on
    one node only would otherwise give ranks different strategies, a hang or a silently wrong job).

    Returns ``(strategy, note)``; ``note`` is None when nothing came from a file. ``strategy=[]`` (an empty
    list: plain data parallel) never reads the file. A model with ``torchloom.replicate``/``split``
    annotations keeps the strategy they give; the file's strategy is then ignored, and the note says so.

    Raises:
        ConfigFileError: the file in use is invalid (on every rank, naming the rank that read it), or the
            ranks read different strategies.
    """
    if strategy is not None:
        return strategy, None
    from .annotations import has_annotations

    found, error = None, None
    try:
        found = find()
    except ConfigFileError as e:
        error = str(e)
    picked = None if found is None else found.strategy
    ignored = picked is not None and has_annotations(model)
    _agree_across_ranks(None if found is None else str(found.path),
                        None if picked is None or ignored else picked.to_dict(), error)
    if picked is None:
        return None, None
    if ignored:
        return None, (f"config file {found.path}: its strategy is ignored (the model's replicate/split annotations "
                      "give the strategy)")
    note = (f"strategy from {found.path}: {picked!r} (auto_accelerate(strategy=None) read the config file; "
            f"strategy=[] or {ENV_VAR}=none ignores it)")
    from ..utils import rank

    if rank() == 0:
        log.warning(note)
    return picked, note


def _agree_across_ranks(path: str | None, strategy: dict | None, error: str | None) -> None:
    """Raise the same ConfigFileError on every rank when one rank could not read its file or the ranks read
    different strategies (one small all-gather; nothing with one rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error:
            raise ConfigFileError(error)
        return
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (path, strategy, error))
    for r, (_p, _s, err) in enumerate(seen):
        if err:
            raise ConfigFileError(f"rank {r}: {err}")
    if any(s != seen[0][1] for _p, s, _e in seen):
        groups: dict[str, list[int]] = {}
        for r, (p, s, _e) in enumerate(seen):
            what = f"{Strategy.from_dict(s)!r} from {p}" if s is not None else (
                f"no strategy ({'no config file' if p is None else p})")
            groups.setdefault(what, []).append(r)
        listing = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranges(rs)}: {what}" for what, rs in groups.items())
        raise ConfigFileError(
            f"auto_accelerate(strategy=None): the ranks read different strategies from their config files "
            f"({listing}). Make the file the same on every node (or point {ENV_VAR} at a shared one), pass "
            f"strategy=... explicitly, or set {ENV_VAR}=none.")


def _ranges(ranks: list[int]) -> str:
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)

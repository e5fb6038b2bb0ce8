"""Choosing trackers by name and logging to all of them from the main process only."""
from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

from torchloom.tracking.base import Tracker, check_step, scalar_values
from torchloom.utils import did_you_mean

DEFAULT_LOGGING_DIR = "torchloom_logs"
BACKENDS = ("jsonl", "tensorboard", "mlflow", "wandb")


def tracker_class(name: str) -> type[Tracker]:
    """The built-in tracker class called ``name`` (imports only that back end's module)."""
    if name == "jsonl":
        from torchloom.tracking.jsonl import JSONLTracker
        return JSONLTracker
    if name == "tensorboard":
        from torchloom.tracking.tensorboard_tracker import TensorBoardTracker
        return TensorBoardTracker
    if name == "mlflow":
        from torchloom.tracking.mlflow_tracker import MLflowTracker
        return MLflowTracker
    if name == "wandb":
        from torchloom.tracking.wandb_tracker import WandBTracker
        return WandBTracker
    raise ValueError(f"unknown tracker {name!r}; choose from {list(BACKENDS)}, 'all', or pass a "
                     f"torchloom.tracking.Tracker instance.{did_you_mean(name, (*BACKENDS, 'all'))}")


def resolve_log_with(log_with: Any) -> list[str | Tracker]:
    """``log_with`` as a list of back-end names and :class:`Tracker` instances (``"all"``: the four built-ins).

    Raises:
        ValueError: an unknown name, a name given twice, or an empty list.
        TypeError: an entry that is neither a name nor a ``Tracker``.
    """
    items = [log_with] if isinstance(log_with, (str, Tracker)) else list(log_with)
    out: list[str | Tracker] = []
    for item in items:
        if isinstance(item, str):
            if item != "all" and item not in BACKENDS:
                tracker_class(item)  # raises, naming the choices
            out += list(BACKENDS) if item == "all" else [item]
        elif isinstance(item, Tracker):
            out.append(item)
        else:
            raise TypeError(f"log_with entries are back-end names {list(BACKENDS)} or Tracker instances, got "
                            f"{item!r} ({type(item).__name__}).")
    names = [x for x in out if isinstance(x, str)]
    if len(set(names)) != len(names):
        raise ValueError(f"log_with names a back end twice: {log_with!r}.")
    if not out:
        raise ValueError("log_with is empty; pass 'jsonl' (the default) or other back ends.")
    return out


class TrackerGroup:
    """The trackers of one run: :meth:`log` checks the values on every rank and writes them on the main process.

    Built by :func:`start_trackers`; on the other ranks ``trackers`` is empty and :meth:`log` only checks (no
    communication, so calling it on every rank or on rank 0 only are both fine).
    """

    def __init__(self, trackers: list[Tracker], run_dir: Path | None, main: bool):
        self.trackers, self.run_dir, self.main, self.closed = trackers, run_dir, main, False

    def log(self, values: Mapping[str, Any], step: Any) -> None:
        if self.closed:
            raise RuntimeError("log() after end_training(): the trackers are closed; call init_trackers(...) to "
                               "start another run.")
        step = check_step(step)
        vals = scalar_values(values, convert=self.main)
        for t in self.trackers:
            t.log(dict(vals), step)

    def get(self, name: str) -> Tracker | None:
        return next((t for t in self.trackers if t.name == name), None)

    def finish(self) -> None:
        """Finish every tracker (all of them, even if one raises; the first error is re-raised)."""
        if self.closed:
            return
        self.closed = True
        first = None
        for t in self.trackers:
            try:
                t.finish()
            except Exception as e:  # noqa: BLE001 - close the others first
                first = first or e
        if first is not None:
            raise first


def start_trackers(project_name: str, config: Mapping[str, Any] | None = None, log_with: Any = "jsonl",
                   logging_dir: str | os.PathLike | None = None,
                   init_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> TrackerGroup:
    """Build the trackers ``log_with`` names (on the main process only) and store ``config`` in each.

    Args:
        project_name: the run's name: its directory under ``logging_dir`` (``str``, no path separator).
        config: hyper-parameters to record (a dict; values JSON-able or stringified).
        log_with: ``"jsonl"``, ``"tensorboard"``, ``"mlflow"``, ``"wandb"``, ``"all"``, a :class:`Tracker`
            instance, or a list of these.
        logging_dir: root directory (default ``./torchloom_logs``).
        init_kwargs: per back end, keyword arguments of its tracker class, e.g. ``{"wandb": {"name": "x"},
            "mlflow": {"tracking_uri": ...}}``.

    Raises:
        ValueError / TypeError: see :func:`resolve_log_with`; an empty ``project_name`` or one with a path
            separator; ``init_kwargs`` for a back end ``log_with`` does not choose.
        ImportError: a chosen back end's package is missing (names ``pip install torchloom[hf]``).
    """
    from torchloom.main_process import is_main_process

    if not isinstance(project_name, str) or not project_name or os.sep in project_name or project_name in (".", ".."):
        raise ValueError(f"project_name must be a non-empty directory name, got {project_name!r}.")
    chosen = resolve_log_with(log_with)
    init_kwargs = dict(init_kwargs or {})
    unused = sorted(set(init_kwargs) - {c for c in chosen if isinstance(c, str)})
    if unused:
        raise ValueError(f"init_kwargs for {unused}, which log_with={log_with!r} does not choose.")
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict, got {type(config).__name__}.")
    main = is_main_process()
    root = Path(logging_dir if logging_dir is not None else DEFAULT_LOGGING_DIR)
    if not main:
        return TrackerGroup([], None, main=False)
    trackers = [tracker_class(c)(project_name, root, **init_kwargs.get(c, {})) if isinstance(c, str) else c
                for c in chosen]
    if config is not None:
        for t in trackers:
            t.store_init_configuration(config)
    return TrackerGroup(trackers, root / project_name, main=True)


def start_default_trackers() -> TrackerGroup:
    """The JSONL tracker ``res.log`` starts when ``init_trackers`` was not called:
    ``./torchloom_logs/run-<UTC time>/metrics.jsonl``; warns once (main process) saying where."""
    name = time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())
    group = start_trackers(name)
    if group.main:
        warnings.warn(f"log() before init_trackers(): logging to JSONL at {(group.run_dir / 'metrics.jsonl').resolve()}"
                      "; call res.init_trackers(project_name, log_with=..., logging_dir=...) first to choose the "
                      "back ends and the place.", stacklevel=3)
    return group

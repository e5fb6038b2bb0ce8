"""Choosing trackers by name and logging to all of them from the main process only."""
from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

from torchloom.tracking.base import Tracker, check_importable, check_step, scalar_values
from torchloom.utils import did_you_mean, distributed

DEFAULT_LOGGING_DIR = "torchloom_logs"
BACKENDS = ("jsonl", "tensorboard", "mlflow", "wandb")
# back end -> (module its tracker imports, pip package): checked on every rank before rank 0 builds the trackers
PACKAGES: dict[str, tuple[str, str]] = {"tensorboard": ("tensorboard", "tensorboard"),
                                        "mlflow": ("mlflow", "mlflow-skinny"), "wandb": ("wandb", "wandb")}


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

    def finish_quietly(self) -> None:
        """Finish every tracker, ignoring their errors (cleanup after a failed start)."""
        try:
            self.finish()
        except Exception:  # noqa: BLE001 - the start's own error is the one to report
            pass


def start_trackers(project_name: str, config: Mapping[str, Any] | None = None, log_with: Any = "jsonl",
                   logging_dir: str | os.PathLike | None = None,
                   init_kwargs: Mapping[str, Mapping[str, Any]] | None = None, *, collective: bool = True) -> TrackerGroup:
    """Build the trackers ``log_with`` names (on the main process only) and store ``config`` in each.

    Collective when a process group is initialised (``collective=True``, the default; call it on every rank): every
    rank checks that the chosen back ends' packages can be found, the main process builds the trackers, and one
    small all-gather shares the outcome, so an error on any rank raises on every rank instead of leaving the
    others waiting in their next collective (a tracker built before the failure is finished again).

    Args:
        project_name: the run's name: its directory under ``logging_dir`` (``str``, no path separator).
        config: hyper-parameters to record (a dict; values JSON-able or stringified).
        log_with: ``"jsonl"``, ``"tensorboard"``, ``"mlflow"``, ``"wandb"``, ``"all"``, a :class:`Tracker`
            instance, or a list of these.
        logging_dir: root directory (default ``./torchloom_logs``).
        init_kwargs: per back end, keyword arguments of its tracker class, e.g. ``{"wandb": {"name": "x"},
            "mlflow": {"tracking_uri": ...}}``.
        collective: False: no communication (the main process alone may call it; errors stay on the rank).

    Raises:
        ValueError / TypeError: see :func:`resolve_log_with`; an empty ``project_name`` or one with a path
            separator; ``init_kwargs`` for a back end ``log_with`` does not choose (every rank alike).
        ImportError: a chosen back end's package is missing (names ``pip install torchloom[hf]``).
        Any error of a tracker's constructor or ``store_init_configuration`` (e.g. a ``TypeError`` for a bad
            ``init_kwargs`` key): raised as such on the rank where it happened; the other ranks raise a
            ``RuntimeError`` naming that rank and its error.
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
    built: list[Tracker] = []

    def build() -> None:
        for c in chosen:
            if isinstance(c, str) and c in PACKAGES:
                check_importable(PACKAGES[c][0], c, PACKAGES[c][1])
        if not main:
            return
        for c in chosen:
            built.append(tracker_class(c)(project_name, root, **init_kwargs.get(c, {})) if isinstance(c, str) else c)
        if config is not None:
            for t in built:
                t.store_init_configuration(config)

    try:
        _on_every_rank(build) if collective else build()
    except BaseException:
        TrackerGroup([t for t in built if not any(t is c for c in chosen)], None, main).finish_quietly()  # ours only
        raise
    return TrackerGroup(built, root / project_name, main=True) if main else TrackerGroup([], None, main=False)


def _on_every_rank(fn: Any) -> Any:
    """``fn()`` on every rank, then agree (``checkpoint.commit.run_everywhere``: one all-gather of the errors): this
    rank's own error is re-raised as it is; a rank that did not fail raises a RuntimeError naming the failed ones."""
    if not distributed():
        return fn()
    from torchloom.checkpoint.commit import CheckpointError, run_everywhere

    try:
        return run_everywhere(fn, "init_trackers")
    except CheckpointError as e:
        if e.__cause__ is not None:
            raise e.__cause__ from None  # this rank's own error, with its type and traceback
        raise RuntimeError(f"{e} (trackers are built on the main process; every rank stops)") from None


def start_default_trackers() -> TrackerGroup:
    """The JSONL tracker ``res.log`` starts when ``init_trackers`` was not called:
    ``./torchloom_logs/run-<UTC time>/metrics.jsonl``; warns once (main process) saying where."""
    name = time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())
    group = start_trackers(name, collective=False)  # res.log may run on rank 0 alone: no communication
    if group.main:
        warnings.warn(f"log() before init_trackers(): logging to JSONL at {(group.run_dir / 'metrics.jsonl').resolve()}"
                      "; call res.init_trackers(project_name, log_with=..., logging_dir=...) first to choose the "
                      "back ends and the place.", stacklevel=3)
    return group

"""Experiment tracking for ``res.log(values, step)``: JSONL (default), TensorBoard, MLflow and W&B back ends, and
a :class:`Tracker` base class for your own. Only the global main process (rank 0) writes; back-end packages are
imported only when chosen. See docs/hf.md, "Trackers and main-process helpers"."""
from torchloom.tracking.base import Tracker, check_step, scalar_values
from torchloom.tracking.group import (BACKENDS, DEFAULT_LOGGING_DIR, TrackerGroup, resolve_log_with,
                                      start_trackers, tracker_class)
from torchloom.tracking.jsonl import JSONLTracker, MetricsWriter, read_metrics


def __getattr__(name: str):
    """The optional back ends' classes, imported on first use (their packages are slow to import)."""
    lazy = {"TensorBoardTracker": "tensorboard", "MLflowTracker": "mlflow", "WandBTracker": "wandb"}
    if name in lazy:
        return tracker_class(lazy[name])
    raise AttributeError(f"module 'torchloom.tracking' has no attribute {name!r}")


__all__ = ["BACKENDS", "DEFAULT_LOGGING_DIR", "JSONLTracker", "MLflowTracker", "MetricsWriter", "TensorBoardTracker",
           "Tracker", "TrackerGroup", "WandBTracker", "check_step", "read_metrics", "resolve_log_with",
           "scalar_values", "start_trackers", "tracker_class"]

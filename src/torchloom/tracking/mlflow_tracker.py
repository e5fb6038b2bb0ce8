"""MLflow tracking into a local store (package ``mlflow-skinny`` or ``mlflow``); no server, no network.

MLflow 3.x keeps the file store (``file://<dir>``) in maintenance mode: opening one raises unless
``MLFLOW_ALLOW_FILE_STORE=true``. Its replacement, ``sqlite:///...``, needs SQLAlchemy and Alembic, which
``mlflow-skinny`` does not install. So the default store is ``file://<logging_dir>/<project_name>/mlruns`` and
this tracker sets ``MLFLOW_ALLOW_FILE_STORE=true`` unless it is already set (and
``MLFLOW_DISABLE_TELEMETRY=true`` unless set: MLflow 3 otherwise sends usage telemetry). Pass
``init_kwargs={"mlflow": {"tracking_uri": "sqlite:///mlflow.db"}}`` (full ``mlflow``) or a server's
``http://...`` to use another store. Reading the file store back, e.g. ``mlflow ui --backend-store-uri
file://...``, needs ``MLFLOW_ALLOW_FILE_STORE=true`` in that shell too.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping

from torchloom.tracking.base import Tracker, require


class MLflowTracker(Tracker):
    """One MLflow run in the experiment ``project_name``: :meth:`log` is one ``log_batch`` of metrics at
    ``step``; the ``config`` becomes run parameters (``str`` values; nested dicts flattened to ``a.b`` keys);
    :meth:`finish` marks the run ``FINISHED``. Uses ``MlflowClient`` (no global active run is started).

    Args:
        project_name: the experiment name (created if missing); the store goes under
            ``<logging_dir>/<project_name>/mlruns`` by default.
        logging_dir: root directory.
        tracking_uri: another store (see the module docstring).
        run_name, tags: of the new run.

    Attributes:
        tracking_uri, experiment_id, run_id: where the run is (``MlflowClient(tracking_uri).get_metric_history(
            run_id, key)`` reads a metric back).

    Raises:
        ImportError: MLflow is not installed (names ``pip install torchloom[hf]``).
    """

    name = "mlflow"

    def __init__(self, project_name: str, logging_dir: str | os.PathLike, tracking_uri: str | None = None,
                 run_name: str | None = None, tags: Mapping[str, str] | None = None):
        if tracking_uri is None:
            tracking_uri = (Path(logging_dir) / project_name / "mlruns").resolve().as_uri()
        if tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        require("mlflow", "mlflow", "mlflow-skinny")
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri)
        exp = self.client.get_experiment_by_name(project_name)
        self.experiment_id = exp.experiment_id if exp is not None else self.client.create_experiment(project_name)
        self.run_id = self.client.create_run(self.experiment_id, run_name=run_name, tags=dict(tags or {})).info.run_id

    def store_init_configuration(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)) for k, v in _flatten(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, values: dict[str, int | float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's per-batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out

"""Weights & Biases tracking, offline by default (package ``wandb``): nothing is sent over the network; the run
is written under ``<logging_dir>/<project_name>/wandb/offline-run-*`` and can be uploaded later with
``wandb sync <that directory>`` (or read locally with ``wandb leet inspect --json <that directory>``)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from torchloom.tracking.base import Tracker, require


class WandBTracker(Tracker):
    """One W&B run: ``wandb.init(project=project_name, dir=<logging_dir>/<project_name>, mode="offline",
    **init_kwargs)``; :meth:`log` is ``run.log(values, step=step)``; the ``config`` goes to ``run.config``;
    :meth:`finish` is ``run.finish()``.

    W&B drops (with only a warning) values logged at a step lower than one already logged; this tracker raises
    instead, so no value silently disappears.

    Args:
        project_name, logging_dir: as for :class:`~torchloom.tracking.jsonl.JSONLTracker`.
        **init_kwargs: passed to ``wandb.init`` (e.g. ``name``, ``tags``); ``mode="online"`` here is the only way
            this tracker uses the network.

    Raises:
        ImportError: ``wandb`` is not installed (names ``pip install torchloom[hf]``).
        ValueError (in :meth:`log`): a step lower than the last one logged.
    """

    name = "wandb"

    def __init__(self, project_name: str, logging_dir: str | os.PathLike, **init_kwargs: Any):
        wandb = require("wandb", "wandb")
        run_dir = Path(logging_dir) / project_name
        run_dir.mkdir(parents=True, exist_ok=True)
        kwargs = {"project": project_name, "dir": str(run_dir), "mode": "offline", **init_kwargs}
        self.run = wandb.init(**kwargs)
        self.last_step = -1

    def store_init_configuration(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log(self, values: dict[str, int | float], step: int) -> None:
        if step < self.last_step:
            raise ValueError(f"W&B cannot log step {step} after step {self.last_step} (it would drop the values); "
                             "log steps in non-decreasing order.")
        self.run.log(dict(values), step=step)
        self.last_step = step

    def finish(self) -> None:
        self.run.finish()

"""TensorBoard tracking through ``torch.utils.tensorboard.SummaryWriter`` (package ``tensorboard``)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from torchloom.tracking.base import Tracker, require


class TensorBoardTracker(Tracker):
    """Scalars as TensorBoard events under ``<logging_dir>/<project_name>/tensorboard`` (``tensorboard --logdir``
    that directory). Each :meth:`log` is one ``add_scalar`` per key at ``global_step=step``, then a flush, so the
    events are on disk when ``log`` returns. The ``config`` becomes a text summary named ``config`` (JSON).

    Args:
        project_name, logging_dir: as for :class:`~torchloom.tracking.jsonl.JSONLTracker`.
        **writer_kwargs: passed to ``SummaryWriter`` (e.g. ``flush_secs``).

    Raises:
        ImportError: ``tensorboard`` is not installed (names ``pip install torchloom[hf]``).
    """

    name = "tensorboard"

    def __init__(self, project_name: str, logging_dir: str | os.PathLike, **writer_kwargs: Any):
        require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(logging_dir) / project_name / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir), **writer_kwargs)

    def store_init_configuration(self, config: Mapping[str, Any]) -> None:
        self.writer.add_text("config", json.dumps(dict(config), indent=2, default=str))
        self.writer.flush()

    def log(self, values: dict[str, int | float], step: int) -> None:
        for key, v in values.items():
            self.writer.add_scalar(key, v, global_step=step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()

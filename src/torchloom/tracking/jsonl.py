"""JSON-lines tracking (the default back end): one ``{"step": step, **values}`` object per line.

:class:`MetricsWriter` is also ``loom train``'s ``metrics.jsonl`` writer (re-exported by
:mod:`torchloom.train.metrics`); :func:`read_metrics` reads either file back.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

from torchloom.tracking.base import Tracker


class MetricsWriter:
    """Appends JSON records to ``path`` (rank 0 only; other ranks pass ``enabled=False``)."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._f = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            drop_torn_tail(self.path)  # else the next record is glued onto a killed run's half line
            self._f = open(self.path, "a", encoding="utf-8")

    def truncate_after(self, step: int) -> int:
        """Drop records with ``step > step`` (work redone after a resume); returns how many were dropped."""
        if not self.enabled or not self.path.exists():
            return 0
        self._f.close()
        keep, dropped = [], 0
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                dropped += 1  # a torn last line from a killed run
                continue
            if rec.get("step", 0) > step:
                dropped += 1
            else:
                keep.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
        os.replace(tmp, self.path)
        self._f = open(self.path, "a", encoding="utf-8")
        return dropped

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None:
            return
        self._f.write(json.dumps(record, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def drop_torn_tail(path: Path) -> bytes:
    """Cut ``path`` after its last newline: a last line without one is a record a killed run did not finish (each
    record is written with its newline in one flushed write). Warns and returns the dropped bytes (``b""``: none)."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return b""
    with f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:  # scan back for the last newline, 64 KiB at a time
            lo = max(0, pos - 65536)
            f.seek(lo)
            nl = f.read(pos - lo).rfind(b"\n")
            if nl >= 0:
                pos = lo + nl + 1
                break
            pos = lo
        if pos == end:
            return b""
        f.seek(pos)
        torn = f.read()
        f.truncate(pos)
    warnings.warn(f"{path}: dropped a torn last line (a run killed mid-write): {torn[:80]!r}", stacklevel=3)
    return torn


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` file (one JSON object per line), in file order.

    A last line without its newline that is not valid JSON is a record a killed run did not finish: skipped with a
    warning (the writer drops it when it next opens the file).

    Raises:
        ValueError: any other line that is not valid JSON (naming the file and line number).
    """
    text = Path(path).read_text(encoding="utf-8")
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as e:
            if i == len(lines) and not text.endswith("\n"):
                warnings.warn(f"{path}: skipped a torn last line {i} (a run killed mid-write): {line[:80]!r}",
                              stacklevel=2)
                continue
            raise ValueError(f"{path}, line {i}: not a JSON record ({e}): {line[:80]!r}") from None
    return out


class JSONLTracker(Tracker):
    """Appends ``{"step": step, **values}`` to ``<logging_dir>/<project_name>/metrics.jsonl`` (one flushed line
    per :meth:`log`; an existing file is appended to, so a resumed run continues it) and writes the
    ``config`` to ``config.json`` next to it.

    Args:
        project_name: the run's directory name under ``logging_dir``.
        logging_dir: the root directory (created if missing).
        filename: the records' file name (default ``metrics.jsonl``).

    Raises (in :meth:`log`):
        ValueError: a value named ``"step"`` (the record's own step field).
    """

    name = "jsonl"

    def __init__(self, project_name: str, logging_dir: str | os.PathLike, filename: str = "metrics.jsonl"):
        self.run_dir = Path(logging_dir) / project_name
        self.path = self.run_dir / filename
        self.writer = MetricsWriter(self.path)

    def store_init_configuration(self, config: Mapping[str, Any]) -> None:
        tmp = self.run_dir / "config.json.tmp"
        tmp.write_text(json.dumps(dict(config), indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, self.run_dir / "config.json")

    def log(self, values: dict[str, int | float], step: int) -> None:
        if "step" in values:
            raise ValueError("log() got a value named 'step', which is the JSONL record's step field; rename it "
                             "(e.g. 'train/step').")
        self.writer.write({"step": step, **values})

    def finish(self) -> None:
        self.writer.close()

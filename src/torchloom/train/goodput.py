"""Goodput of a `loom train` job: productive step time vs time lost to start-up, failures and checkpoints.

Rank 0 of every process attempt appends events to ``<output_dir>/goodput.jsonl`` (one JSON object per
line, flushed, so they survive a SIGKILL of the process):

* ``start``: the attempt (``TORCHELASTIC_RESTART_COUNT``), the process start time, the step it resumed
  from, the productive time restored from the checkpoint, and the work the previous attempt lost (steps
  it completed after its last checkpoint, their step time, and the wall time of its last logged step);
* ``first_step``: when the attempt completed its first optimizer step;
* ``save``: how long a checkpoint save stalled training.

:func:`summarize` turns the events of one launcher invocation (from its attempt 0 on) into the
``goodput`` block of ``summary.json``. All times are seconds (wall clock, ``time.time()``).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def process_start_time() -> float:
    """This process's start time in Unix seconds (from ``/proc``; the import time of this module elsewhere)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: seconds after boot
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])  # 10 ms resolution (btime in /proc/stat has 1 s)
        return time.time() - (uptime - started)
    except (OSError, ValueError, IndexError):
        return _IMPORT_TIME


_IMPORT_TIME = time.time()


def lost_work(metrics_path: str | os.PathLike, resumed_step: int, log_interval: int = 1) -> dict[str, Any]:
    """The work a previous attempt did after ``resumed_step`` (read from its ``metrics.jsonl`` before the
    records are dropped): ``steps`` (the highest logged step minus ``resumed_step``), ``time_s`` (their
    summed ``step_time_s``, times ``log_interval`` when only every N-th step was logged) and ``last_t``
    (the wall time of the last logged step, None when unknown)."""
    path = Path(metrics_path)
    steps, time_s, last_t = 0, 0.0, None
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("type") != "train":
                continue
            if rec.get("t") is not None:
                last_t = max(last_t or 0.0, float(rec["t"]))
            if rec.get("step", 0) > resumed_step:
                steps = max(steps, int(rec["step"]) - resumed_step)
                time_s += float(rec.get("step_time_s") or 0.0) * log_interval
    return {"steps": steps, "time_s": time_s, "last_t": last_t}


class GoodputLog:
    """Appends goodput events to ``path`` (rank 0 only; other ranks pass ``enabled=False``)."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled

    def event(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": kind, "t": time.time(), **fields}) + "\n")
            f.flush()

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a torn last line from a killed attempt
        return out


def summarize(events: list[dict[str, Any]], t_end: float, train_time_end: float) -> dict[str, Any]:
    """The goodput of the launcher invocation that the last ``attempt == 0`` start event begins.

    Returns (seconds unless noted): ``wall_time_s`` (first process start to ``t_end``), ``productive_s``
    (optimizer-step time of the steps that count, ``train_time_end`` minus what the first attempt restored),
    ``effective_training_time`` (productive / wall, a fraction), ``restarts``, ``lost_s`` broken down into
    ``startup_s`` (process start to first step, every attempt), ``restart_gap_s`` (last logged step of a
    failed attempt to the next process start: failure detection, the rest of the failed step,
    re-rendezvous), ``recompute_s`` (steps done after the last checkpoint of a failed attempt),
    ``checkpoint_stall_s`` and ``other_s`` (evaluation, logging, export, ...), and ``recovery_s``: per
    restart, the time from the failed attempt's last logged step to the first step after the restart.
    """
    first = max((i for i, e in enumerate(events) if e.get("event") == "start" and e.get("attempt") == 0),
                default=0)
    events = events[first:]
    starts = [e for e in events if e.get("event") == "start"]
    if not starts:
        return {}
    firsts = {e["attempt"]: e["t"] for e in events if e.get("event") == "first_step"}
    t0 = starts[0]["t_process"]
    wall = max(t_end - t0, 1e-9)
    productive = max(train_time_end - float(starts[0].get("train_time_s") or 0.0), 0.0)
    startup = sum(firsts[s["attempt"]] - s["t_process"] for s in starts if s["attempt"] in firsts)
    restarted = [s for s in starts if s["attempt"] > 0]
    gap = sum(s["t_process"] - s["last_t"] for s in restarted if s.get("last_t") is not None)
    recompute = sum(float(s.get("lost_time_s") or 0.0) for s in restarted)
    stall = sum(float(e.get("stall_s") or 0.0) for e in events if e.get("event") == "save")
    recovery = [round(firsts[s["attempt"]] - s["last_t"], 3) for s in restarted
                if s.get("last_t") is not None and s["attempt"] in firsts]
    lost = {"startup_s": startup, "restart_gap_s": gap, "recompute_s": recompute, "checkpoint_stall_s": stall}
    lost["other_s"] = max(wall - productive - sum(lost.values()), 0.0)
    return {
        "wall_time_s": wall, "productive_s": productive, "effective_training_time": productive / wall,
        "restarts": len(restarted), "recomputed_steps": sum(int(s.get("lost_steps") or 0) for s in restarted),
        "lost_s": lost, "recovery_s": recovery,
    }

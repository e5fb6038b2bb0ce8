"""How busy this machine was while torchloom measured it: the CPU time other processes took.

A speed measurement (calibration, the training job's peak FLOP/s) taken while other jobs run reads low, and a
low figure kept silently poisons every later prediction and pushes MFU above 1. So every measuring rank
opens a :class:`LoadWindow` before it measures and closes it after; :func:`assess` combines the ranks' rows:

- ``other_busy_cores`` = (CPU seconds the usable cores were busy during the window, from ``/proc/stat``:
  user + nice + system + irq + softirq + steal, minus the CPU seconds of the measuring processes themselves,
  ``time.process_time``) / wall seconds: how many cores other processes kept busy, on average;
- ``cores_used`` = min(usable cores, ranks x threads per rank): the cores the measurement itself occupies;
- ``stolen_fraction`` = max(0, other_busy_cores - (cores - cores_used)) / cores_used: the share of the
  measurement's own cores that other processes took (work on cores the measurement leaves free disturbs
  nothing);
- ``under_load`` = ``stolen_fraction > LOAD_THRESHOLD`` (0.2: the measured rates may read 20 % or more low).

Without ``/proc/stat`` (not Linux) the 1-minute load average after the window stands in for the busy cores
(``method: "loadavg"``; it lags by up to a minute, so it is approximate). With several hosts the worst one
is reported. The sources (``_clock``, ``_cpu_seconds``, ``_own_cpu_seconds``, ``_loadavg``) are module
attributes so tests can inject a load. See ``docs/calibration.md``.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any

LOAD_THRESHOLD = 0.2  # share of the measurement's own cores taken by other processes beyond which it is "under load"


def _usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _read_cpu_seconds() -> tuple[float, float] | None:
    """``(busy, total)`` CPU seconds since boot summed over this process's usable CPUs (``/proc/stat``);
    None where unreadable."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    want = {f"cpu{i}" for i in _usable_cpus()}
    busy = total = 0
    seen = False
    for line in lines:
        parts = line.split()
        if not parts or parts[0] not in want:
            continue
        v = [int(x) for x in parts[1:9]] + [0] * max(0, 9 - len(parts))
        user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
        b = user + nice + system + irq + softirq + steal
        busy, total, seen = busy + b, total + b + idle + iowait, True
    return (busy / tick, total / tick) if seen else None


def _read_loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


# injectable sources (tests replace these module attributes)
_clock = time.perf_counter
_cpu_seconds = _read_cpu_seconds
_own_cpu_seconds = time.process_time  # every thread of this process, gloo's included
_loadavg = _read_loadavg


class LoadWindow:
    """Opened by every measuring rank just before it measures; :meth:`finish` returns this rank's row for
    :func:`assess` (a small dict: host, wall seconds, busy CPU seconds of the host's usable cores, this
    process's CPU seconds, load average before and after, usable cores)."""

    def __init__(self) -> None:
        self.host = socket.gethostname()
        self.load_before = _loadavg()
        self.cpu0 = _cpu_seconds()
        self.own0 = _own_cpu_seconds()
        self.t0 = _clock()

    def finish(self) -> dict[str, Any]:
        wall = max(_clock() - self.t0, 1e-9)
        own = _own_cpu_seconds() - self.own0
        cpu1 = _cpu_seconds()
        busy = cpu1[0] - self.cpu0[0] if cpu1 is not None and self.cpu0 is not None else None
        return {"host": self.host, "wall_s": wall, "busy_s": busy, "own_cpu_s": own,
                "loadavg_before": self.load_before, "loadavg_after": _loadavg(), "cores": len(_usable_cpus())}


def assess(rows: list[dict[str, Any]], threads_per_rank: int, threshold: float = LOAD_THRESHOLD, *,
           ranks_per_host: int | None = None) -> dict[str, Any]:
    """The load a measurement ran under, from every measuring rank's :meth:`LoadWindow.finish` row.

    ``ranks_per_host``: the ranks the measurement stands for on each host when that is not one row per rank
    (the re-check probe: one process running a job's ``ranks_per_node`` ranks as threads); default the rows
    of that host.

    Returns (the worst host's): ``method`` (``"/proc/stat"`` or ``"loadavg"``), ``cores`` (usable), ``ranks``
    (on that host), ``threads_per_rank``, ``cores_used``, ``other_busy_cores``, ``stolen_fraction``,
    ``threshold``, ``under_load`` (bool), ``loadavg_1m`` (before the measurement) and ``wall_s``.

    Raises:
        ValueError: no rows.
    """
    hosts: dict[str, list[dict]] = {}
    for r in rows:
        hosts.setdefault(r["host"], []).append(r)
    worst: dict[str, Any] | None = None
    for mine in hosts.values():
        first = mine[0]  # one /proc/stat reading per host: the host's ranks open and close their windows together
        cores, ranks = max(1, int(first["cores"])), int(ranks_per_host or len(mine))
        used = min(cores, ranks * max(1, int(threads_per_rank)))
        if first["busy_s"] is not None:
            method = "/proc/stat"
            other = max(0.0, first["busy_s"] - sum(r["own_cpu_s"] for r in mine)) / first["wall_s"]
        else:
            method = "loadavg"
            other = max(0.0, (first["loadavg_after"] or 0.0) - used)
        stolen = max(0.0, other - (cores - used)) / used
        rec = {"method": method, "cores": cores, "ranks": ranks, "threads_per_rank": int(threads_per_rank),
               "cores_used": used, "other_busy_cores": round(other, 3), "stolen_fraction": round(stolen, 3),
               "threshold": threshold, "under_load": stolen > threshold, "loadavg_1m": first["loadavg_before"],
               "wall_s": round(first["wall_s"], 3)}
        if worst is None or rec["stolen_fraction"] > worst["stolen_fraction"]:
            worst = rec
    if worst is None:
        raise ValueError("assess: no rows (every measuring rank must give its LoadWindow row).")
    return worst


def compact(load: dict[str, Any]) -> dict[str, Any]:
    """The few figures of an :func:`assess` record worth keeping next to a measured value (metrics records,
    ``summary.json``): ``stolen_fraction``, ``other_busy_cores``, ``cores_used``, ``loadavg_1m``,
    ``under_load`` and ``method``; ``{}`` for no record."""
    keys = ("stolen_fraction", "other_busy_cores", "cores_used", "loadavg_1m", "under_load", "method")
    return {k: load.get(k) for k in keys} if load else {}


def describe(load: dict[str, Any]) -> str:
    """One line for logs and ``loom calibrate``: who used the cores and whether it counts as under load."""
    if not load:
        return "machine load not recorded"
    avg = load.get("loadavg_1m")
    verdict = ("UNDER LOAD" if load.get("under_load") else "quiet") + f" (threshold {load.get('threshold', 0):.0%})"
    return (f"other processes kept {load.get('other_busy_cores', 0):.2f} of {load.get('cores')} cores busy "
            f"({load.get('method')}), taking {load.get('stolen_fraction', 0):.0%} of the "
            f"{load.get('cores_used')} core(s) measured on; load average {'-' if avg is None else f'{avg:.2f}'} "
            f"before: {verdict}")

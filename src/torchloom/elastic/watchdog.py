"""Hang watchdog: a per-rank heartbeat that turns a silent hang into a restart.

The training loop calls :meth:`Watchdog.beat` after every completed optimizer step. A daemon thread
checks the time since the last beat; when it exceeds ``timeout_s`` (``first_step_timeout_s`` before the
first beat: set-up, corpus loading and the first step are slower), it writes a dump of

* every thread's Python stack (``sys._current_frames``; the stuck frame is the innermost line of the
  main thread), and
* the last collectives this process issued, from PyTorch's flight recorder (``TORCH_FR_BUFFER_SIZE``;
  on this torch build it records gloo collectives too, including DDP's bucket all-reduces issued from
  C++): op name, process group and sequence number,

to stderr and to ``<dump_dir>/watchdog_rank<R>.txt``, then leaves the process with ``os._exit(124)``
(:data:`EXIT_CODE`). A non-zero worker exit makes torchrun's elastic agent stop the group and restart it
(within ``--max-restarts``), and every rank resumes from the newest complete checkpoint.

See ``docs/health.md``.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

EXIT_CODE = 124
"""Exit code of a process the watchdog ended (the shell's code for a timeout)."""

FR_ENV = "TORCH_FR_BUFFER_SIZE"
"""PyTorch's flight-recorder ring size (entries); must be set before the process group is created."""


def enable_flight_recorder(entries: int = 2000) -> bool:
    """Ask PyTorch to record the last ``entries`` collectives of this process (sets ``TORCH_FR_BUFFER_SIZE``
    unless already set). Call it before ``init_process_group``; returns True when it is (now) enabled."""
    if FR_ENV not in os.environ:
        os.environ[FR_ENV] = str(int(entries))
    return int(os.environ.get(FR_ENV, "0") or 0) > 0


def last_collectives(n: int = 5) -> list[dict[str, Any]]:
    """The last ``n`` collectives this process issued, oldest first, from the flight recorder: dicts with
    ``op`` (e.g. ``gloo:all_reduce``), ``group`` (name and description), ``seq`` (collective sequence
    number in that group), ``state`` and ``time_created_ns``. Empty when the recorder is off or has nothing.
    Never raises."""
    try:
        import torch._C._distributed_c10d as c10d

        data = json.loads(c10d._dump_fr_trace_json(includeCollectives=True))
    except Exception:  # noqa: BLE001 - a diagnostic must not fail the dump
        return []
    out = []
    for e in (data.get("entries") or [])[-n:]:
        out.append({"op": e.get("profiling_name"), "group": e.get("process_group"),
                    "seq": e.get("collective_seq_id"), "state": e.get("state"),
                    "time_created_ns": e.get("time_created_ns")})
    return out


def format_stacks() -> str:
    """Every live thread's Python stack, the main thread first (names and ids included)."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    order = sorted(frames, key=lambda tid: (tid != main_id, names.get(tid, "")))
    parts = []
    for tid in order:
        if tid == threading.get_ident():
            continue  # the watchdog thread itself
        parts.append(f"Thread {names.get(tid, '?')} (id {tid}), most recent call last:\n")
        parts.append("".join(traceback.format_stack(frames[tid])))
    return "".join(parts)


class Watchdog:
    """A heartbeat monitor for one rank.

    Args:
        timeout_s: seconds allowed between two beats (after the first).
        first_step_timeout_s: seconds allowed from :meth:`start` to the first beat (None = ``timeout_s``).
        dump_dir: directory for ``watchdog_rank<R>.txt`` (None = stderr only).
        rank: this process's rank (None = ``$RANK`` or 0), used in the dump's name and header.
        exit_code: the code the process leaves with on a hang (default :data:`EXIT_CODE`, 124).
        on_hang: called with the dump text instead of exiting (tests; None = ``os._exit(exit_code)``).
        poll_s: how often the thread checks, in seconds (None = min(1, timeout / 10)).

    Raises:
        ValueError: a timeout that is not positive.
    """

    def __init__(self, timeout_s: float, first_step_timeout_s: float | None = None, *,
                 dump_dir: str | Path | None = None, rank: int | None = None, exit_code: int = EXIT_CODE,
                 on_hang: Callable[[str], None] | None = None, poll_s: float | None = None):
        first = timeout_s if first_step_timeout_s is None else first_step_timeout_s
        if not timeout_s > 0 or not first > 0:
            raise ValueError(f"watchdog timeouts must be > 0 seconds, got timeout_s={timeout_s}, "
                             f"first_step_timeout_s={first_step_timeout_s}; set watchdog.timeout_s: 0 to turn "
                             "the watchdog off instead.")
        self.timeout_s, self.first_step_timeout_s = float(timeout_s), float(first)
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
        self.exit_code, self.on_hang = int(exit_code), on_hang
        self.poll_s = min(1.0, min(self.timeout_s, first) / 10) if poll_s is None else float(poll_s)
        self.beats = 0
        self.last_step: int | None = None
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False

    # -- control -------------------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        """Start the clock (the first-step timeout runs from now) and the monitor thread."""
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="loom-watchdog", daemon=True)
        self._thread.start()
        return self

    def beat(self, step: int | None = None) -> None:
        """Record that a step completed (``step`` is shown in the dump). Cheap: call it every step."""
        self.last_step = step
        self.beats += 1
        self._last = time.monotonic()

    def pause(self) -> None:
        """Restart the clock now (before a long phase that is not a step, e.g. a final evaluation)."""
        self._last = time.monotonic()

    def stop(self) -> None:
        """Stop monitoring (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the monitor ---------------------------------------------------------------------------------
    def _limit(self) -> float:
        return self.timeout_s if self.beats else self.first_step_timeout_s

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last
            if idle > self._limit():
                self._fire(idle)
                return

    def dump(self, idle_s: float) -> str:
        """The hang report: header, last collectives, every thread's stack."""
        what = (f"no step completed for {idle_s:.3g} s (timeout {self._limit():g} s; last completed step "
                f"{self.last_step})" if self.beats else
                f"the first step did not complete within {idle_s:.3g} s (first_step_timeout {self._limit():g} s)")
        lines = [f"[loom watchdog] rank {self.rank} (pid {os.getpid()}): hang detected: {what}."]
        colls = last_collectives()
        if colls:
            lines.append("[loom watchdog] last collectives (oldest first; gloo marks entries 'scheduled'):")
            for c in colls:
                lines.append(f"  op={c['op']} group={c['group']} seq={c['seq']} state={c['state']}")
            last = colls[-1]
            lines.append(f"[loom watchdog] last collective: {last['op']} group={last['group']} seq={last['seq']}")
        else:
            lines.append(f"[loom watchdog] last collective: unknown (flight recorder off: set {FR_ENV} before "
                         "the process group is created, e.g. with watchdog.enable_flight_recorder())")
        lines.append("[loom watchdog] thread stacks:")
        lines.append(format_stacks())
        lines.append(f"[loom watchdog] exiting with code {self.exit_code} so the elastic agent restarts the group.")
        return "\n".join(lines)

    def _fire(self, idle_s: float) -> None:
        self.fired = True
        text = self.dump(idle_s)
        path = None
        if self.dump_dir is not None:
            try:
                self.dump_dir.mkdir(parents=True, exist_ok=True)
                path = self.dump_dir / f"watchdog_rank{self.rank}.txt"
                path.write_text(text + "\n")
            except OSError as e:
                text += f"\n[loom watchdog] could not write the dump to {self.dump_dir}: {e}"
        try:
            sys.stderr.write(text + (f"\n[loom watchdog] dump written to {path}\n" if path else "\n"))
            sys.stderr.flush()
            sys.stdout.flush()
        except Exception:  # noqa: BLE001
            pass
        if self.on_hang is not None:
            self.on_hang(text)
            return
        os._exit(self.exit_code)

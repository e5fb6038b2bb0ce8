"""Fault injection for tests and benchmarks: SIGKILL a rank at a chosen step of a chosen restart attempt.

The plan comes from the environment variable ``LOOM_FAULT_PLAN``, a ``;``-separated list of faults::

    LOOM_FAULT_PLAN="kill:rank=1,step=3,attempt=0;kill:rank=0,step=7,attempt=1"

A fault ``kill:rank=R,step=S,attempt=A`` makes global rank ``R`` send itself SIGKILL right after optimizer
step ``S`` completes (before that step's metrics record and checkpoint), when it runs as restart attempt
``A`` (``TORCHELASTIC_RESTART_COUNT``, 0 for the first attempt). ``attempt`` defaults to 0. SIGKILL leaves
no chance for clean-up, like an OOM kill or a lost host.

When ``LOOM_FAULT_LOG`` names a file, each kill first appends one JSON line
``{"event": "kill", "t": <unix seconds>, "rank": R, "step": S, "attempt": A}`` to it (flushed and fsynced),
so a benchmark can measure the time from the death to the first step after the restart.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass

ENV_PLAN = "LOOM_FAULT_PLAN"
ENV_LOG = "LOOM_FAULT_LOG"


class FaultPlanError(ValueError):
    """``LOOM_FAULT_PLAN`` is malformed."""


@dataclass(frozen=True)
class Kill:
    """SIGKILL global rank ``rank`` after optimizer step ``step`` on restart attempt ``attempt``."""

    rank: int
    step: int
    attempt: int = 0


def parse_plan(text: str | None) -> list[Kill]:
    """The faults in ``text`` (the ``LOOM_FAULT_PLAN`` syntax); empty for None/"".

    Raises :class:`FaultPlanError` naming the bad entry and the expected form.
    """
    faults: list[Kill] = []
    for entry in (text or "").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        kind, _, body = entry.partition(":")
        if kind.strip() != "kill":
            raise FaultPlanError(f"{ENV_PLAN}: unknown fault {entry!r}; the only kind is "
                                 "'kill:rank=R,step=S[,attempt=A]'")
        fields: dict[str, int] = {}
        for item in body.split(","):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or key not in ("rank", "step", "attempt"):
                raise FaultPlanError(f"{ENV_PLAN}: bad field {item!r} in {entry!r}; expected "
                                     "'kill:rank=R,step=S[,attempt=A]'")
            try:
                fields[key] = int(value)
            except ValueError:
                raise FaultPlanError(f"{ENV_PLAN}: {key}={value!r} in {entry!r} is not an integer") from None
        if "rank" not in fields or "step" not in fields:
            raise FaultPlanError(f"{ENV_PLAN}: {entry!r} needs rank= and step= "
                                 "('kill:rank=R,step=S[,attempt=A]')")
        faults.append(Kill(**fields))
    return faults


def restart_attempt() -> int:
    """This worker's restart attempt: ``TORCHELASTIC_RESTART_COUNT`` (0 when unset)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


class FaultInjector:
    """Reads the plan once; :meth:`after_step` kills this process when a fault matches."""

    def __init__(self, rank: int, plan: str | None = None, attempt: int | None = None):
        self.rank = rank
        self.attempt = restart_attempt() if attempt is None else attempt
        faults = parse_plan(os.environ.get(ENV_PLAN) if plan is None else plan)
        self.kill_steps = {f.step for f in faults if f.rank == rank and f.attempt == self.attempt}

    @property
    def active(self) -> bool:
        return bool(self.kill_steps)

    def after_step(self, step: int) -> None:
        """Call after optimizer step ``step`` completes: SIGKILLs this process if the plan says so."""
        if step not in self.kill_steps:
            return
        log = os.environ.get(ENV_LOG)
        if log:
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps({"event": "kill", "t": time.time(), "rank": self.rank, "step": step,
                                    "attempt": self.attempt}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        print(f"[loom] fault injection: rank {self.rank} SIGKILLs itself after step {step} "
              f"(attempt {self.attempt})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

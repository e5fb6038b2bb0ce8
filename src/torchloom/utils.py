"""Small helpers shared across torchloom."""
from __future__ import annotations

import difflib
import os
from typing import Iterable

import torch
import torch.distributed as dist


def closest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Closest valid names to ``name`` (for "did you mean" messages)."""
    cands = sorted(set(candidates))
    hits = difflib.get_close_matches(name, cands, n=n, cutoff=0.5)
    if not hits:
        hits = [c for c in cands if name.lower() in c.lower() or c.lower() in name.lower()][:n]
    return hits


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    hits = closest(name, candidates)
    return f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie, exited but not yet reaped, has); True when it
    cannot be told (another user's process, no ``/proc``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def distributed() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def default_device() -> torch.device:
    """The accelerator this process should use (``cuda:LOCAL_RANK`` etc.), else CPU."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        dev = acc.current_accelerator()
        return torch.device(dev.type, local_rank() % max(acc.device_count(), 1))
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def has_accelerator() -> bool:
    return default_device().type != "cpu"


def default_backend(device: torch.device | None = None) -> str:
    device = device or default_device()
    return "gloo" if device.type == "cpu" else dist.get_default_backend_for_device(device)

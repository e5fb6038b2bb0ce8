"""Per-rank host-memory snapshots for flash checkpoints: preallocated shared-memory slots, reused across
saves, double-buffered, with a header written last (a torn snapshot is detectable).

Layout of one rank's snapshot directory (under ``/dev/shm`` by default)::

    <dir>/slot0.data   raw tensor bytes (a file mapped with ``torch.from_file(shared=True)``; no pickling)
    <dir>/slot0.rng    this rank's RNG state (``torch.save`` of tensors/ints, read with ``weights_only``)
    <dir>/slot0.json   the header: step, world size, tensor entries (key, dtype, shape, offset, DTensor
                       layout) and the non-tensor state as JSON; written last through an atomic rename
    <dir>/slot1.*      the second buffer
    <dir>/saver.pid    the pid of this rank's saver process (see :mod:`torchloom.checkpoint.saver`)

Writing a slot first deletes its header, then copies the tensors, then renames the new header into
place: a slot without a header (or whose data file is shorter than the header says) is not a snapshot.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch

from torchloom.errors import CheckpointError

HEADER_FORMAT = "torchloom.flash.snapshot/1"
_ALIGN = 64


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in a flash snapshot header")
    return dt


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Slot:
    """One preallocated shared-memory buffer (``<dir>/slot{index}.*``) of a rank's snapshots."""

    def __init__(self, directory: str | os.PathLike, index: int):
        self.dir = Path(directory)
        self.index = index
        self.data_path = self.dir / f"slot{index}.data"
        self.header_path = self.dir / f"slot{index}.json"
        self.rng_path = self.dir / f"slot{index}.rng"
        self._buf: torch.Tensor | None = None

    # -- writing (the training process) -----------------------------------------------------------
    def holds(self, nbytes: int) -> bool:
        """Whether the mapped buffer already has room for ``nbytes`` bytes (no growing, no zero-filling)."""
        return self._buf is not None and self._buf.numel() >= nbytes

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """The mapped byte buffer, (re)allocated only when it must grow (so it is reused across saves)."""
        if not self.holds(nbytes):
            self.dir.mkdir(parents=True, exist_ok=True)
            self._buf = None
            with open(self.data_path, "ab") as f:
                f.truncate(max(nbytes, 1))
            self._buf = torch.from_file(str(self.data_path), shared=True, size=max(nbytes, 1), dtype=torch.uint8)
            self._buf.fill_(0)  # fault the pages in now, once, not during every save
        return self._buf

    def reserve(self, nbytes: int) -> None:
        """Preallocate (and fault in) at least ``nbytes`` bytes of shared memory for this slot. Growing the
        buffer zero-fills it, so a snapshot it held is invalidated first (never call it on a slot a saver
        is reading)."""
        if not self.holds(nbytes):
            self.invalidate()
        self._buffer(nbytes)

    def invalidate(self) -> None:
        """Delete the header: the slot no longer holds a snapshot."""
        self.header_path.unlink(missing_ok=True)

    def write(self, tensors: list[tuple[str, torch.Tensor, dict | None]], header: dict[str, Any],
              rng: bytes) -> int:
        """Copy ``tensors`` (``(key, local tensor, DTensor layout or None)``) into the slot, then write
        ``rng`` (this rank's RNG file, :func:`torchloom.checkpoint.trainer_state.encode_rng`; the saver
        writes these bytes as the checkpoint's ``rng/rank{r}.pt``) and finally the header (``header`` plus
        the entries). Returns the bytes copied."""
        entries, offset = [], 0
        for key, t, layout in tensors:
            n = _nbytes(t)
            entries.append({"key": key, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                            "offset": offset, "nbytes": n, "dtensor": layout})
            offset += -(-n // _ALIGN) * _ALIGN
        self.invalidate()
        buf = self._buffer(offset)
        self.last_nbytes = offset
        for (key, t, _layout), e in zip(tensors, entries):
            if e["nbytes"]:
                dst = buf[e["offset"]:e["offset"] + e["nbytes"]].view(t.dtype).view(t.shape)
                dst.copy_(t.detach())
        self.rng_path.write_bytes(rng)
        doc = dict(header, format=HEADER_FORMAT, entries=entries, data_bytes=offset)
        part = self.header_path.with_name(f"{self.header_path.name}.{uuid.uuid4().hex[:8]}.part")
        part.write_text(json.dumps(doc, allow_nan=False))
        os.replace(part, self.header_path)
        return offset

    # -- reading (the saver process, or a restarted trainer) ---------------------------------------
    def header(self) -> dict[str, Any] | None:
        """The parsed header if the slot holds a complete snapshot, else ``None``."""
        try:
            doc = json.loads(self.header_path.read_text(encoding="utf-8"))
            if doc.get("format") != HEADER_FORMAT:
                return None
            if self.data_path.stat().st_size < doc["data_bytes"] or not self.rng_path.is_file():
                return None
            return doc
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def read_tensors(self, header: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Views (no copy) of the snapshot's tensors, keyed by flattened state-dict key."""
        size = max(int(header["data_bytes"]), 1)
        buf = torch.from_file(str(self.data_path), shared=True, size=size, dtype=torch.uint8)
        out = {}
        for e in header["entries"]:
            dt = _dtype(e["dtype"])
            raw = buf[e["offset"]:e["offset"] + e["nbytes"]]
            out[e["key"]] = raw.view(dt).view(e["shape"]) if e["nbytes"] else torch.empty(e["shape"], dtype=dt)
        return out


def slots(directory: str | os.PathLike) -> list[Slot]:
    """The two slots of a rank's snapshot directory."""
    return [Slot(directory, 0), Slot(directory, 1)]


def complete_steps(directory: str | os.PathLike) -> dict[int, int]:
    """``{step: slot index}`` of the complete snapshots in ``directory``."""
    out = {}
    for s in slots(directory):
        h = s.header()
        if h is not None:
            out[int(h["step"])] = s.index
    return out

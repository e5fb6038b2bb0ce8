"""The atomic commit protocol for checkpoint directories.

This module knows nothing about models: it only decides *where* a checkpoint is written, *when* it counts
as complete, and *which* checkpoints are kept. :mod:`torchloom.checkpoint.api` builds the synchronous
``save``/``load`` on top of it; asynchronous ("flash") saves reuse the same pieces.

Layout under a checkpoint root::

    <root>/step_00000100/              a committed checkpoint (complete iff COMPLETE is valid)
        COMPLETE                       the completion marker, written last
        .metadata  __0_0.distcp ...    torch.distributed.checkpoint files
        trainer_state.json             step, scheduler, dataloader, scaler, extra (rank 0)
        rng/rank0.pt ...               per-rank RNG states
    <root>/.tmp-step_00000200/         a save in progress (or the debris of a crashed one)

Protocol (``begin_save`` -> every rank writes and fsyncs its files -> ``finish_save``):

1. rank 0 creates ``<root>/.tmp-step_XXXXXXXX/`` (removing stale ``.tmp-*`` debris) and broadcasts the
   path, so every rank writes into the same directory;
2. every rank writes its files there and fsyncs them;
3. all ranks agree that every rank succeeded (a barrier that also carries errors);
4. rank 0 writes its own files (``trainer_state.json``), fsyncs them and the directory, renames the
   temporary directory to ``<root>/step_XXXXXXXX`` (``os.replace``, atomic on POSIX), then writes the
   ``COMPLETE`` marker (JSON: step, world size, time, every file with its size and SHA-256; the ranks
   hash the files in parallel, each a share) through a temporary name, fsyncs it and the parent
   directories;
5. rank 0 applies retention (``keep_last``) and broadcasts the outcome.

A checkpoint is *complete* only if its marker parses and every file it lists exists with the listed
size, so a crash at any point leaves either the previous complete checkpoint or the new one as the
newest complete checkpoint, never a torn one (:func:`latest_complete`). It is *usable* if, in addition,
every file matches its recorded checksum (``verify(..., checksums=True)``); :func:`select` is the one
rule that picks the checkpoint to resume from, export or report as ok.

All ranks must see the same filesystem under ``root`` (a shared filesystem on multi-node jobs).
Collective helpers use ``torch.distributed`` object collectives (peers of the same job); nothing read
back from disk is ever unpickled here (the marker is JSON).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch.distributed as dist

from torchloom.errors import CheckpointError
from torchloom.utils import distributed as _distributed
from torchloom.utils import rank as _rank
from torchloom.utils import world_size as _world

_log = logging.getLogger("torchloom.checkpoint")

MARKER = "COMPLETE"
MARKER_FORMAT = "torchloom.checkpoint.marker/1"  # "checksums" was added without a format change
CHECKSUM = "sha256"
TMP_PREFIX = ".tmp-"
_FINAL_RE = re.compile(r"^step_(\d{8,})$")


class CorruptCheckpointError(CheckpointError):
    """A checkpoint is unusable: incomplete, or a file is missing, truncated, corrupt or fails its
    checksum. Choosing a checkpoint from a root skips such a checkpoint (with a warning naming the file)
    and takes the next older one; any other :class:`CheckpointError` (e.g. a strict mismatch) stops."""


# ----------------------------------------------------------------------------------------------- names
def step_dirname(step: int) -> str:
    """``step_00000042`` for step 42."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint step must be a non-negative int, got {step!r}")
    return f"step_{step:08d}"


def final_dir(root: str | os.PathLike, step: int) -> Path:
    """Where the committed checkpoint of ``step`` lives."""
    return Path(root) / step_dirname(step)


def tmp_dir(root: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before it is committed."""
    return Path(root) / f"{TMP_PREFIX}{step_dirname(step)}"


def parse_step(path: str | os.PathLike) -> int | None:
    """The step of a committed checkpoint directory name (``step_00000042`` -> 42), else ``None``."""
    m = _FINAL_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------------------------------- durability
def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file's data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry table (so created/renamed names survive a crash). Best effort on
    filesystems/OSes that cannot fsync directories."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory under ``path`` (and ``path`` itself)."""
    path = Path(path)
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            fsync_file(Path(dirpath) / name)
        fsync_dir(dirpath)


def write_file_durably(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through a temporary name in the same directory, fsync it, rename it into
    place and fsync the directory: readers see the old file or the whole new one, never half of it."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.part")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


# ------------------------------------------------------------------------------------------------ marker
@dataclass
class Marker:
    """Contents of a ``COMPLETE`` file."""

    step: int
    world_size: int
    time: float
    files: dict[str, int] = field(default_factory=dict)  # relative posix path -> size in bytes
    meta: dict[str, Any] = field(default_factory=dict)
    # relative posix path -> "sha256:<hex>"; empty in markers written before checksums were recorded
    checksums: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        doc = {
            "format": MARKER_FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "time": self.time,
            "time_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time)),
            "files": self.files,
            "meta": self.meta,
        }
        if self.checksums:
            doc["checksums"] = self.checksums
        return json.dumps(doc, indent=1, sort_keys=True)


def list_files(ckpt_dir: str | os.PathLike) -> dict[str, int]:
    """Every regular file under ``ckpt_dir`` except the marker: relative posix path -> size."""
    ckpt_dir = Path(ckpt_dir)
    out: dict[str, int] = {}
    for dirpath, _dirnames, filenames in os.walk(ckpt_dir):
        for name in filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(ckpt_dir).as_posix()
            if rel == MARKER or rel.startswith(f"{MARKER}."):
                continue
            out[rel] = p.stat().st_size
    return dict(sorted(out.items()))


def file_checksum(path: str | os.PathLike) -> str:
    """``"sha256:<hex>"`` of a file's bytes (read in 1 MiB chunks; ~1 GB/s on one core)."""
    with open(path, "rb") as f:
        return f"{CHECKSUM}:{hashlib.file_digest(f, CHECKSUM).hexdigest()}"


def _share(names: list[str], rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` hashes (round-robin over the sorted names)."""
    return [n for i, n in enumerate(sorted(names)) if i % world == rank]


def write_marker(
    ckpt_dir: str | os.PathLike, *, step: int, world_size: int, meta: dict[str, Any] | None = None,
    checksums: dict[str, str] | None = None,
) -> Marker:
    """List the files of ``ckpt_dir`` and durably write its ``COMPLETE`` marker (the commit point).

    ``checksums``: digests already computed (by the ranks, in parallel); the others are computed here."""
    ckpt_dir = Path(ckpt_dir)
    files = list_files(ckpt_dir)
    known = dict(checksums or {})
    sums = {rel: known.get(rel) or file_checksum(ckpt_dir / rel) for rel in files}
    marker = Marker(step=step, world_size=world_size, time=time.time(), files=files, meta=meta or {},
                    checksums=sums)
    write_file_durably(ckpt_dir / MARKER, marker.to_json())
    return marker


def read_marker(ckpt_dir: str | os.PathLike) -> Marker:
    """Parse ``ckpt_dir/COMPLETE``.

    Raises:
        CheckpointError: the marker is missing (the checkpoint is incomplete) or unreadable.
    """
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / MARKER
    if not path.is_file():
        raise CorruptCheckpointError(
            f"checkpoint {ckpt_dir} is incomplete: it has no {MARKER} marker (the save did not finish, "
            f"or this is not a torchloom checkpoint)"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("format") != MARKER_FORMAT:
            raise ValueError(f"unknown marker format {raw.get('format')!r} (expected {MARKER_FORMAT!r})")
        files = raw["files"]
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in files.items()
        ):
            raise ValueError("'files' must map relative paths to integer sizes")
        sums = raw.get("checksums") or {}
        if not isinstance(sums, dict) or not all(isinstance(k, str) and isinstance(v, str) and ":" in v
                                                 for k, v in sums.items()):
            raise ValueError("'checksums' must map relative paths to '<algorithm>:<hex>' strings")
        return Marker(
            step=int(raw["step"]),
            world_size=int(raw["world_size"]),
            time=float(raw["time"]),
            files=dict(files),
            meta=dict(raw.get("meta") or {}),
            checksums=dict(sums),
        )
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"checkpoint marker {path} is corrupt: {e}. The checkpoint is unusable.") from e


def verify(ckpt_dir: str | os.PathLike, *, checksums: bool = False,
           share: tuple[int, int] | None = None) -> Marker:
    """Check that ``ckpt_dir`` is a complete checkpoint and return its marker.

    Complete means: the marker parses, the step in the directory name (if any) matches it, and every
    file it lists exists with exactly the listed size. With ``checksums`` every file with a recorded
    checksum is also read and hashed (``share=(rank, world)``: only that rank's round-robin share of the
    files, for a verification split over ranks). A marker without checksums (written before they were
    recorded) is checked by sizes only: ``marker.checksums`` is empty then.

    Raises:
        CorruptCheckpointError: naming the directory (incomplete) or the offending file (missing,
            truncated, or its bytes differ from the recorded checksum).
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CorruptCheckpointError(f"checkpoint {ckpt_dir} does not exist or is not a directory")
    marker = read_marker(ckpt_dir)
    name_step = parse_step(ckpt_dir)
    if name_step is not None and name_step != marker.step:
        raise CorruptCheckpointError(
            f"checkpoint {ckpt_dir} is inconsistent: its name says step {name_step} but its {MARKER} marker "
            f"says step {marker.step}"
        )
    for rel, size in marker.files.items():
        p = ckpt_dir / rel
        if not p.is_file():
            raise CorruptCheckpointError(f"checkpoint {ckpt_dir} is corrupt: file {p} listed in its {MARKER} marker is missing")
        actual = p.stat().st_size
        if actual != size:
            what = "truncated" if actual < size else "larger than recorded"
            raise CorruptCheckpointError(
                f"checkpoint {ckpt_dir} is corrupt: file {p} is {what} ({actual} bytes, the {MARKER} marker "
                f"records {size})"
            )
    if checksums and marker.checksums:
        names = [n for n in marker.files if n in marker.checksums]
        for rel in (names if share is None else _share(names, *share)):
            want = marker.checksums[rel]
            algo = want.split(":", 1)[0]
            if algo != CHECKSUM:
                raise CorruptCheckpointError(f"checkpoint {ckpt_dir}: file {ckpt_dir / rel} has a checksum of "
                                             f"unknown algorithm {algo!r}")
            got = file_checksum(ckpt_dir / rel)
            if got != want:
                raise CorruptCheckpointError(
                    f"checkpoint {ckpt_dir} is corrupt: file {ckpt_dir / rel} does not match its checksum in "
                    f"the {MARKER} marker (same size, different bytes)")
    return marker


def is_complete(ckpt_dir: str | os.PathLike) -> bool:
    """Whether :func:`verify` accepts ``ckpt_dir``."""
    try:
        verify(ckpt_dir)
        return True
    except CheckpointError:
        return False


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """All ``step_*`` directories under ``root`` (complete or not), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        step = parse_step(p)
        if step is not None and p.is_dir():
            out.append((step, p))
    return sorted(out)


def latest_complete(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (highest step with a valid marker whose files all exist
    with the recorded sizes), or ``None``. Torn checkpoints are skipped, never returned."""
    for _step, p in reversed(list_checkpoints(root)):
        if is_complete(p):
            return p
    return None


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` looks like one checkpoint (rather than a root of checkpoints)."""
    p = Path(path)
    return (
        parse_step(p) is not None
        or p.name.startswith(TMP_PREFIX)
        or (p / MARKER).exists()
        or (p / ".metadata").exists()
    )


def root_hint(ckpt_dir: str | os.PathLike) -> str:
    """For one checkpoint directory a caller named that is unusable: a sentence pointing at its root when the
    root holds a complete checkpoint (``" The newest complete checkpoint under ROOT is step_N: pass ROOT ..."``),
    else ``""`` (the root would not help). Local; for messages only."""
    p = Path(ckpt_dir)
    found = latest_complete(p.parent)
    if found is None or found == p:
        return ""
    return (f" The newest complete checkpoint under {p.parent} is {found.name}: pass the root {p.parent} instead "
            "of one checkpoint to load the newest usable one.")


def _with_root_hint(e: CorruptCheckpointError, ckpt_dir: str | os.PathLike) -> CorruptCheckpointError:
    hint = root_hint(ckpt_dir)
    return CorruptCheckpointError(f"{e}{hint}") if hint else e


def resolve(path_or_root: str | os.PathLike) -> Path:
    """A verified complete checkpoint: ``path_or_root`` itself if it is a checkpoint directory, else the
    newest complete checkpoint under it. Local (no collectives); see :func:`agree_on_checkpoint`.

    Raises:
        CheckpointError: the directory is incomplete/corrupt, or the root holds no complete checkpoint.
    """
    p = Path(path_or_root)
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist")
    if is_checkpoint_dir(p):
        try:
            verify(p)
        except CorruptCheckpointError as e:
            hinted = _with_root_hint(e, p)
            if hinted is e:
                raise
            raise hinted from e
        return p
    found = latest_complete(p)
    if found is None:
        torn = [q.name for _s, q in list_checkpoints(p)]
        hint = f" (incomplete ones: {', '.join(torn)})" if torn else ""
        raise CheckpointError(f"no complete checkpoint under {p}{hint}")
    return found


# -------------------------------------------------------------------------------------- commit/cleanup
def _remove_tree(path: Path) -> None:
    """Remove a directory: first rename it to a ``.tmp-`` name (atomic, so a crash mid-delete leaves
    debris that stale cleanup removes, never a half-deleted directory under a real name)."""
    if not path.exists():
        return
    if not path.name.startswith(TMP_PREFIX):
        doomed = path.with_name(f"{TMP_PREFIX}delete-{path.name}-{uuid.uuid4().hex[:8]}")
        os.replace(path, doomed)
        fsync_dir(path.parent)
        path = doomed
    shutil.rmtree(path, ignore_errors=True)


def clean_stale_tmp(root: str | os.PathLike, keep: Iterable[str | os.PathLike] = ()) -> list[Path]:
    """Delete ``.tmp-*`` entries under ``root`` (debris of crashed saves/deletes), except those in ``keep``.

    Only call this when no other save into ``root`` is in flight (or pass its directory in ``keep``).
    """
    root = Path(root)
    if not root.is_dir():
        return []
    keep_set = {Path(k).resolve() for k in keep}
    removed = []
    for p in root.iterdir():
        if p.name.startswith(TMP_PREFIX) and p.resolve() not in keep_set:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def fsync_dirs(path: str | os.PathLike) -> None:
    """fsync ``path`` and every directory below it (their entries), not the files."""
    for dirpath, _dirnames, _filenames in os.walk(path):
        fsync_dir(dirpath)


def publish(tmp: str | os.PathLike, root: str | os.PathLike, *, step: int, world_size: int,
            meta: dict[str, Any] | None = None, fsync_files: bool = False,
            checksums: dict[str, str] | None = None) -> Path:
    """Commit a fully written temporary directory (rank 0 only, no collectives).

    fsyncs ``tmp``'s directories (and its files too if ``fsync_files``; by default each writer has
    already fsynced its own files, so rank 0 need not reopen every rank's files), renames it to
    ``<root>/step_XXXXXXXX`` (moving an existing checkpoint of the same step out of the way first), writes
    the ``COMPLETE`` marker last (with ``checksums`` already computed, the rest computed here) and fsyncs
    it and ``root``.
    """
    tmp, root = Path(tmp), Path(root)
    final = final_dir(root, step)
    if fsync_files:
        fsync_tree(tmp)
    else:
        fsync_dirs(tmp)
    replaced = None
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside, atomically
        replaced = root / f"{TMP_PREFIX}replaced-{final.name}-{uuid.uuid4().hex[:8]}"
        os.replace(final, replaced)
    os.replace(tmp, final)
    fsync_dir(root)
    write_marker(final, step=step, world_size=world_size, meta=meta, checksums=checksums)
    fsync_dir(root)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return final


def apply_retention(root: str | os.PathLike, keep_last: int | None, *,
                    protect: Iterable[str | os.PathLike] = ()) -> list[Path]:
    """Keep the ``keep_last`` newest complete checkpoints under ``root``; delete older complete ones and
    incomplete ``step_*`` directories older than the newest complete one. The newest complete checkpoint
    and anything in ``protect`` are never deleted. ``keep_last=None`` keeps everything.
    """
    if keep_last is None:
        return []
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise CheckpointError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
    root = Path(root)
    protected = {Path(p).resolve() for p in protect}
    entries = list_checkpoints(root)
    complete = [(s, p) for s, p in entries if is_complete(p)]
    if not complete:
        return []
    newest_step, newest = complete[-1]
    protected.add(newest.resolve())
    keep = {p.resolve() for _s, p in complete[-keep_last:]} | protected
    doomed = [p for _s, p in complete if p.resolve() not in keep]
    doomed += [p for s, p in entries if s < newest_step and not is_complete(p) and p.resolve() not in protected]
    for p in doomed:
        _remove_tree(p)
    if doomed:
        fsync_dir(root)
    return doomed


# ---------------------------------------------------------------------------------------- collectives
def broadcast_from_rank0(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 only and return its result on every rank; if it raises, every rank raises a
    :class:`CheckpointError` with rank 0's message (so no rank is left waiting in a collective)."""
    payload: list[Any] = [None]
    if _rank() == 0:
        try:
            payload[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - forwarded to every rank
            payload[0] = ("error", e if isinstance(e, CheckpointError) else CheckpointError(f"{type(e).__name__}: {e}"))
    if _distributed() and _world() > 1:
        dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "error":
        cls = CorruptCheckpointError if isinstance(value, CorruptCheckpointError) else CheckpointError
        raise cls(str(value)) from (value if _rank() == 0 else None)
    return value


def run_everywhere(fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on every rank, then agree: if it raised on any rank, every rank raises a
    :class:`CheckpointError` naming the failing ranks. Doubles as a barrier."""
    result, err = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - forwarded to every rank
        msg = f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
        err = (msg, isinstance(e, CorruptCheckpointError))
        local_exc = e
    if _distributed() and _world() > 1:
        errs: list[Any] = [None] * _world()
        dist.all_gather_object(errs, err)
    else:
        errs = [err]
    failed = [(r, m) for r, m in enumerate(errs) if m is not None]
    if failed:
        same: dict[str, list[int]] = {}  # one message per distinct error (ranks usually agree on it)
        for r, m in failed:
            same.setdefault(m[0], []).append(r)
        detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {msg}"
                           for msg, rs in same.items())
        cls = CorruptCheckpointError if all(m[1] for _r, m in failed) else CheckpointError
        exc = cls(f"{what} failed on {len(failed)} rank(s): {detail}")
        if err is not None:
            raise exc from local_exc
        raise exc
    return result


def begin_save(root: str | os.PathLike, step: int, *, keep_tmp: Iterable[str | os.PathLike] = ()) -> Path:
    """Collective. Rank 0 creates ``root`` and a fresh ``<root>/.tmp-step_XXXXXXXX/`` (deleting stale
    ``.tmp-*`` debris except ``keep_tmp``); every rank returns that path (broadcast, so all agree)."""
    root = Path(root)
    step_dirname(step)  # validates step on every rank

    def _prepare() -> str:
        root.mkdir(parents=True, exist_ok=True)
        tmp = tmp_dir(root, step)
        clean_stale_tmp(root, keep=keep_tmp)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        fsync_dir(root)
        return str(tmp.resolve())

    return Path(broadcast_from_rank0(_prepare))


def finish_save(
    tmp: str | os.PathLike,
    root: str | os.PathLike,
    *,
    step: int,
    rank0_write: Callable[[Path], None] | None = None,
    keep_last: int | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Collective. Call on every rank after it wrote *and fsynced* its files into ``tmp``.

    Waits for every rank, then rank 0 runs ``rank0_write(tmp)`` (its own files, e.g. trainer state),
    publishes the directory (:func:`publish`: rename + ``COMPLETE`` marker) and applies ``keep_last`` retention.
    Returns the committed directory on every rank, or raises :class:`CheckpointError` on every rank.
    """
    tmp, root = Path(tmp), Path(root)
    world = _world()
    run_everywhere(lambda: None, "checkpoint barrier")
    sums = gather_checksums(tmp)

    def _commit() -> str:
        if rank0_write is not None:
            rank0_write(tmp)
        final = publish(tmp, root, step=step, world_size=world, meta=meta, checksums=sums)
        apply_retention(root, keep_last, protect=[final])
        return str(final)

    return Path(broadcast_from_rank0(_commit))


def gather_checksums(ckpt_dir: Path) -> dict[str, str]:
    """Collective. Every rank hashes its round-robin share of the files now in ``ckpt_dir`` (all ranks
    see the same files: call after every rank has written); the union is returned on every rank (rank 0
    writes it into the marker). Errors are raised on every rank."""
    rank, world = _rank(), _world()
    mine = run_everywhere(lambda: {rel: file_checksum(ckpt_dir / rel)
                                   for rel in _share(list(list_files(ckpt_dir)), rank, world)},
                          "checksumming the checkpoint files")
    if not (_distributed() and world > 1):
        return mine
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def verify_everywhere(ckpt_dir: Path, read: Callable[[Path], Any] | None = None) -> tuple[Marker, Any]:
    """Collective :func:`verify` with checksums: rank 0 checks the marker, sizes and (``read``) the small
    files; then every rank hashes its share of the files. Returns ``(marker, read result)`` on every rank.

    Raises:
        CorruptCheckpointError: on every rank, naming the file, if the checkpoint is unusable.
    """
    def _structure():
        m = verify(ckpt_dir)
        return m, (read(ckpt_dir) if read is not None else None)

    marker, extra = broadcast_from_rank0(_structure)
    if marker.checksums:
        run_everywhere(lambda: verify(ckpt_dir, checksums=True, share=(_rank(), _world())),
                       f"verifying the checksums of {ckpt_dir}")
    return marker, extra


def select(path_or_root: str | os.PathLike, usable: Callable[[Path], Any], *,
           collective: bool = False) -> tuple[Path, Any]:
    """The one rule that picks a checkpoint (resume, ``loom ckpt export`` and ``loom ckpt verify`` use it).

    ``path_or_root`` is one checkpoint directory (used as is: its problems are raised) or a root: its
    checkpoints are tried newest first and the first for which ``usable(path)`` returns is chosen; one
    raising :class:`CorruptCheckpointError` is skipped with a logged warning naming the reason (the file),
    and the next older one is tried. Any other error propagates. ``collective``: the candidate list comes
    from rank 0 and ``usable`` must be collective and agree on every rank (e.g. :func:`verify_everywhere`).

    Returns:
        ``(path, usable(path))``.

    Raises:
        CheckpointError: the path does not exist, or no checkpoint under the root is usable (listing why
            each was skipped).
    """
    p = Path(path_or_root)

    def _candidates() -> tuple[list[str], bool]:
        if not p.exists():
            raise CheckpointError(f"checkpoint path {p} does not exist")
        if is_checkpoint_dir(p):
            return [str(p)], True
        return [str(q) for _s, q in reversed(list_checkpoints(p))], False

    cands, single = broadcast_from_rank0(_candidates) if collective else _candidates()
    if single:  # the caller named this checkpoint: its problems are raised, with its root when that would help
        try:
            return Path(cands[0]), usable(Path(cands[0]))
        except CorruptCheckpointError as e:
            hinted = _with_root_hint(e, cands[0])
            if hinted is e:
                raise
            raise hinted from e
    skipped: list[str] = []
    for c in map(Path, cands):
        try:
            result = usable(c)
        except CorruptCheckpointError as e:
            skipped.append(f"{c.name}: {e}")
            continue
        if skipped and (not collective or _rank() == 0):
            _log.warning("checkpoint root %s: skipped %d unusable checkpoint(s) (%s); using %s",
                         p, len(skipped), "; ".join(skipped), c)
        return c, result
    why = f" (skipped: {'; '.join(skipped)})" if skipped else ""
    raise CheckpointError(f"no complete checkpoint under {p}{why}")


def agree_on_checkpoint(path_or_root: str | os.PathLike,
                        read: Callable[[Path], Any] | None = None) -> tuple[Path, Marker, Any]:
    """Collective. :func:`select` with :func:`verify_everywhere` (marker, sizes, ``read`` of the small
    files on rank 0, checksums split over the ranks): every rank gets ``(path, marker, read result)`` of
    the same checkpoint. Errors are raised on every rank.
    """
    path, (marker, extra) = select(path_or_root, lambda c: verify_everywhere(c, read), collective=True)
    return path, marker, extra

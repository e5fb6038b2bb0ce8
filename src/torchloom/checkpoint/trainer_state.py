"""The trainer state, encoded and decoded in one place for both checkpoint tiers.

The disk tier (:mod:`torchloom.checkpoint.api`) and the flash tier (:mod:`torchloom.checkpoint.flash`, its
saver) only move bytes: they call this module to turn the live objects into a checkpoint and back.
A state has these components, each encoded and decoded here only:

==============  ==========================================  ===============================================
component       encoded as                                  stored (disk tier / flash slot)
==============  ==========================================  ===============================================
model           ``get_model_state_dict`` (FQN keys)         DCP ``model.*`` / slot tensors
optimizer       :mod:`~torchloom.checkpoint.optimizer_state`  DCP ``optim.*`` / slot tensors
rng             :func:`~torchloom.checkpoint.state.capture_rng`  ``rng/rank{r}.pt`` / ``slot{i}.rng``
lr_scheduler    ``state_dict()`` as JSON                    ``trainer_state.json`` (the *document*)
train_step      ``state_dict()`` as JSON (counters, scaler)  document
dataloader      ``state_dict()`` as JSON, once or per rank   document
scaler_state    user-driven loss scaler's state (JSON)      document
extra           user data (JSON)                            document
==============  ==========================================  ===============================================

A trainable-only state (``Live.trainable_only``) leaves the frozen parameters out of ``model`` and records
their fingerprint in the document; loading it checks that and loads on top of the live base
(:mod:`~torchloom.checkpoint.trainable`).

Rules shared by both tiers: ``strict=True`` requires every object passed to have state in the checkpoint
and the model keys to match; a per-rank entry (dataloader, RNG) of rank ``r`` is the one saved by rank
``r % saved_world_size``. To add a piece of state, add it here (:func:`encode_document`/
:func:`restore_document`, or the tensors of :func:`encode_tensors`/:func:`restore_tensors`).
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from torchloom.checkpoint import optimizer_state, trainable
from torchloom.checkpoint.commit import CorruptCheckpointError, run_everywhere
from torchloom.checkpoint.state import (
    _holds_part_of_model,
    _optimizers,
    _zero_state_from_fqn,
    _zero_state_to_fqn,
    capture_rng,
    flat_optimizer,
    from_json,
    is_zero_optimizer,
    restore_rng,
    short_error,
    tied_groups,
    to_json,
)
from torchloom.errors import CheckpointError

TRAINER_STATE = "trainer_state.json"
TRAINER_STATE_FORMAT = "torchloom.checkpoint.trainer_state/1"
#: the advice a strict model-key mismatch ends with (reworded for TorchloomTrainer: torchloom.hf.trainer_errors)
STRICT_ADVICE = "Load with strict=False to load the overlap"
RNG_DIR = "rng"
# 2: optimizer state written by optimizer_state.encode (no zero-lr step before saving an empty optimizer)
OPTIMIZER_ENCODING = 2


def rng_file(rank: int) -> str:
    """Relative path of rank ``rank``'s RNG state inside a checkpoint directory."""
    return f"{RNG_DIR}/rank{rank}.pt"


@dataclass
class Live:
    """The live objects a checkpoint saves and restores (any may be ``None`` except ``model``)."""

    model: nn.Module
    optimizer: Any = None
    lr_scheduler: Any = None
    dataloader: Any = None
    train_step: Any = None
    trainable_only: bool = False  # save: the model's frozen parameters are left out (trainable.py)

    def optimizers(self) -> tuple:
        return _optimizers(self.optimizer)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ------------------------------------------------------------------------------------------- tensors
def encode_tensors(live: Live) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}``: the tensor state to save (DTensors stay sharded). Collective.

    ``ZeroRedundancyOptimizer``: every rank consolidates to rank 0 and only rank 0 contributes ``optim``
    (same FQN layout as a plain optimizer), so the checkpoint loads into any optimizer kind and size.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    opts = live.optimizers()
    out: dict[str, Any] = {"model": get_model_state_dict(live.model)}
    if live.trainable_only:
        keep = trainable.saved_model_keys(live.model, set(out["model"]))
        out["model"] = {k: v for k, v in out["model"].items() if k in keep}
    if opts and is_zero_optimizer(opts[0]):
        zero = opts[0]
        rank, world = _rank_world()
        if world > 1:
            zero.consolidate_state_dict(to=0)
        if rank == 0:
            out["optim"] = _zero_state_to_fqn(live.model, zero)
    elif opts:
        out["optim"] = optimizer_state.encode(live.model, opts, flat=flat_optimizer(live.model))
    return out


def optimizer_state_empty(live: Live) -> bool:
    """Whether no optimizer passed has per-parameter state on this rank (ZeRO: in its local shard)."""
    opts = live.optimizers()
    return bool(opts) and all(not (o.optim.state if is_zero_optimizer(o) else o.state) for o in opts)


def catalogue_from_metadata(md: Any) -> dict[str, tuple[tuple, bool]]:
    """``{checkpoint key: (path, is_tensor)}`` of a DCP checkpoint's metadata."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    planner = md.planner_data or {}
    out = {}
    for key, meta in md.state_dict_metadata.items():
        path = planner.get(key)
        if not path:
            head, _, rest = key.partition(".")
            path = (head, rest)
        out[key] = (tuple(path), not isinstance(meta, BytesStorageMetadata))
    return out


def _check_model_keys(live: Live, want: set[str], have: set[str], where: str, *, per_rank: bool) -> None:
    if not per_rank and dist.is_available() and dist.is_initialized() and _holds_part_of_model(live.model):
        everyone: list[Any] = [None] * dist.get_world_size()  # pipeline stages: the job's keys are the union
        dist.all_gather_object(everyone, sorted(want))
        want = set().union(*map(set, everyone))
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {where} does not match the model (strict=True): missing {len(missing)} keys "
            f"{missing[:5]}, unexpected {len(unexpected)} keys {unexpected[:5]}. {STRICT_ADVICE}."
        )


def restore_tensors(live: Live, catalogue: dict[str, tuple[tuple, bool]],
                    fill: Callable[[dict[str, Any]], None], *, strict: bool, where: str,
                    document: dict | None = None,
                    read_full_optimizer: Callable[[], dict] | None = None, per_rank: bool = False) -> None:
    """Restore model and optimizer from a saved state. Collective (DTensor loads, pipeline key checks).

    Args:
        catalogue: ``{checkpoint key: (path, is_tensor)}`` of the saved entries (DCP metadata or a flash
            snapshot header).
        fill: fills a flat target ``{key: live tensor or None}`` in place from the saved state (tensors
            copied into the given ones, non-tensor values assigned).
        document: the trainer-state document (old checkpoints mark an optimizer saved without state).
        read_full_optimizer: returns the whole unsharded ``optim`` entry (needed for ZeRO).
        per_rank: the saved state is this rank's own (a flash snapshot), not the whole job's: a pipeline
            stage's model keys are checked against it alone.

    Raises:
        CheckpointError: a mismatch under ``strict`` (naming the keys), or the checkpoint has no optimizer
            state while an optimizer is passed (``strict``).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    opts = live.optimizers()
    model_keys = {path[1]: key for key, (path, _t) in catalogue.items() if path[0] == "model" and len(path) == 2}
    optim_cat = {key: (path[1:], t) for key, (path, t) in catalogue.items() if path[0] == "optim"}
    doc = document or {}
    if doc.get("optimizer_state_empty") and doc.get("optimizer_encoding") is None:
        # written by torchloom <= 0.x through DSD, which ran a zero-lr step first: that state is not real
        optim_cat = {k: v for k, v in optim_cat.items() if not (v[0] and str(v[0][0]).startswith("state"))}
    if opts and not optim_cat and strict:
        raise CheckpointError(
            f"checkpoint {where} has no optimizer state (it was saved without an optimizer): pass "
            f"optimizer=None, or strict=False to keep the optimizer as it is")
    zero = opts[0] if opts and is_zero_optimizer(opts[0]) else None
    names = set(optimizer_state.param_names(live.model).values())
    flat_saved = any(optimizer_state.classify(p, names) is not None and optimizer_state.classify(p, names)[0]
                     == "flat_group" for p, _t in optim_cat.values())
    if zero is not None and flat_saved:
        raise CheckpointError(f"checkpoint {where} stores optimizer state per parameter name (a pipelined job), "
                              f"which a ZeRO optimizer cannot load; load the model only (optimizer=None)")

    msd = get_model_state_dict(live.model)
    partial = doc.get(trainable.RECORD)  # a trainable-only checkpoint: the frozen base stays as it is
    want = set(msd)
    if partial:
        trainable.check_load(partial, live.model, set(model_keys), strict=strict, where=where, per_rank=per_rank)
        want = trainable.saved_model_keys(live.model, want)
    if strict:  # collective for pipeline stages; the same verdict on every rank
        _check_model_keys(live, want, set(model_keys), where, per_rank=per_rank)
    ties = [[n for n in g if n in msd and n in model_keys] for g in tied_groups(live.model)]

    # Local phases run through run_everywhere: an error on some ranks (e.g. one pipeline stage's optimizer
    # does not match) is raised on every rank instead of leaving the others waiting in the next collective.
    def _target() -> dict[str, Any]:
        out: dict[str, Any] = {model_keys[k]: v for k, v in msd.items() if k in model_keys}
        for group in ties:  # aliases get their own buffer, so two different saved values are seen, not merged
            for alias in group[1:]:
                out[model_keys[alias]] = torch.empty_like(msd[alias])
        if opts and optim_cat and zero is None:
            out.update(optimizer_state.target(live.model, opts, optim_cat, where=where))
        return out

    flat_target = run_everywhere(_target, f"preparing to load {where}")
    fill(flat_target)
    loaded = {k: flat_target[key] for k, key in model_keys.items() if key in flat_target}
    run_everywhere(lambda: [check_tied_values(loaded, g, f"checkpoint {where}") for g in ties],
                   f"checking the tied parameters of {where}")
    full_optim = read_full_optimizer() if zero is not None and optim_cat and read_full_optimizer is not None else None

    def _set() -> None:
        set_model_state_dict(live.model, {k: loaded[k] for k in msd if k in loaded},
                             options=StateDictOptions(strict=strict and not partial))
        if full_optim is not None:
            zero.load_state_dict(_zero_state_from_fqn(live.model, zero, full_optim))
        elif opts and optim_cat and zero is None:
            optimizer_state.decode(live.model, opts, {k: v for k, v in flat_target.items() if k in optim_cat},
                                   optim_cat, strict=strict, where=where)

    run_everywhere(_set, f"loading {where} into the model and optimizer")


def check_tied_values(sd: dict[str, Any], names: list[str], where: str) -> None:
    """Raise if ``sd`` holds different values for ``names``, which the model ties (one tensor): loading
    would keep one of them silently.

    Raises:
        CheckpointError: naming both keys and ``where``.
    """
    first = None
    for n in names:
        v = sd.get(n)
        if not isinstance(v, torch.Tensor):
            continue
        if first is None:
            first = n
            continue
        a, b = sd[first], v
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        b = b.full_tensor() if hasattr(b, "full_tensor") else b
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.detach().cpu(), b.detach().cpu()):
            raise CheckpointError(
                f"{where} holds different values for {first!r} and {n!r}, which the model ties (one "
                f"parameter): loading would silently keep one of them. Remove one key, or untie the model "
                f"(e.g. tie_word_embeddings=False) to load both")


# ------------------------------------------------------------------------------------------ document
def encode_document(live: Live, *, step: int, extra: dict | None = None,
                    scaler_state: dict | None = None) -> dict[str, Any]:
    """The JSON document (``trainer_state.json``): step, scheduler, ``TrainStep``, dataloader (once if
    every rank's state is equal, else per rank), loss scaler, user ``extra``, tied parameters. Collective:
    a value JSON cannot hold fails on every rank, before anything is written."""
    rank, world = _rank_world()

    def _encode() -> dict[str, Any]:
        def enc(obj, what):
            return to_json(obj.state_dict(), what) if obj is not None else None

        return {
            "lr_scheduler": enc(live.lr_scheduler, "lr_scheduler.state_dict()"),
            "dataloader": enc(live.dataloader, "dataloader.state_dict()"),
            "scaler_state": to_json(scaler_state, "scaler_state") if scaler_state is not None else None,
            "train_step": enc(live.train_step, "train_step.state_dict()"),
            "extra": to_json(dict(extra or {}), "extra"),
        }

    enc = run_everywhere(_encode, "encoding the trainer state")
    per_rank = [(enc["dataloader"], optimizer_state_empty(live))]
    if world > 1:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, (enc["dataloader"], optimizer_state_empty(live)))
    opts = live.optimizers()
    doc = {
        "format": TRAINER_STATE_FORMAT,
        "step": step,
        "world_size": world,
        "torch_version": torch.__version__,
        "optimizer": None if not opts else ("zero" if is_zero_optimizer(opts[0]) else "dsd"),
        "optimizer_encoding": OPTIMIZER_ENCODING if opts else None,
        "optimizer_state_empty": bool(opts) and all(e for _d, e in per_rank),
        "lr_scheduler": enc["lr_scheduler"],
        "scaler_state": enc["scaler_state"],
        "train_step": enc["train_step"],
        "extra": enc["extra"],
        "tied_params": tied_groups(live.model),
        # {"params": trainable names, "frozen": fingerprint of the frozen base} or None (a full checkpoint)
        trainable.RECORD: trainable.record(live) if live.trainable_only else None,
    }
    dls = [d for d, _e in per_rank]
    if live.dataloader is None:
        doc["dataloader"] = None
    elif all(s == dls[0] for s in dls):
        doc["dataloader"] = dls[0]
    else:
        doc["dataloader"], doc["dataloader_per_rank"] = None, dls
    return doc


def document_text(doc: dict) -> str:
    return json.dumps(doc, indent=1, allow_nan=False)


def parse_document(text: str, where: str) -> dict:
    """Validate and decode a ``trainer_state.json`` text.

    Raises:
        CorruptCheckpointError: not a trainer-state document (naming ``where``).
    """
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("format") != TRAINER_STATE_FORMAT or not isinstance(raw.get("step"), int):
            raise ValueError(f"not a {TRAINER_STATE_FORMAT} document")
        return from_json(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"checkpoint file {where} is corrupt: {e}") from e


def read_document(ckpt: Path) -> dict:
    """Read and validate ``<ckpt>/trainer_state.json``."""
    path = Path(ckpt) / TRAINER_STATE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"checkpoint file {path} is missing") from e
    except (OSError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"checkpoint file {path} is corrupt: {e}") from e
    return parse_document(text, str(path))


def restore_document(live: Live, doc: dict, *, strict: bool, where: str) -> dict:
    """Restore scheduler, ``TrainStep`` and dataloader from a document; return ``{"step", "extra",
    "scaler_state"}``. Rank ``r`` takes the per-rank dataloader state of saved rank ``r % saved_world``.

    Raises:
        CheckpointError: ``strict`` and an object passed has no state in the checkpoint.
    """
    rank, _world = _rank_world()
    for attr in ("lr_scheduler", "train_step"):
        obj = getattr(live, attr)
        if obj is None:
            continue
        if doc.get(attr) is not None:
            obj.load_state_dict(doc[attr])
        elif strict:
            raise CheckpointError(f"checkpoint {where} has no {attr} state (pass {attr}=None or strict=False)")
    if live.dataloader is not None:
        state, per_rank = doc.get("dataloader"), doc.get("dataloader_per_rank")
        if state is None and per_rank:
            state = per_rank[rank % len(per_rank)]
        if state is not None:
            live.dataloader.load_state_dict(state)
        elif strict:
            raise CheckpointError(f"checkpoint {where} has no dataloader state (pass dataloader=None or strict=False)")
    return {"step": int(doc["step"]), "extra": doc.get("extra") or {}, "scaler_state": doc.get("scaler_state")}


# ----------------------------------------------------------------------------------------------- RNG
def encode_rng() -> bytes:
    """This rank's RNG states (python, numpy, torch CPU, accelerator), serialised (tensors/ints only)."""
    buf = io.BytesIO()
    torch.save(capture_rng(), buf)
    return buf.getvalue()


def write_rank_file(ckpt_dir: Path, rel: str, data: bytes) -> Path:
    """Write one rank's file (e.g. :func:`rng_file`) into a checkpoint being saved, fsynced."""
    from torchloom.checkpoint.commit import fsync_file

    p = Path(ckpt_dir) / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    fsync_file(p)
    return p


def rng_source(rank: int, saved_world: int) -> int:
    """The saved rank whose RNG state (and per-rank dataloader state) rank ``rank`` restores."""
    return rank % max(int(saved_world), 1)


def restore_rng_file(path: Path) -> None:
    """Restore this process's RNG from a file written from :func:`encode_rng` (``weights_only`` load).

    Raises:
        CorruptCheckpointError: the file is missing, corrupt, or holds an invalid RNG state (naming it).
    """
    try:
        st = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"checkpoint file {path} is missing") from e
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpointError(f"checkpoint file {path} is corrupt: {type(e).__name__}: {short_error(e)}") from e
    try:
        restore_rng(st)
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpointError(f"checkpoint file {path} holds an invalid RNG state: {type(e).__name__}: {e}") from e


__all__ = [
    "Live", "RNG_DIR", "STRICT_ADVICE", "TRAINER_STATE", "TRAINER_STATE_FORMAT", "catalogue_from_metadata",
    "document_text", "encode_document", "encode_rng", "encode_tensors", "parse_document", "read_document",
    "restore_document", "restore_rng_file", "restore_tensors", "rng_file", "rng_source", "write_rank_file",
]

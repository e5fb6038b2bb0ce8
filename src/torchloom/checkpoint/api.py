"""``save``/``load`` of a whole training state, and consolidated ``safetensors`` export.

See ``docs/checkpoint.md`` for the layout, the commit protocol and the guarantees.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torchloom.checkpoint import commit
from torchloom.checkpoint import trainer_state as ts
from torchloom.checkpoint.commit import CorruptCheckpointError
from torchloom.checkpoint.trainer_state import check_tied_values
from torchloom.checkpoint.state import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    _load_everything,
    canonical_key,
    full_model_state,
    quiet_single_process,
    read_metadata_safely,
    read_model_tensors,
    tied_groups,
    unwrap_checkpoint_exception,
    wrapper_components,
)
from torchloom.errors import CheckpointError
from torchloom.utils import distributed as _distributed
from torchloom.utils import rank as _rank

TRAINER_STATE = ts.TRAINER_STATE
TRAINER_STATE_FORMAT = ts.TRAINER_STATE_FORMAT
RNG_DIR = ts.RNG_DIR
_TIED_META = "torchloom.tied"


# ------------------------------------------------------------------------------------------- save
def save(
    root: str | os.PathLike,
    *,
    step: int,
    model: nn.Module,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    dataloader: Any = None,
    extra: dict | None = None,
    scaler_state: dict | None = None,
    train_step: Any = None,
    keep_last: int | None = None,
    trainable_only: bool = False,
) -> Path:
    """Save a training state as ``<root>/step_{step:08d}/`` and return that path (on every rank).

    Collective: call on every rank with the same ``root`` and ``step``. What is saved and how is
    :mod:`torchloom.checkpoint.trainer_state` (shared with the flash tier).

    Args:
        root: checkpoint root directory (shared by all ranks).
        step: the training step (non-negative int); names the directory.
        model: the (possibly DDP/FSDP2/compiled/activation-checkpointed/pipelined) model.
        optimizer: its optimizer (``torch.optim.Optimizer``, a list of them, or a
            ``ZeroRedundancyOptimizer``), or ``None``. Every parameter's state is saved as the optimizer
            holds it (frozen parameters' too; parameters without state have none).
        lr_scheduler: anything with ``state_dict()``/``load_state_dict()`` returning plain data.
        dataloader: a dataloader or sampler with ``state_dict()``/``load_state_dict()`` (plain data).
            Saved once if every rank's state is equal, else per rank.
        extra: user data (JSON-like: dicts, lists, str, int, float, bool, None, small tensors).
        scaler_state: a loss scaler's ``state_dict()`` (plain data).
        train_step: the :class:`~torchloom.TrainStep` of ``auto_accelerate``: its step counters and fp16
            loss-scaler state are saved (so ``scaler_state`` is not needed with it).
        keep_last: keep only this many newest complete checkpoints under ``root`` (deleted only after
            this one is committed; the newest complete checkpoint is never deleted). ``None`` keeps all.
        trainable_only: store of the model only the parameters with ``requires_grad=True`` and every
            persistent buffer (the frozen base is left out; a LoRA checkpoint is then about the size of the
            adapters and their optimizer state), plus a fingerprint of the frozen base that :func:`load`
            checks; :func:`load` then loads on top of a base model already in place. See
            :mod:`torchloom.checkpoint.trainable` and "Trainable-only checkpoints" in ``docs/checkpoint.md``.

    Raises:
        CheckpointError: on every rank, if any rank failed (nothing is committed then); with
            ``trainable_only``, also if the model has no trainable parameter or a frozen parameter has
            optimizer state (it was trained: its value would be lost).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    root = Path(root)
    commit.step_dirname(step)
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise CheckpointError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
    if not isinstance(trainable_only, bool):
        raise CheckpointError(f"trainable_only must be a bool, got {trainable_only!r}")
    live = ts.Live(model, optimizer, lr_scheduler, dataloader, train_step, trainable_only=trainable_only)
    # The document first: a value JSON cannot hold fails here, before anything is written.
    doc = ts.encode_document(live, step=step, extra=extra, scaler_state=scaler_state)
    tmp = commit.begin_save(root, step)
    try:
        state = ts.encode_tensors(live)
        with quiet_single_process():
            dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=not _distributed())
    except (Exception, dcp.api.CheckpointException) as e:  # CheckpointException is a BaseException
        raise unwrap_checkpoint_exception(e, tmp, "saving") from e
    del state
    rng = ts.encode_rng()
    commit.run_everywhere(lambda: ts.write_rank_file(tmp, ts.rng_file(_rank()), rng), "writing the RNG state")

    def _rank0_write(d: Path) -> None:
        commit.write_file_durably(d / TRAINER_STATE, ts.document_text(doc))

    return commit.finish_save(tmp, root, step=step, rank0_write=_rank0_write, keep_last=keep_last)


# ------------------------------------------------------------------------------------------- load
def _read_small_files(ckpt: Path) -> dict:
    """Rank 0's pre-load check: ``trainer_state.json`` and the DCP ``.metadata`` parse (a corrupt one makes
    ``load(root)`` fall back to an older checkpoint instead of failing mid-load). Returns the document."""
    doc = ts.read_document(ckpt)
    read_metadata_safely(ckpt / ".metadata")
    return doc


def check(ckpt_dir: str | os.PathLike) -> commit.Marker:
    """Check that ``ckpt_dir`` is a checkpoint :func:`load` can use and return its marker. Local, no
    process group.

    The checks ``load(root)`` uses to choose a checkpoint: the ``COMPLETE`` marker parses, every file it
    lists exists with exactly the recorded size (bytes) and matches its recorded SHA-256 (markers written
    before checksums were recorded have none: ``marker.checksums`` is empty and only sizes are checked);
    ``trainer_state.json`` is a valid trainer state; the DCP ``.metadata`` parses (with the safe unpickler).

    Raises:
        CorruptCheckpointError: naming the directory (incomplete) or the offending file.
    """
    ckpt_dir = Path(ckpt_dir)
    marker = commit.verify(ckpt_dir, checksums=True)
    _read_small_files(ckpt_dir)
    return marker


def _restore(ckpt: Path, marker: commit.Marker, doc: dict, live: ts.Live, strict: bool) -> dict:
    """Load one verified checkpoint into the live objects. Collective."""
    import torch.distributed.checkpoint as dcp

    distributed = _distributed()
    md = read_metadata_safely(ckpt / ".metadata")

    def fill(target: dict[str, Any]) -> None:
        try:
            with quiet_single_process():
                dcp.load(target, storage_reader=SafeFileSystemReader(ckpt), planner=SafeLoadPlanner(),
                         no_dist=not distributed)
        except (Exception, dcp.api.CheckpointException) as e:  # CheckpointException is a BaseException
            raise unwrap_checkpoint_exception(e, ckpt, "loading") from e

    def full_optimizer() -> dict:
        try:
            return _load_everything(ckpt, "optim", no_dist=not distributed)["optim"]
        except (Exception, dcp.api.CheckpointException) as e:
            raise unwrap_checkpoint_exception(e, ckpt, "loading") from e

    ts.restore_tensors(live, ts.catalogue_from_metadata(md), fill, strict=strict, where=str(ckpt), document=doc,
                       read_full_optimizer=full_optimizer)
    source = ts.rng_source(_rank(), marker.world_size)

    def _rest() -> dict:
        info = ts.restore_document(live, doc, strict=strict, where=str(ckpt))
        ts.restore_rng_file(ckpt / ts.rng_file(source))
        return info

    info = commit.run_everywhere(_rest, f"restoring the trainer state of {ckpt}")
    info["path"] = ckpt
    return info


def load(
    path_or_root: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    dataloader: Any = None,
    train_step: Any = None,
    strict: bool = True,
) -> dict:
    """Load a checkpoint written by :func:`save` into live objects. Collective.

    ``path_or_root`` is either one checkpoint directory (which must be usable) or a root, in which case
    the newest usable checkpoint under it is loaded (:func:`torchloom.checkpoint.commit.select`, the rule
    ``loom ckpt export``/``verify`` use too; rank 0 decides and every rank agrees): a checkpoint that is
    incomplete, has a file whose size or SHA-256 differs from its ``COMPLETE`` marker, a corrupt
    ``trainer_state.json``/``.metadata``, or a file found corrupt while loading, is skipped with a logged
    warning naming the file, and the next older one is loaded.
    The world size and wrapping may differ from the saving job (DCP reshards). RNG: rank ``r`` restores
    the state saved by rank ``r % saved_world_size``. ``train_step`` gets its counters and loss-scaler
    state back (its accumulation may differ from the saving run's). The optimizer gets exactly the saved
    state: frozen parameters keep theirs, parameters saved without state have none.

    A trainable-only checkpoint (``save(..., trainable_only=True)``, recorded in its document) loads on
    top of the base model already in ``model``: frozen parameters are left as they are. ``strict=True``
    raises if the model's trainable parameters are not exactly the saved ones, or if its frozen base
    differs from the saving run's (names, shapes, dtypes, value sums); ``strict=False`` warns and loads
    the overlap (:mod:`torchloom.checkpoint.trainable`).

    Returns:
        ``{"step": int, "extra": dict, "scaler_state": dict | None, "path": Path}``

    Raises:
        CheckpointError: the directory is unusable (:class:`CorruptCheckpointError`, naming the file),
            the root holds no usable checkpoint, or (``strict=True``) the checkpoint does not match the
            model/optimizer/scheduler/dataloader.
    """
    live = ts.Live(model, optimizer, lr_scheduler, dataloader, train_step)

    def attempt(ckpt: Path) -> dict:
        marker, doc = commit.verify_everywhere(ckpt, read=_read_small_files)
        return _restore(ckpt, marker, doc, live, strict)

    _path, info = commit.select(path_or_root, attempt, collective=True)
    return info


# ------------------------------------------------------------------------------------ safetensors
def _dedupe_tied(sd: dict[str, torch.Tensor], groups: list[list[str]],
                 where: str = "the state dict") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep one copy per tied group (its first name present); return (tensors, {alias: owner}).

    Raises:
        CheckpointError: two names of one tied group hold different values (naming both keys).
    """
    tensors = dict(sd)
    tied: dict[str, str] = {}
    for group in groups:
        present = [n for n in group if n in tensors]
        check_tied_values(tensors, present, where)
        for alias in present[1:]:
            tied[alias] = present[0]
            del tensors[alias]
    # safetensors refuses tensors that share memory; give any remaining sharers their own copy.
    seen: set[int] = set()
    for k, v in list(tensors.items()):
        v = v.detach().cpu().contiguous()
        if v.numel():
            ptr = v.untyped_storage().data_ptr()
            if ptr in seen:
                v = v.clone()
                ptr = v.untyped_storage().data_ptr()
            seen.add(ptr)
        tensors[k] = v
    return tensors, tied


def _write_safetensors(tensors: dict[str, torch.Tensor], tied: dict[str, str], path: Path) -> Path:
    from safetensors.torch import save_file

    if not tensors:
        raise CheckpointError(f"nothing to export to {path}: the model has no tensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.part")
    metadata = {"format": "pt"}
    if tied:
        metadata[_TIED_META] = json.dumps(tied, sort_keys=True)
    try:
        save_file(tensors, str(part), metadata=metadata)
        os.chmod(part, 0o644)  # an exported model is meant to be shared (the temp name got 0600)
        commit.fsync_file(part)
        os.replace(part, path)
        commit.fsync_dir(path.parent)
    finally:
        if part.exists():
            part.unlink()
    return path


def export_safetensors(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write the model's full (unsharded) weights as one ``safetensors`` file. Collective.

    Rank 0 gathers the full state dict (``full_state_dict=True, cpu_offload=True``) and writes it; keys
    are the plain model's (no ``module.``/``_orig_mod.``/``_checkpoint_wrapped_module.``). Tied weights
    are stored once (the first registered name, e.g. ``model.embed_tokens.weight`` of a Llama with tied
    embeddings, as Hugging Face does) and recorded in the file's metadata for :func:`load_safetensors`.
    Returns ``path`` on every rank.

    A pipelined model (``PipelinedModel``: each rank holds only its stages) is gathered from every stage:
    each rank takes the full values of its own parameters (tensor-parallel/FSDP shards gathered), and the
    lowest rank holding a name sends it to rank 0, so the file holds the whole model.
    """
    path = Path(path)
    sd = gather_full_state(model)
    groups = tied_groups(model)

    def _write() -> str:
        tensors, tied = _dedupe_tied(sd, groups)
        return str(_write_safetensors(tensors, tied, path))

    return Path(commit.broadcast_from_rank0(_write))


def gather_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's full (unsharded) CPU state dict on rank 0 (``{}`` on other ranks). Collective.

    Works for every wrapping torchloom produces: plain, DDP, FSDP2 (``fully_shard``: fsdp/zero2/zero3/hsdp),
    tensor-parallel DTensors, ``torch.compile`` and activation-checkpoint wrappers (keys are the plain
    model's: no ``module.``/``_orig_mod.``/``_checkpoint_wrapped_module.``), and a pipelined model
    (``PipelinedModel``: gathered from every stage). Tied names are all present (one entry each). Shared by
    :func:`export_safetensors` and :func:`torchloom.hf.save_pretrained`.
    """
    return _pipelined_full_state(model) if _is_pipelined(model) else full_model_state(model)


def _is_pipelined(model: nn.Module) -> bool:
    from torchloom.parallel.pipeline.model import PipelinedModel

    return isinstance(model, PipelinedModel) and _distributed()


def _pipelined_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's full CPU state dict on rank 0 ({} elsewhere), gathered from every pipeline stage.

    Collective. Every rank holds full copies of its stages only (a few times the stage size in memory);
    one rank per name sends it, chosen from an exchange of the key lists.
    """
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    comps = wrapper_components(model)
    local = {canonical_key(k, comps): v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, sorted(local))
    sender = {}
    for r, names in reversed(list(enumerate(keys))):  # the lowest rank holding a name wins
        sender.update(dict.fromkeys(names, r))
    rank = dist.get_rank()
    mine = {k: v.detach().cpu() for k, v in local.items() if sender[k] == rank}
    parts: list[Any] = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if rank == 0 else {}


def load_safetensors(model: nn.Module, path: str | os.PathLike, strict: bool = True):
    """Load a file written by :func:`export_safetensors`/:func:`export_from_dcp` into ``model``.

    Made for a plain (non-distributed) model; wrappers (DDP, ``torch.compile``, activation checkpointing)
    are fine, and a model with DTensor (FSDP2) parameters is loaded through ``set_model_state_dict``
    (every rank reads the file). Tied weights are filled from their stored copy, so ``strict=True``
    passes and ties hold. Reading uses ``safetensors`` (no pickle).

    Returns:
        ``model.load_state_dict``'s result (missing/unexpected keys, empty when strict).

    Raises:
        CheckpointError: the file is missing/corrupt, or ``strict`` and the keys do not match.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        sd = load_file(str(path))
        tied = json.loads(meta.get(_TIED_META, "{}"))
    except FileNotFoundError as e:
        raise CheckpointError(f"safetensors file {path} is missing") from e
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"safetensors file {path} is corrupt: {type(e).__name__}: {e}") from e
    for group in tied_groups(model):  # two different values for one tied parameter: refuse, never pick
        check_tied_values(sd, [n for n in group if n in sd], f"safetensors file {path}")
    for alias, owner in tied.items():
        if owner in sd and alias not in sd:
            sd[alias] = sd[owner]
    for group in tied_groups(model):  # files without our metadata (e.g. Hugging Face's) tie the same way
        present = [n for n in group if n in sd]
        for n in group:
            if present and n not in sd:
                sd[n] = sd[present[0]]

    is_dtensor = any(type(p).__name__ == "DTensor" for p in model.parameters())
    try:
        if is_dtensor:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            return set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, strict=strict))
        comps = wrapper_components(model)
        actual = {canonical_key(k, comps): k for k in model.state_dict()}
        return model.load_state_dict({actual.get(k, k): v for k, v in sd.items()}, strict=strict)
    except RuntimeError as e:
        raise CheckpointError(f"cannot load safetensors file {path} into {type(model).__name__}: {e}") from e


def export_from_dcp(checkpoint_dir: str | os.PathLike, out_path: str | os.PathLike, *,
                    require_marker: bool = True) -> Path:
    """Convert a DCP checkpoint into one consolidated ``safetensors`` file, offline (no process group).

    ``checkpoint_dir`` is a checkpoint directory or a root (its newest complete checkpoint is used). It
    must be complete (valid ``COMPLETE`` marker) unless ``require_marker=False``, which also accepts a bare
    DCP directory from another tool. Tied weights recorded at save time are stored once, as in
    :func:`export_safetensors`. Reads with the safe DCP reader; needs memory for the whole model.

    Raises:
        CheckpointError: no usable checkpoint, or a trainable-only one of a model with frozen parameters
            (it holds no base model).
    """
    src = Path(checkpoint_dir)
    if not require_marker and (src / ".metadata").exists() and not (src / commit.MARKER).exists():
        tensors = read_model_tensors(src)  # a bare DCP directory of another tool
    else:
        # the checkpoint a resume would load (commit.select): corrupt ones are skipped, naming the file
        src, tensors = commit.select(src, lambda c: (check(c), read_model_tensors(c))[1])
    groups: list[list[str]] = []
    if (src / TRAINER_STATE).exists():
        doc = ts.read_document(src)
        groups = doc.get("tied_params") or []
        partial = doc.get("trainable_only")
        if partial and (partial.get("frozen") or {}).get("count"):  # adapters and buffers, not a model
            raise CheckpointError(
                f"checkpoint {src} is trainable-only: it holds the {len(partial['params'])} trainable "
                f"parameters and the buffers, not the {partial['frozen']['count']} frozen ones of the base, so "
                f"no model file can be written from it. Load it onto the base model (torchloom.checkpoint.load) "
                f"and export the live model (torchloom.hf.save_pretrained or torchloom.checkpoint.export_safetensors)")
    tensors, tied = _dedupe_tied(tensors, groups, f"checkpoint {src}")
    return _write_safetensors(tensors, tied, Path(out_path))


__all__ = ["CorruptCheckpointError", "check", "check_tied_values", "export_from_dcp", "export_safetensors",
           "gather_full_state", "load", "load_safetensors", "save"]

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

from torchloom.checkpoint.state import (
    canonical_key,
    clear_optimizer_state,
    capture_rng,
    dcp_state,
    from_json,
    full_model_state,
    is_zero_optimizer,
    load_dcp_state,
    optimizer_state_is_empty,
    quiet_single_process,
    read_metadata_safely,
    read_model_tensors,
    restore_rng,
    short_error,
    tied_groups,
    to_json,
    unwrap_checkpoint_exception,
    wrapper_components,
)
from torchloom.errors import CheckpointError
from torchloom.utils import distributed as _distributed
from torchloom.utils import rank as _rank
from torchloom.utils import world_size as _world

TRAINER_STATE = "trainer_state.json"
TRAINER_STATE_FORMAT = "torchloom.checkpoint.trainer_state/1"
RNG_DIR = "rng"
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
) -> Path:
    """Save a training state as ``<root>/step_{step:08d}/`` and return that path (on every rank).

    Collective: call on every rank with the same ``root`` and ``step``.

    Args:
        root: checkpoint root directory (shared by all ranks).
        step: the training step (non-negative int); names the directory.
        model: the (possibly DDP/FSDP2/compiled/activation-checkpointed) model.
        optimizer: its optimizer (``torch.optim.Optimizer``, a list of them, or a
            ``ZeroRedundancyOptimizer``), or ``None``.
        lr_scheduler: anything with ``state_dict()``/``load_state_dict()`` returning plain data.
        dataloader: a dataloader or sampler with ``state_dict()``/``load_state_dict()`` (plain data).
            Saved once if every rank's state is equal, else per rank.
        extra: user data (JSON-like: dicts, lists, str, int, float, bool, None, small tensors).
        scaler_state: a loss scaler's ``state_dict()`` (plain data).
        train_step: the :class:`~torchloom.TrainStep` of ``auto_accelerate``: its step counters and fp16
            loss-scaler state are saved (so ``scaler_state`` is not needed with it).
        keep_last: keep only this many newest complete checkpoints under ``root`` (deleted only after
            this one is committed; the newest complete checkpoint is never deleted). ``None`` keeps all.

    Raises:
        CheckpointError: on every rank, if any rank failed (nothing is committed then).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    root = Path(root)
    commit.step_dirname(step)
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise CheckpointError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
    rank, world = _rank(), _world()

    # Encode the small state first: a value JSON cannot hold fails here, before anything is written.
    def _encode() -> dict[str, Any]:
        return {
            "lr_scheduler": to_json(lr_scheduler.state_dict(), "lr_scheduler.state_dict()") if lr_scheduler is not None else None,
            "dataloader": to_json(dataloader.state_dict(), "dataloader.state_dict()") if dataloader is not None else None,
            "scaler_state": to_json(scaler_state, "scaler_state") if scaler_state is not None else None,
            "train_step": to_json(train_step.state_dict(), "train_step.state_dict()") if train_step is not None else None,
            "extra": to_json(dict(extra or {}), "extra"),
        }

    enc = commit.run_everywhere(_encode, "encoding the trainer state")
    dl_states = [enc["dataloader"]]
    if dataloader is not None and world > 1:
        dl_states = [None] * world
        dist.all_gather_object(dl_states, enc["dataloader"])

    # get_state_dict() initialises an empty optimizer state by running a zero-lr step (a DSD quirk): undo
    # that after saving, so that saving before the first step does not change training.
    zero = optimizer is not None and is_zero_optimizer(optimizer)
    opt_empty = optimizer is not None and not zero and optimizer_state_is_empty(optimizer)
    tmp = commit.begin_save(root, step)
    try:
        state = dcp_state(model, optimizer)
        with quiet_single_process():
            dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=not _distributed())
    except (Exception, dcp.api.CheckpointException) as e:  # CheckpointException is a BaseException
        raise unwrap_checkpoint_exception(e, tmp, "saving") from e
    finally:
        if opt_empty:
            clear_optimizer_state(optimizer)
    if zero and rank == 0:  # ZeRO keeps its state in per-rank local optimizers; rank 0 now holds it all
        opt_empty = not state.get("optim", {}).get("state")
    del state

    def _write_rng() -> None:
        d = tmp / RNG_DIR
        d.mkdir(exist_ok=True)
        p = d / f"rank{rank}.pt"
        torch.save(capture_rng(), p)
        commit.fsync_file(p)

    commit.run_everywhere(_write_rng, "writing the RNG state")

    opt_kind = None if optimizer is None else ("zero" if zero else "dsd")
    trainer_state = {
        "format": TRAINER_STATE_FORMAT,
        "step": step,
        "world_size": world,
        "torch_version": torch.__version__,
        "optimizer": opt_kind,
        "optimizer_state_empty": opt_empty,
        "lr_scheduler": enc["lr_scheduler"],
        "scaler_state": enc["scaler_state"],
        "train_step": enc["train_step"],
        "extra": enc["extra"],
        "tied_params": tied_groups(model),
    }
    if dataloader is None:
        trainer_state["dataloader"] = None
    elif all(s == dl_states[0] for s in dl_states):
        trainer_state["dataloader"] = dl_states[0]
    else:
        trainer_state["dataloader"] = None
        trainer_state["dataloader_per_rank"] = dl_states

    def _rank0_write(d: Path) -> None:
        commit.write_file_durably(d / TRAINER_STATE, json.dumps(trainer_state, indent=1, allow_nan=False))

    return commit.finish_save(tmp, root, step=step, rank0_write=_rank0_write, keep_last=keep_last)


# ------------------------------------------------------------------------------------------- load
def _read_trainer_state_text(ckpt: Path) -> str:
    path = ckpt / TRAINER_STATE
    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint file {path} is missing") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {e}") from e
    if not isinstance(raw, dict) or raw.get("format") != TRAINER_STATE_FORMAT or not isinstance(raw.get("step"), int):
        raise CheckpointError(f"checkpoint file {path} is corrupt: not a {TRAINER_STATE_FORMAT} document")
    return text


def _read_small_files(ckpt: Path) -> str:
    """Rank 0's pre-load check: ``trainer_state.json`` and the DCP ``.metadata`` parse (a corrupt one makes
    ``load(root)`` fall back to an older checkpoint instead of failing mid-load). Returns the trainer state."""
    text = _read_trainer_state_text(ckpt)
    read_metadata_safely(ckpt / ".metadata")
    return text


def check(ckpt_dir: str | os.PathLike) -> commit.Marker:
    """Check that ``ckpt_dir`` is a checkpoint :func:`load` can use and return its marker. Local, no
    process group.

    Runs the checks ``load(root)`` uses to choose a checkpoint: the ``COMPLETE`` marker parses and every
    file it lists exists with exactly the recorded size (bytes); ``trainer_state.json`` is a valid trainer
    state; the DCP ``.metadata`` parses (with the safe unpickler). Tensor data is not read (a bit flip that
    keeps a file's size is not detected).

    Raises:
        CheckpointError: naming the directory (incomplete) or the offending file.
    """
    ckpt_dir = Path(ckpt_dir)
    marker = commit.verify(ckpt_dir)
    _read_small_files(ckpt_dir)
    return marker


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

    ``path_or_root`` is either one checkpoint directory (which must be complete) or a root, in which case
    the newest complete checkpoint under it is loaded (rank 0 decides and broadcasts, so all ranks agree);
    a complete checkpoint whose ``trainer_state.json`` or DCP ``.metadata`` is corrupt is skipped with a
    logged warning naming the file, and the next older one is loaded.
    The world size and wrapping may differ from the saving job (DCP reshards). RNG: rank ``r`` restores
    the state saved by rank ``r % saved_world_size``. ``train_step`` gets its counters and loss-scaler
    state back (its accumulation may differ from the saving run's).

    Returns:
        ``{"step": int, "extra": dict, "scaler_state": dict | None, "path": Path}``

    Raises:
        CheckpointError: the directory is incomplete (no valid ``COMPLETE`` marker), a file is missing,
            truncated or corrupt (the message names it), the root holds no complete checkpoint, or
            (``strict=True``) the checkpoint does not match the model/optimizer/scheduler/dataloader.
    """
    ckpt, marker, text = commit.agree_on_checkpoint(path_or_root, read=_read_small_files)
    ts_path = ckpt / TRAINER_STATE
    try:
        ts = from_json(json.loads(text))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint file {ts_path} is corrupt: {e}") from e

    load_dcp_state(ckpt, model, optimizer, strict=strict, optimizer_state_empty=bool(ts.get("optimizer_state_empty")))
    rank = _rank()

    def _restore_rest() -> None:
        if lr_scheduler is not None:
            if ts.get("lr_scheduler") is not None:
                lr_scheduler.load_state_dict(ts["lr_scheduler"])
            elif strict:
                raise CheckpointError(f"checkpoint {ckpt} has no lr_scheduler state (pass lr_scheduler=None or strict=False)")
        if train_step is not None:
            if ts.get("train_step") is not None:
                train_step.load_state_dict(ts["train_step"])
            elif strict:
                raise CheckpointError(f"checkpoint {ckpt} has no train_step state (pass train_step=None or strict=False)")
        if dataloader is not None:
            state = ts.get("dataloader")
            per_rank = ts.get("dataloader_per_rank")
            if state is None and per_rank:
                state = per_rank[rank % len(per_rank)]
            if state is not None:
                dataloader.load_state_dict(state)
            elif strict:
                raise CheckpointError(f"checkpoint {ckpt} has no dataloader state (pass dataloader=None or strict=False)")
        rng_path = ckpt / RNG_DIR / f"rank{rank % max(marker.world_size, 1)}.pt"
        try:
            rng = torch.load(rng_path, weights_only=True, map_location="cpu")
        except FileNotFoundError as e:
            raise CheckpointError(f"checkpoint file {rng_path} is missing") from e
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint file {rng_path} is corrupt: {type(e).__name__}: {short_error(e)}") from e
        try:
            restore_rng(rng)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint file {rng_path} holds an invalid RNG state: {type(e).__name__}: {e}") from e

    commit.run_everywhere(_restore_rest, f"restoring the trainer state of {ckpt}")
    return {
        "step": int(ts["step"]),
        "extra": ts.get("extra") or {},
        "scaler_state": ts.get("scaler_state"),
        "path": ckpt,
    }


# ------------------------------------------------------------------------------------ safetensors
def _dedupe_tied(sd: dict[str, torch.Tensor], groups: list[list[str]]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep one copy per tied group (its first name present); return (tensors, {alias: owner})."""
    tensors = dict(sd)
    tied: dict[str, str] = {}
    for group in groups:
        present = [n for n in group if n in tensors]
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
    sd = _pipelined_full_state(model) if _is_pipelined(model) else full_model_state(model)
    groups = tied_groups(model)

    def _write() -> str:
        tensors, tied = _dedupe_tied(sd, groups)
        return str(_write_safetensors(tensors, tied, path))

    return Path(commit.broadcast_from_rank0(_write))


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
    """
    src = Path(checkpoint_dir)
    if require_marker or not (src / ".metadata").exists():
        src = commit.resolve(src)
    tensors = read_model_tensors(src)
    groups: list[list[str]] = []
    ts_path = src / TRAINER_STATE
    if ts_path.exists():
        groups = json.loads(_read_trainer_state_text(src)).get("tied_params") or []
    tensors, tied = _dedupe_tied(tensors, groups)
    return _write_safetensors(tensors, tied, Path(out_path))


__all__ = ["export_from_dcp", "export_safetensors", "load", "load_safetensors", "save"]

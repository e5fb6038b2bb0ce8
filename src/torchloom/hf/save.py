"""``torchloom.hf.save_pretrained``: a model trained with any torchloom strategy, written as Hugging Face's
``save_pretrained`` writes the plain model, so ``from_pretrained`` (or ``PeftModel.from_pretrained``) loads it.

How: every rank takes part in gathering the full weights (:func:`torchloom.checkpoint.api.gather_full_state`,
the export's gathering); rank 0 rebuilds the plain Hugging Face class on the meta device, puts the gathered
CPU tensors in (``load_state_dict(assign=True)``, strict: a name that differs from the plain model's is an
error here, not a file that loads with random weights), lets that clean copy's own ``save_pretrained`` write
into a staging directory, then publishes the files (:func:`_publish`). Before anything is gathered, a folder
holding another model is refused (:mod:`torchloom.hf.save_target`). See docs/hf.md.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchloom.checkpoint import commit
from torchloom.checkpoint.api import gather_full_state
from torchloom.checkpoint.state import tied_groups
from torchloom.checkpoint.trainer_state import check_tied_values
from torchloom.errors import CheckpointError
from torchloom.hf import peft_io, save_target

# wrappers torchloom puts around the root (attribute holding the wrapped module)
_ROOT_WRAPPERS = {"DistributedDataParallel": "module", "OptimizedModule": "_orig_mod"}
# what from_pretrained reads first: removed first and written last, so a crash never leaves them beside
# partly replaced weights
_MARKERS = ("config.json", "adapter_config.json")
_SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # as huggingface_hub parses them


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, tokenizer: Any = None,
                    max_shard_size: int | str = "5GB", safe_serialization: bool = True,
                    merge: bool = False, overwrite: bool = False) -> Path:
    """Save ``model`` in Hugging Face format into ``save_directory``. Collective: call on every rank.

    ``model`` is what ``auto_accelerate`` returned (``res.model``) or any module it wraps: plain, DDP, FSDP2
    (fsdp/zero2/zero3/hsdp), tensor parallel (DTensor), pipelined (``PipelinedModel``), compiled or
    activation-checkpointed, around a ``transformers.PreTrainedModel`` or a ``peft.PeftModel``. The full
    weights are gathered to rank 0's CPU memory (the whole model must fit there), and rank 0 writes what the
    plain model's own ``save_pretrained`` writes:

    * a model: ``config.json`` (``model_type``, ``architectures``, ``dtype``), ``generation_config.json``
      when the model can generate, and safetensors weights (metadata ``{"format": "pt"}``):
      ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``
      (``metadata.total_size`` in bytes, ``weight_map``) when they exceed ``max_shard_size``. Keys are the
      plain model's; tied weights are stored once, under the name Hugging Face keeps (e.g.
      ``model.embed_tokens.weight``; ``lm_head.weight`` is re-tied on load), and weights stay in their
      training dtype.
    * a ``PeftModel``: ``adapter_model.safetensors`` and ``adapter_config.json`` with peft's own names
      (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; other adapters than ``default``
      in sub-directories named after them), plus peft's ``README.md`` model card. With ``merge=True``: the
      base model with the active adapter merged in by peft (``W + scale * B @ A``), written as a model
      (above), on a CPU copy (the training model is not changed).
    * ``tokenizer.save_pretrained(save_directory)`` when ``tokenizer`` is given (a tokenizer or processor).

    Writing is atomic for a reader: files are written into a staging directory next to ``save_directory``
    and moved in; a new directory appears at once (rename), and in an existing one ``config.json`` /
    ``adapter_config.json`` are removed first and put back last, so an interrupted save never leaves a
    directory ``from_pretrained`` would load.

    An existing folder may hold an earlier save of the same model: a full model whose ``config.json`` has the
    same ``model_type``, lists this class among its ``architectures`` and agrees on every model-defining field
    (sizes, layers, heads, vocabulary, ...: all but the dtype, transformers version, generation settings,
    runtime switches such as ``use_cache``, dropout rates and initialisation ranges), or a peft adapter with the
    same ``peft_type``, base class, base model (where both name one) and adapter fields (``r``, ``lora_alpha``,
    ``target_modules``, ``modules_to_save``, ``task_type``, ...); see :mod:`torchloom.hf.save_target`. Its weight
    files that this save does not rewrite (e.g. shards of a smaller ``max_shard_size``) are deleted, so old and
    new weights never mix. A folder holding anything else (another ``model_type``, class or architecture,
    another adapter, a ``config.json`` no Hugging Face save wrote, a full model where the adapter goes or the
    reverse) is refused, naming the differing fields, unless ``overwrite=True``. Files no Hugging Face or peft
    save writes are never deleted (an existing ``README.md`` is not overwritten either).

    Args:
        model: the (wrapped) model, on every rank.
        save_directory: the output directory (created); the same path on every rank.
        tokenizer: anything with ``save_pretrained(dir)``, or None.
        max_shard_size: largest shard in bytes: an int, or a string of digits and a unit TB/GB/MB/KB
            (powers of 10, as huggingface_hub parses them: ``"5GB"``, ``"500MB"``). A single tensor larger
            than that gets a shard of its own.
        safe_serialization: must be True. Pickle-based ``pytorch_model.bin`` files are not written: loading
            one can run arbitrary code, and transformers 5 no longer writes them either.
        merge: for a ``PeftModel`` only: write the merged base model instead of the adapter.
        overwrite: replace another model found in the folder: its config, generation config, weights, index,
            adapter and tokenizer files are deleted (the rest of the folder stays). Not needed to re-save the
            same model.

    Returns:
        ``Path(save_directory)`` on every rank.

    Raises:
        ValueError: ``safe_serialization=False``, a bad ``max_shard_size``, ``merge=True`` without a
            ``PeftModel``, a ``merge``/``overwrite`` that is not a bool (every rank, before anything is gathered).
        TypeError: ``model`` does not hold a Hugging Face model (no ``config``), or ``tokenizer`` has no
            ``save_pretrained`` (every rank, before anything is gathered).
        NotImplementedError: a ``PeftModel`` under pipeline parallelism.
        CheckpointError: on every rank: ``save_directory`` holds another model and ``overwrite`` is False, or
            is not a directory (before anything is gathered; naming what is there, how it differs and
            ``overwrite=True``);
            writing failed on rank 0; the gathered names do not match the plain model's (naming them); two
            tied names hold different values.
    """
    dest = Path(save_directory)
    _check_options(max_shard_size, safe_serialization, merge, tokenizer, overwrite)
    src = _source(model)
    if merge and src.peft is None:
        raise ValueError("merge=True merges a peft adapter into its base model, but the model is not a "
                         f"peft.PeftModel ({src.cls.__name__}); drop merge=True")
    plan = save_target.planned(src, merge)
    # rank 0 looks (the folder may be on its disk only); every rank raises before the collective gathering
    replacing = commit.broadcast_from_rank0(lambda: save_target.check(dest, plan, overwrite, tokenizer is not None))
    sd = gather_full_state(model)  # rank 0 holds everything, the others {}

    def _write() -> str:
        if dest.exists() and not dest.is_dir():
            raise CheckpointError(f"save_pretrained: {dest} exists and is not a directory")
        dest.parent.mkdir(parents=True, exist_ok=True)
        for stale in dest.parent.glob(f".{dest.name}.torchloom-tmp-*"):  # left by a save that was killed
            shutil.rmtree(stale, ignore_errors=True)
        staged = dest.parent / f".{dest.name}.torchloom-tmp-{uuid.uuid4().hex[:8]}"
        staged.mkdir()
        try:
            _write_into(staged, src, sd, max_shard_size, merge)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(staged))
            _publish(staged, dest, replacing)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        return str(dest)

    return Path(commit.broadcast_from_rank0(_write))


# -------------------------------------------------------------------------------------- what it is
@dataclass
class _Source:
    """What to rebuild on rank 0: the plain Hugging Face class, its configs, and the live PeftModel (if any)."""

    cls: type
    config: Any
    generation_config: Any
    peft: Any = None


def unwrap(model: nn.Module) -> nn.Module:
    """The module under torchloom's root wrappers (DDP's ``module``, ``torch.compile``'s ``_orig_mod``)."""
    while (attr := _ROOT_WRAPPERS.get(type(model).__name__)) and isinstance(getattr(model, attr, None), nn.Module):
        model = getattr(model, attr)
    return model


def plain_class(module: nn.Module) -> type:
    """``module``'s class without FSDP2's dynamic subclass (``fully_shard`` turns ``LlamaForCausalLM``
    into ``FSDPLlamaForCausalLM``)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule)) if issubclass(cls, FSDPModule) else cls


def _source(model: nn.Module) -> _Source:
    from transformers import PreTrainedModel

    from torchloom.parallel.pipeline.model import PipelinedModel

    if isinstance(model, PipelinedModel):
        cls = model.root_type
        if peft_io.is_peft_class(cls):
            raise NotImplementedError("save_pretrained of a peft.PeftModel under pipeline_parallel is not "
                                      "supported; train LoRA with fsdp/ddp/tensor_parallel")
        src = _Source(cls, model.config, model.generation_config)
    else:
        live = unwrap(model)
        peft = live if peft_io.is_peft_model(live) else None
        hf = live.get_base_model() if peft is not None else live
        src = _Source(plain_class(hf), getattr(hf, "config", None), getattr(hf, "generation_config", None), peft)
    if not issubclass(src.cls, PreTrainedModel) or src.config is None:
        raise TypeError(f"torchloom.hf.save_pretrained saves Hugging Face models (transformers.PreTrainedModel, "
                        f"or a peft.PeftModel around one); got {src.cls.__name__}. For any module, "
                        f"torchloom.checkpoint.export_safetensors writes its weights.")
    return src


def _check_options(max_shard_size: Any, safe_serialization: Any, merge: Any, tokenizer: Any, overwrite: Any) -> None:
    if safe_serialization is not True:
        raise ValueError("safe_serialization=False (pickle-based pytorch_model.bin) is not supported: loading a "
                         "pickle can run arbitrary code, and transformers 5 writes only safetensors. Use the "
                         "default safe_serialization=True.")
    shard_size_bytes(max_shard_size)
    if not isinstance(merge, bool):
        raise ValueError(f"merge must be True or False, got {merge!r}")
    if not isinstance(overwrite, bool):
        raise ValueError(f"overwrite must be True or False, got {overwrite!r}")
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"tokenizer must have save_pretrained(dir) (a transformers tokenizer or processor), got "
                        f"{type(tokenizer).__name__}; a tokenizers.Tokenizer can be wrapped in "
                        f"transformers.PreTrainedTokenizerFast(tokenizer_object=...)")


def shard_size_bytes(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int > 0, or digits and a unit TB/GB/MB/KB (powers of 10).

    Raises:
        ValueError: anything else (e.g. ``"5GiB"``, ``0``, ``True``).
    """
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        text = size.strip()
        digits, unit = text[:-2].strip(), text[-2:].upper()
        if unit in _SIZE_UNITS and re.fullmatch(r"\d+(\.\d+)?", digits) and float(digits) > 0:
            return int(float(digits) * _SIZE_UNITS[unit])
    raise ValueError(f"max_shard_size must be a positive int (bytes) or a size such as '5GB' or '500MB' (units "
                     f"TB, GB, MB, KB, powers of 10), got {size!r}")


# ------------------------------------------------------------------------------------- the clean copy
def rebuild(cls: type, config: Any, generation_config: Any = None) -> nn.Module:
    """An instance of the plain class ``cls`` on the meta device (no memory), with copies of the configs."""
    with torch.device("meta"):
        model = cls(copy.deepcopy(config))
    if generation_config is not None and hasattr(model, "generation_config"):
        model.generation_config = copy.deepcopy(generation_config)
    return model


def fill(model: nn.Module, sd: dict[str, torch.Tensor], where: str) -> nn.Module:
    """Put the gathered tensors into the meta ``model`` (``assign=True``: they become its parameters, no
    copy) and re-tie its tied weights.

    Raises:
        CheckpointError: names that differ from ``model``'s (both lists), or tied names with different values.
    """
    sd = dict(sd)
    for group in tied_groups(model):  # the model's own ties decide, not the training wrapper's
        present = [n for n in group if n in sd]
        check_tied_values(sd, present, where)
        for n in group:
            if present and n not in sd:
                sd[n] = sd[present[0]]
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise CheckpointError(f"{where}: the gathered weights do not match {type(model).__name__}'s names "
                              f"(missing {missing[:8]}{'...' if len(missing) > 8 else ''}, unexpected "
                              f"{unexpected[:8]}{'...' if len(unexpected) > 8 else ''}); nothing was written")
    model.load_state_dict(sd, strict=True, assign=True)
    base = model.get_base_model() if peft_io.is_peft_model(model) else model
    if hasattr(base, "tie_weights"):
        base.tie_weights()  # assign=True gave each tied name its own Parameter
    return model


@contextlib.contextmanager
def no_progress_bars():
    """Hugging Face's tqdm bars off inside (restored after): job logs are pipes, not terminals."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _write_into(staged: Path, src: _Source, sd: dict[str, torch.Tensor], max_shard_size: int | str,
                merge: bool) -> None:
    """Rank 0: rebuild, fill and let the clean copy's own ``save_pretrained`` write into ``staged``."""
    with no_progress_bars():
        _write_clean_copy(staged, src, sd, max_shard_size, merge)


def _write_clean_copy(staged: Path, src: _Source, sd: dict[str, torch.Tensor], max_shard_size: int | str,
                      merge: bool) -> None:
    where = "torchloom.hf.save_pretrained"
    if src.peft is None:
        model = fill(rebuild(src.cls, src.config, src.generation_config), sd, where)
        model.save_pretrained(str(staged), max_shard_size=max_shard_size)
        return
    if merge:  # peft merges in place: never into tensors that may be the live ones (DDP / one process)
        sd = {k: v.clone() for k, v in sd.items()}
    base = rebuild(src.cls, src.config, src.generation_config)
    clone = fill(peft_io.rebuild(src.peft, base), sd, where)
    if merge:
        clone.merge_and_unload().save_pretrained(str(staged), max_shard_size=max_shard_size)
    else:
        clone.save_pretrained(str(staged), safe_serialization=True)


# ------------------------------------------------------------------------------------------ publish
def _publish(staged: Path, dest: Path, replacing: set[Path]) -> None:
    """Move the staged files into ``dest`` so that no reader ever sees a directory that looks complete but is
    not: a new ``dest`` is one rename; in an existing one, in each folder this save writes a model into, the
    marker files (``config.json``, ``adapter_config.json``) go first and the new ones come back last. The
    model files there that this save does not rewrite go too: stale shards of an earlier save of the same
    model (:func:`torchloom.hf.save_target.check` refused any other), and in the folders of ``replacing``
    (``overwrite=True``) the other model's files, its tokenizer's included. Other files stay."""
    files = sorted(p.relative_to(staged) for p in staged.rglob("*") if p.is_file())
    for f in files:
        os.chmod(staged / f, 0o644)  # a saved model is meant to be shared (safetensors writes 0600)
        commit.fsync_file(staged / f)
    commit.fsync_dirs(staged)
    if not dest.exists():
        os.rename(staged, dest)
        commit.fsync_dir(dest.parent)
        return
    markers = [f for f in files if f.name in _MARKERS]
    model_dirs = {f.parent for f in files if save_target.is_model_file(f.name)}
    for parent in (p for p in model_dirs if (dest / p).is_dir()):  # what these weights are while their config
        # is away (save_target.found reads it after an interrupted save)
        pending = {m.name: (staged / m).read_text() for m in markers if m.parent == parent}
        commit.write_file_durably(dest / parent / save_target.PENDING_FILE, json.dumps(pending))
        for m in _MARKERS:
            (dest / parent / m).unlink(missing_ok=True)
    commit.fsync_dir(dest)
    new = set(files)
    for parent in model_dirs:
        if not (dest / parent).is_dir():
            continue
        for old in (dest / parent).iterdir():
            stale = save_target.is_model_file(old.name) or (
                parent in replacing and save_target.TOKENIZER_FILE.fullmatch(old.name))
            if stale and old.is_file() and parent / old.name not in new:
                old.unlink()
    # shards before their index, the markers last
    order = sorted((f for f in files if f.name not in _MARKERS), key=lambda f: f.name.endswith(".index.json"))
    for f in [*order, *markers]:
        if f.name == "README.md" and (dest / f).exists():
            continue  # peft's generated model card does not replace the user's
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged / f, dest / f)
    commit.fsync_dirs(dest)
    for parent in model_dirs:  # the configs are back: the weights say what they are again
        (dest / parent / save_target.PENDING_FILE).unlink(missing_ok=True)
    commit.fsync_dirs(dest)


# ------------------------------------------------------------------------ module.save_pretrained route
_HF_DEFAULTS = {"push_to_hub": False, "variant": None, "token": None, "save_peft_format": True,
                "save_original_format": True, "distributed_checkpoint": False, "selected_adapters": None,
                "save_embedding_layers": "auto", "path_initial_model_for_weight_conversion": None}


def route_save_pretrained(model: nn.Module) -> bool:
    """Make ``save_pretrained`` of the Hugging Face (or peft) module inside ``model`` call
    :func:`save_pretrained` when its parameters are sharded (DTensor: FSDP2, tensor parallel), where
    Hugging Face's own method cannot read them. Returns whether it did. Unsharded models keep their own
    method (it works, also called on rank 0 only).

    The routed method is collective like :func:`save_pretrained` (call it on every rank; ``is_main_process``
    is ignored: rank 0 writes), takes ``max_shard_size``, ``safe_serialization`` and ``overwrite``, and raises
    TypeError, before gathering anything, for ``state_dict=...`` or any other argument set to a non-default value
    (``push_to_hub``, ``variant``, ``selected_adapters``, ...).
    """
    from torch.distributed.tensor import DTensor

    live = unwrap(model)
    if getattr(live, "config", None) is None or not callable(getattr(live, "save_pretrained", None)):
        return False
    if not any(isinstance(p, DTensor) for p in live.parameters()):
        return False
    live.save_pretrained = functools.partial(_routed_save_pretrained, live)  # picklable, unlike a closure
    return True


def _routed_save_pretrained(module: nn.Module, save_directory: str | os.PathLike, *, is_main_process: bool = True,
                            state_dict: Any = None, max_shard_size: int | str = "5GB",
                            safe_serialization: bool = True, overwrite: bool = False, **kwargs: Any) -> Path:
    del is_main_process  # rank 0 writes; every rank must call
    name = type(module).__name__
    given = sorted(k for k, v in kwargs.items() if k not in _HF_DEFAULTS or v != _HF_DEFAULTS[k])
    if state_dict is not None:
        given.insert(0, "state_dict")
    if given:
        raise TypeError(f"{name}.save_pretrained of a torchloom-sharded model goes through "
                        f"torchloom.hf.save_pretrained(model, dir, tokenizer=None, max_shard_size='5GB', "
                        f"merge=False, overwrite=False), which gathers the weights itself and does not take "
                        f"{given}; call torchloom.hf.save_pretrained directly (on every rank)")
    return save_pretrained(module, save_directory, max_shard_size=max_shard_size,
                           safe_serialization=safe_serialization, overwrite=overwrite)

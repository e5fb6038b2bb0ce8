"""Argument checks of :class:`torchloom.hf.TorchloomTrainer` and the choice of the checkpoint to resume.

Everything here runs before the Trainer builds its Accelerator, and in one process: a refused argument
never starts anything distributed.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterable

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

__all__ = ["CHECKPOINT_TIERS", "FLASH_DIR", "TORCHLOOM_CKPT_DIR", "TRAINER_STATE_NAME", "check_trainer_arguments",
           "newest_checkpoint", "sampling_shuffle", "stale_checkpoints", "state_committed"]

log = logging.getLogger("torchloom.hf.trainer")

TRAINER_STATE_NAME = "trainer_state.json"
CHECKPOINT_TIERS = ("disk", "flash")
TORCHLOOM_CKPT_DIR = "torchloom"  # checkpoint-N/torchloom/step_0000000N: the torchloom training state
FLASH_DIR = "torchloom_flash"  # <output_dir>/torchloom_flash/step_0000000N: the flash tier's disk copies

# TrainingArguments the TorchloomTrainer cannot honour (mostly: Accelerate or the Trainer would do what the
# strategy does), refused at construction: name -> advice
_REFUSED_ARGS = {
    "deepspeed": "DeepSpeed would wrap the model again; use torchloom_strategy (e.g. ['fsdp'] for ZeRO-3).",
    "fsdp": "Accelerate's FSDP would wrap the model again; put 'fsdp' (or 'zero2', ...) in torchloom_strategy.",
    "fsdp_config": "Accelerate's FSDP would wrap the model again; configure ('fsdp', {...}) in torchloom_strategy.",
    "parallelism_config": "use torchloom_strategy (parallel_mode, tensor_parallel, ...) for the mesh.",
    "bf16": "precision comes from the strategy: add ('amp', {'dtype': 'bfloat16'}) to torchloom_strategy.",
    "fp16": "precision comes from the strategy: add ('amp', {'dtype': 'float16'}) to torchloom_strategy.",
    "activation_checkpointing": "add 'checkpoint' to torchloom_strategy.",
    "gradient_checkpointing": "add 'checkpoint' to torchloom_strategy.",
    "torch_compile": "add 'compile' to torchloom_strategy.",
    "auto_find_batch_size": "the batch is fixed by the strategy's batch arithmetic; set per_device_train_batch_size.",
    "use_liger_kernel": "not supported with torchloom yet; patch the model before passing it.",
    "neftune_noise_alpha": "not supported with torchloom yet.",
    "label_smoothing_factor": "give torchloom_loss_func=... computing the smoothed loss.",
    "load_best_model_at_end": "not supported: checkpoint-N holds a torchloom training state, not HF weights.",
    "push_to_hub": "not supported with torchloom yet; push the save_model() directory yourself.",
    "enable_jit_checkpoint": "not supported with torchloom yet.",
    "ignore_data_skip": "torchloom's loader resumes at the exact next micro-batch without replaying any batch (there "
                        "is no skipping cost to avoid); remove it.",
    "bf16_full_eval": "evaluation runs in the strategy's precision: add ('amp', {'dtype': 'bfloat16'}) (or 'half') to "
                      "torchloom_strategy.",
    "fp16_full_eval": "evaluation runs in the strategy's precision: add ('amp', {'dtype': 'float16'}) to "
                      "torchloom_strategy.",
    "ddp_find_unused_parameters": "torchloom builds DDP itself: pass ('ddp', {'find_unused_parameters': True}) in "
                                  "torchloom_strategy.",
    "ddp_bucket_cap_mb": "torchloom builds DDP itself: pass ('ddp', {'bucket_cap_mb': ...}) in torchloom_strategy.",
    "ddp_broadcast_buffers": "torchloom builds DDP itself: pass ('ddp', {'broadcast_buffers': ...}) in "
                             "torchloom_strategy.",
    "ddp_static_graph": "torchloom builds DDP itself: pass ('ddp', {'static_graph': True}) in torchloom_strategy.",
    "batch_eval_metrics": "evaluate() calls compute_metrics once, with the predictions of the whole set (gathered in "
                          "order); set batch_eval_metrics=False.",
    "include_for_metrics": "evaluate() passes compute_metrics the predictions and label_ids only; compute from those.",
    "eval_use_gather_object": "evaluate() gathers tensors (torchloom's gather_for_metrics); return tensors from the "
                              "model and drop eval_use_gather_object.",
    "dataloader_in_order": "torchloom's loader resumes by counting the batches handed out, which needs them in order; "
                           "remove dataloader_in_order=False.",
}
_SAMPLING = {"random": True, "sequential": False}


def _off(name: str, value: Any) -> bool:
    """Whether a refused TrainingArguments field is at its harmless default."""
    if name == "deepspeed":
        return value is None
    if name == "fsdp_config":
        return not value or not any(v for k, v in dict(value).items() if k not in ("min_num_params", "xla",
                                                                                 "xla_fsdp_v2", "xla_fsdp_grad_ckpt"))
    if name == "neftune_noise_alpha":
        return value is None
    if name == "label_smoothing_factor":
        return value == 0
    if name == "dataloader_in_order":
        return bool(value)
    return not value


def check_trainer_arguments(args, kwargs: dict, strategy: Any, checkpoint: str, extra: dict | None) -> None:
    """Refuse what the TorchloomTrainer cannot honour, before the Trainer (and Accelerate) is built.

    Raises:
        ValueError / NotImplementedError: naming the argument and what to use instead (docs/hf.md).
    """
    if args is not None:
        bad = [(n, a) for n, a in _REFUSED_ARGS.items() if hasattr(args, n) and not _off(n, getattr(args, n))]
        if bad:
            raise ValueError("TorchloomTrainer: " + "; ".join(f"TrainingArguments.{n}={getattr(args, n)!r} is not "
                                                             f"supported: {a}" for n, a in bad))
        sampling_shuffle(args.train_sampling_strategy)
        if getattr(getattr(args, "accelerator_config", None), "split_batches", False):
            raise ValueError("TorchloomTrainer: TrainingArguments.accelerator_config.split_batches=True is not "
                             "supported: per_device_train_batch_size is torchloom's micro-batch per data-parallel "
                             "rank (the global batch is micro x accumulation x dp); drop split_batches.")
    if any(o is not None for o in kwargs.get("optimizers", (None, None))):
        raise ValueError("TorchloomTrainer: optimizers=(optimizer, scheduler) is not supported: torchloom builds the "
                         "optimizer after sharding the model. Pass optimizer_cls_and_kwargs=(cls, kwargs) and the "
                         "TrainingArguments' lr_scheduler_type/warmup instead.")
    if kwargs.get("model_init") is not None:
        raise ValueError("TorchloomTrainer: model_init= is not supported; pass the model.")
    if kwargs.get("compute_loss_func") is not None:
        raise NotImplementedError("TorchloomTrainer: compute_loss_func= is not supported; pass "
                                  "torchloom_loss_func=lambda batch, output: loss (auto_accelerate's loss_func).")
    if isinstance(strategy, str) and strategy == "auto":
        raise NotImplementedError(
            "TorchloomTrainer: torchloom_strategy='auto' is not supported (the search chooses its own micro-batch, "
            "the TrainingArguments fix it). Run the search once (auto_accelerate(strategy='auto') or `loom plan`) "
            "and pass the strategy it chose.")
    if checkpoint not in CHECKPOINT_TIERS:
        raise ValueError(f"TorchloomTrainer: torchloom_checkpoint must be one of {CHECKPOINT_TIERS}, got "
                         f"{checkpoint!r}.")
    owned = {"optim_func", "optim_args", "dataset", "dataloader_args", "loss_func", "strategy", "seed",
             "max_grad_norm", "lr_scheduler_cls", "lr_scheduler_args"} & set(extra or {})
    if owned:
        raise ValueError(f"TorchloomTrainer: torchloom_args {sorted(owned)} are set from the TrainingArguments "
                         "(learning_rate, optim, per_device_train_batch_size, seed, max_grad_norm, ...) or the "
                         "Trainer's own arguments; set them there.")


def _checkpoint_dirs(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(N, path)`` of every ``checkpoint-N`` directory under ``output_dir``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        tail = p.name[len(PREFIX_CHECKPOINT_DIR) + 1:]
        if tail.isdigit() and p.is_dir():
            found.append((int(tail), p))
    return sorted(found)


def state_committed(output_dir: str | os.PathLike, step: int) -> bool:
    """Whether the torchloom training state of ``checkpoint-{step}`` is committed on disk: a complete
    ``checkpoint-N/torchloom/step_N`` (disk tier) or ``<output_dir>/torchloom_flash/step_N`` (flash tier; its
    background save writes the ``COMPLETE`` marker last, see :mod:`torchloom.checkpoint.commit`)."""
    from torchloom.checkpoint import commit

    name = commit.step_dirname(step)
    root = Path(output_dir)
    return (commit.is_complete(root / f"{PREFIX_CHECKPOINT_DIR}-{step}" / TORCHLOOM_CKPT_DIR / name)
            or commit.is_complete(root / FLASH_DIR / name))


def newest_checkpoint(output_dir: str | os.PathLike, in_memory: Iterable[int] = ()) -> str | None:
    """The newest resumable ``checkpoint-N`` under ``output_dir``, or None: it has a ``trainer_state.json``
    and its torchloom state is committed (:func:`state_committed`) or, for the flash tier, held in shared
    memory by every rank (``in_memory``: those steps). A newer ``checkpoint-N`` whose flash save had not
    committed when its job (or node) died is skipped, with a warning, for the previous one."""
    memory = set(in_memory)
    skipped = []
    for step, p in reversed(_checkpoint_dirs(output_dir)):
        if not (p / TRAINER_STATE_NAME).is_file():
            continue
        if step in memory or state_committed(output_dir, step):
            if skipped:
                log.warning("resume: skipped %s (trainer_state.json written, torchloom state never committed: "
                            "the flash save did not finish); resuming from %s", ", ".join(skipped), p.name)
            return str(p)
        skipped.append(p.name)
    return None


def stale_checkpoints(output_dir: str | os.PathLike, save_total_limit: int | None,
                      best: str | os.PathLike | None = None) -> list[Path]:
    """What ``save_total_limit`` rotation deletes: ``checkpoint-N`` directories and the flash tier's
    ``torchloom_flash/step_N``. As ``transformers.trainer_utils.rotate_checkpoints`` (the newest and the best
    checkpoint are kept; at most ``save_total_limit`` in all), except that only checkpoints whose torchloom
    state is committed (:func:`state_committed`) count: one still being persisted in the background, and
    every older committed one it would replace, stays until it commits (the next save or the end of training
    rotates again). Older uncommitted ``checkpoint-N`` (torn) and flash steps with no ``checkpoint-N`` are
    deleted too. Nothing with ``save_total_limit`` None or <= 0."""
    from torchloom.checkpoint import commit

    if not save_total_limit or save_total_limit <= 0:
        return []
    ckpts = _checkpoint_dirs(output_dir)
    done = [(s, p) for s, p in ckpts if (p / TRAINER_STATE_NAME).is_file() and state_committed(output_dir, s)]
    if not done:
        return []
    newest = done[-1][0]
    best_path = Path(best).resolve() if best else None
    keep = {p for s, p in ckpts if s > newest} | {done[-1][1]}  # in flight (newer than the newest committed)
    kept_done = {done[-1][1]} | {p for _s, p in done if p.resolve() == best_path}
    for _s, p in reversed(done):
        if len(kept_done) >= save_total_limit:
            break
        kept_done.add(p)
    keep |= kept_done
    doomed = [p for _s, p in ckpts if p not in keep]
    kept_steps = {s for s, p in ckpts if p in keep}
    flash = Path(output_dir) / FLASH_DIR
    doomed += [p for s, p in commit.list_checkpoints(flash) if s not in kept_steps]
    return doomed


def sampling_shuffle(strategy: str) -> bool:
    """``train_sampling_strategy`` -> the sampler's ``shuffle``. Raises ValueError for the length-grouping ones."""
    if strategy not in _SAMPLING:
        raise ValueError(f"TorchloomTrainer: train_sampling_strategy={strategy!r} is not supported; use 'random' or "
                         "'sequential' (torchloom's sampler owns the order so that resume is exact).")
    return _SAMPLING[strategy]

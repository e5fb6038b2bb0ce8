"""``TorchloomTrainer``: ``transformers.Trainer`` with torchloom doing the distributed part.

The Trainer keeps what users rely on (``TrainingArguments``, callbacks, ``TrainerState``, logging,
``checkpoint-N`` directories, ``train(resume_from_checkpoint=...)``); torchloom builds the model, optimizer,
data loader and ``train_step`` with :func:`torchloom.auto_accelerate`, checkpoints with
:mod:`torchloom.checkpoint` and exports with :func:`torchloom.hf.save_pretrained`. Accelerate never wraps the
model, the optimizer or the loader. See docs/hf.md, "transformers.Trainer".
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints, speed_metrics

from torchloom.hf.trainer_args import (FLASH_DIR, TORCHLOOM_CKPT_DIR, TRAINER_STATE_NAME, check_trainer_arguments, log,
                                       newest_checkpoint, sampling_shuffle, stale_checkpoints)

__all__ = ["TorchloomTrainer", "TORCHLOOM_CKPT_DIR", "newest_checkpoint"]


class TorchloomTrainer(Trainer):
    """A ``transformers.Trainer`` whose model, optimizer, LR schedule, data and checkpoints are torchloom's.

    Takes every ``Trainer`` argument plus:

    Args:
        torchloom_strategy: what :func:`torchloom.auto_accelerate` takes as ``strategy``: a list of methods
            (``["fsdp", "amp", "checkpoint"]``), a :class:`~torchloom.Strategy`, a JSON/YAML file path, or None:
            the strategy of the ``loom config`` file (``$TORCHLOOM_CONFIG_FILE``, ``./torchloom.yaml``, the user
            default; docs/config.md) when there is one, else DDP when there is more than one data-parallel rank.
            Resolved once: the same strategy plans the global batch and builds the model (``[]``: plain data
            parallel, no file read). ``"auto"`` is refused (NotImplementedError): the search picks its own
            micro-batch; search once and pass the plan file or the strategy it chose.
        torchloom_loss_func: ``loss_func(batch, output)`` as for ``auto_accelerate`` (a scalar tensor or a
            :class:`~torchloom.SumLoss`). None: for a causal LM (the Trainer's ``ForCausalLMLoss`` models) the
            token-exact ``SumLoss.from_hf(output, batch["labels"])``, i.e. the mean over every valid token of the
            global batch, as the Trainer's ``num_items_in_batch`` normalisation; the labels are then held back
            from the model's forward (it would compute its own fp32 loss too; except under pipeline parallelism).
            For other models the output's ``loss`` (a mean per micro-batch). ``lambda batch, output:
            output.loss`` forces the latter.
        torchloom_checkpoint: ``"disk"`` (default): :func:`torchloom.checkpoint.save` into
            ``checkpoint-N/torchloom/`` (blocking). ``"flash"``: :class:`~torchloom.checkpoint.FlashCheckpointer`
            (the training loop blocks only for a copy into shared memory; the state is persisted in the background
            to ``<output_dir>/torchloom_flash/step_N``; ``checkpoint-N`` then holds only ``trainer_state.json``; the
            last save is committed before ``train()`` returns). A checkpoint counts (for ``resume_from_checkpoint=
            True`` and for ``save_total_limit`` rotation) once its state is committed on disk or, on the same node,
            held in shared memory by every rank: an older one is deleted only after a newer one has committed.
        torchloom_args: more keyword arguments for ``auto_accelerate`` (``prepare_input``, ``check_replicas_every``,
            ``model_input_format`` ...). The ones the TrainingArguments decide (optimizer, batch sizes, seed,
            ``max_grad_norm``, dataset) are refused here.

    What the TrainingArguments mean here:

    * Batch: ``per_device_train_batch_size`` is torchloom's micro-batch per data-parallel rank; the global batch
      (samples per optimizer step) is ``per_device_train_batch_size x gradient_accumulation_steps x dp`` with
      ``dp`` the strategy's data-parallel size (tensor/pipeline peers are not counted). ``train_step``
      accumulates (no gradient sync inside the window) and steps the optimizer every
      ``gradient_accumulation_steps`` micro-batches; the Trainer's own accumulation and Accelerate's are unused.
    * Optimizer: ``optim`` / ``optim_args`` / ``learning_rate`` / ``adam_beta1/2`` / ``adam_epsilon`` through
      ``Trainer.get_optimizer_cls_and_kwargs`` (or ``optimizer_cls_and_kwargs=``), built by ``auto_accelerate``
      after sharding, with the Trainer's two groups (``weight_decay`` on all but biases and norms); the LR
      schedule is ``Trainer.create_scheduler`` (``lr_scheduler_type``, ``warmup_*``, ``max_steps`` or
      ``num_train_epochs``), stepped by ``train_step``. ``max_grad_norm`` > 0 clips the global norm.
    * Data: ``train_dataset`` goes through the Trainer's collator (``remove_unused_columns`` included) into
      torchloom's resumable loader: seeded by ``data_seed`` (else ``seed``), shuffled unless
      ``train_sampling_strategy="sequential"``; ``dataloader_drop_last=False`` pads the last global batch with
      repeated samples (every step is a full global batch), True drops the tail.
    * Checkpoints (``save_strategy``/``save_steps``/``save_total_limit``): ``checkpoint-N/`` holds the torchloom
      state (model, optimizer, scheduler, data position, RNG, train_step counters) and the Trainer's
      ``trainer_state.json``; ``train(resume_from_checkpoint=True | path)`` continues at exactly the next
      micro-batch. ``True`` picks the newest ``checkpoint-N`` that has a ``trainer_state.json`` and a committed
      torchloom state (:func:`~torchloom.hf.trainer_args.newest_checkpoint`). A resume keeps the checkpoint's
      global batch: on another number of data-parallel ranks (or another ``per_device_train_batch_size``)
      ``gradient_accumulation_steps`` is re-derived, with a warning (ValueError before any step when the sizes
      cannot make it). A ``PeftModel``'s checkpoints hold its trainable parameters only (the adapter; the frozen
      base is checked by fingerprint on resume). ``save_total_limit`` keeps the
      newest and the best (``save_strategy="best"``) committed checkpoints, the flash tier's step directories
      with their ``checkpoint-N``. ``save_only_model=True`` writes ``save_model`` output instead (no resume, as
      in the Trainer).
    * ``save_model(dir)``: :func:`torchloom.hf.save_pretrained` (full weights gathered from any strategy,
      ``from_pretrained``-loadable; a ``PeftModel``'s adapter), for any other module its state dict as
      ``model.safetensors``, plus ``training_args.bin``. Collective: call it on every rank.
    * ``evaluate()`` / ``predict()``: every sample of the set exactly once (:func:`torchloom.data.eval_loader`):
      the loss (the mean of the per-batch losses weighted by their sample count, as the Trainer's
      ``eval_loss``) and, for ``compute_metrics`` / ``predict``, the predictions and labels gathered in dataset
      order (``gather_for_metrics``).
    * Logged ``loss``: as the Trainer's: per optimizer step the window's loss over all its items (tokens for the
      default causal-LM loss, its ``num_items_in_batch`` normalisation), averaged over the steps since the last log.

    Raises:
        ValueError: a TrainingArguments field that would make Accelerate/the Trainer do the strategy's job
            (deepspeed, fsdp, bf16/fp16, gradient checkpointing, torch_compile, ...: the message names the
            strategy method to use instead), ``optimizers=`` (the optimizer must be built after sharding; use
            ``optimizer_cls_and_kwargs=``), ``model_init=``, a bad ``torchloom_checkpoint``,
            ``torchloom_args`` that the TrainingArguments own, several processes that Accelerate does not see as
            one job (CPU without ``use_cpu=True``), ``average_tokens_across_devices=False`` with dp > 1, and
            the other TrainingArguments listed in docs/hf.md ("Refused").
        NotImplementedError: ``torchloom_strategy="auto"``, ``compute_loss_func``, an overridden ``compute_loss``,
            an ``optim`` built from the model (factories, GaLore/LOMO), an ``IterableDataset`` with dp > 1,
            ``compute_metrics`` under pipeline parallelism, and (at the call) hyperparameter search.
        RuntimeError: the strategy's batch arithmetic differs from the TrainingArguments' (e.g. a plan file with
            another micro-batch).
        ConfigFileError: ``torchloom_strategy=None`` and the ``loom config`` file is invalid or differs between
            ranks.
    """

    def __init__(self, model=None, args=None, *trainer_args, torchloom_strategy: Any = None,
                 torchloom_loss_func: Callable | None = None, torchloom_checkpoint: str = "disk",
                 torchloom_args: dict[str, Any] | None = None, **trainer_kwargs):
        check_trainer_arguments(args, trainer_kwargs, torchloom_strategy, torchloom_checkpoint, torchloom_args)
        if type(self).compute_loss is not TorchloomTrainer.compute_loss:
            raise NotImplementedError("TorchloomTrainer: an overridden compute_loss is not used by torchloom's "
                                      "train_step; pass torchloom_loss_func=lambda batch, output: loss instead.")
        self.torchloom_strategy = torchloom_strategy
        self.torchloom_loss_func = torchloom_loss_func
        self.torchloom_checkpoint = torchloom_checkpoint
        self.torchloom_args = dict(torchloom_args or {})
        self.torchloom = None  # the AccelerateResult, after setup
        self._tl_flash = None
        self._tl_rng = None  # the RNG state a resume restored, re-applied once the loader's iterator exists
        self._tl_hold_labels = False  # the default causal-LM loss: labels stay out of the model's forward
        self.torchloom_resumed_from = None  # after a resume: {"step", "path", "source": "disk" | "memory"}
        self._tl_window = None  # [loss numerator, denominator] of the accumulation window (the logged loss)
        # a PeftModel's checkpoints hold its trainable parameters only (the adapter), as the Trainer's do
        self.torchloom_trainable_only = _is_peft_model(model)
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        self._tl_check_distributed()
        self._tl_setup()

    def _tl_check_distributed(self) -> None:
        """The Trainer's bookkeeping (loss gather, main process, who writes ``trainer_state.json``) follows
        Accelerate's view of the job; on CPU Accelerate sees several processes as one job only with
        ``use_cpu=True``. Checked on every rank alike (the world size is the launcher's)."""
        from transformers.training_args import ParallelMode

        world = int(os.environ.get("WORLD_SIZE", "1"))
        if dist.is_initialized():
            world = dist.get_world_size()
        if world > 1 and self.args.parallel_mode != ParallelMode.DISTRIBUTED:
            raise ValueError(
                f"TorchloomTrainer: {world} processes were launched but the TrainingArguments run "
                f"{self.args.parallel_mode} (Accelerate sees no distributed job), so every rank would log only its "
                "own loss and act as the main process (each writing trainer_state.json). On CPU pass "
                "TrainingArguments(use_cpu=True), which Accelerate needs to treat a multi-process CPU job as one.")

    # ------------------------------------------------------------------------------------------ setup
    def _tl_setup(self) -> None:
        """``auto_accelerate`` with what the TrainingArguments ask for. Collective."""
        from torchloom.api import auto_accelerate

        from torchloom.strategy.config_file import default_strategy

        args, model = self.args, self.model
        # None: the `loom config` file's strategy (as auto_accelerate(strategy=None) would read it), resolved once
        # so that the batch arithmetic below and auto_accelerate use the same one
        strategy, config_note = default_strategy(self.torchloom_strategy, model)
        strategy_source = "" if config_note is None or strategy is None else f" ({config_note.split(': ')[0]})"
        if strategy is None:
            strategy = []  # plain data parallel; [] does not read the config file again
        dims = self._tl_planned_dims(model, strategy)
        dp = dims.dp_replicate * dims.dp_shard
        self._tl_check_planned(dims, dp)
        optim_cls, optim_kwargs = (self.optimizer_cls_and_kwargs if self.optimizer_cls_and_kwargs is not None
                                   else self.get_optimizer_cls_and_kwargs(args, model))
        from transformers.trainer_optimizer import is_optimizer_factory

        special = {"params", "model", "optimizer_dict"} & set(optim_kwargs)
        if special or is_optimizer_factory(optim_cls):
            raise NotImplementedError(
                f"TorchloomTrainer: optim={args.optim!r} builds its optimizer from the model or its own parameter "
                f"lists ({sorted(special) or 'a factory'}), which torchloom cannot do after sharding; use an optimizer "
                "class (adamw_torch, adamw_torch_fused, sgd, adafactor, ...) or optimizer_cls_and_kwargs=(cls, kwargs).")
        decay = set(self.get_decay_parameter_names(model))
        weight_decay = args.weight_decay

        def optim_func(params, **kw):
            # the Trainer's two groups (decay / no decay by name), over the sharded parameters
            if not weight_decay:
                return optim_cls(params, **kw)
            from torchloom.checkpoint.state import canonical_param_names

            names = canonical_param_names(model)  # wrapper components (activation checkpointing, ...) removed
            unknown = [p for p in params if id(p) not in names]
            if unknown:
                raise RuntimeError(f"TorchloomTrainer: {len(unknown)} parameter(s) of the accelerated model have no "
                                   "name in the model, so weight decay cannot be assigned by name; set "
                                   "weight_decay=0 or pass optimizer_cls_and_kwargs.")
            groups = [{"params": [p for p in params if names[id(p)][0] in decay], "weight_decay": weight_decay},
                      {"params": [p for p in params if names[id(p)][0] not in decay], "weight_decay": 0.0}]
            return optim_cls([g for g in groups if g["params"]], **kw)

        data = self._tl_dataset()
        if data is not None and dp > 1 and isinstance(data[0], torch.utils.data.IterableDataset):
            # torchloom reads an iterable as this rank's own shard; a Trainer user's iterable is usually the whole
            # stream (Accelerate splits it), so every rank would train on the same samples
            raise NotImplementedError(
                f"TorchloomTrainer: train_dataset is an IterableDataset and dp={dp}: torchloom's loader reads an "
                "iterable as this rank's shard, not as the whole stream the Trainer splits. Use a map-style dataset "
                "(with __len__; resumes exactly), or train with torchloom.auto_accelerate directly on a dataset "
                "sharded per data-parallel rank (docs/data.md).")
        dataloader_args = None
        if data is not None:
            dataset, collate = data
            dataloader_args = {
                "batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * dp,
                "micro_batch_size": args.per_device_train_batch_size,
                "seed": args.data_seed if args.data_seed is not None else args.seed,
                "shuffle": sampling_shuffle(args.train_sampling_strategy),
                "drop_last": args.dataloader_drop_last, "collate_fn": collate,
                "num_workers": args.dataloader_num_workers, "pin_memory": args.dataloader_pin_memory,
            }
            if args.dataloader_num_workers > 0:
                dataloader_args["persistent_workers"] = args.dataloader_persistent_workers
                if args.dataloader_prefetch_factor is not None:
                    dataloader_args["prefetch_factor"] = args.dataloader_prefetch_factor
                if args.dataloader_multiprocessing_context is not None:
                    dataloader_args["multiprocessing_context"] = args.dataloader_multiprocessing_context
        extra = {"model_input_format": "unpack_dict", **self.torchloom_args}
        loss_func = self._tl_loss_func()
        # the default causal-LM loss reads the labels itself: the model's forward would compute a second fp32
        # cross-entropy. The pipeline splits batches by their keys, so there the labels stay in the batch.
        self._tl_hold_labels = (loss_func is not None and self.torchloom_loss_func is None
                                and extra.get("model_input_format") == "unpack_dict" and dims.pp <= 1)
        if self._tl_hold_labels:
            extra["prepare_input"] = _holding_labels(extra.get("prepare_input"))
        try:
            res = auto_accelerate(
                model, optim_func, None if data is None else data[0], loss_func, strategy,
                optim_args=optim_kwargs, dataloader_args=dataloader_args, seed=args.seed,
                max_grad_norm=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None, **extra)
        except NotImplementedError as e:
            if "single parameter group" in str(e) and weight_decay:
                raise NotImplementedError(f"{e} TorchloomTrainer: weight_decay={weight_decay} gives the Trainer's two "
                                          "groups (no decay for biases and norms); set weight_decay=0.") from e
            raise
        if res.mesh.dp_size != dp or (data is not None and (
                res.grad_accum_steps != args.gradient_accumulation_steps
                or res.micro_batch_size != args.per_device_train_batch_size)):
            raise RuntimeError(
                f"TorchloomTrainer: the strategy{strategy_source} gave dp={res.mesh.dp_size}, micro-batch {res.micro_batch_size}, "
                f"accumulation {res.grad_accum_steps}, but the TrainingArguments ask for dp={dp} x "
                f"per_device_train_batch_size={args.per_device_train_batch_size} x gradient_accumulation_steps="
                f"{args.gradient_accumulation_steps}; use a strategy that keeps them (a plan file fixes its own).")
        if config_note:
            res.notes.insert(0, config_note)
        self.torchloom = res
        self.model_wrapped = res.model  # self.model stays the user's module (changed in place: sharded, cast)
        self.optimizer = res.optimizer
        res.optimizer.register_step_pre_hook(self._tl_pre_optimizer_step)
        res.optimizer.register_step_post_hook(self._tl_post_optimizer_step)
        self.callback_handler.model, self.callback_handler.optimizer = self.model, self.optimizer

    def _tl_check_planned(self, dims, dp: int) -> None:
        """Refusals that need the mesh the strategy will have (still before anything is built)."""
        if dp > 1 and not self.args.average_tokens_across_devices:
            raise ValueError(
                "TorchloomTrainer: TrainingArguments.average_tokens_across_devices=False is not supported with "
                f"dp={dp}: torchloom normalises a token-summed loss (SumLoss, the default for causal LMs) by the "
                "valid tokens of the whole global batch, i.e. across devices, as average_tokens_across_devices=True "
                "(the default) does; a per-rank normalisation is not implemented. Remove "
                "average_tokens_across_devices=False.")
        if dims.pp > 1 and self.compute_metrics is not None:
            raise NotImplementedError(
                "TorchloomTrainer: compute_metrics under pipeline parallelism is not supported (only the last stage "
                "holds the predictions); evaluate() gives the loss.")

    def _tl_loss_func(self) -> Callable | None:
        """``torchloom_loss_func``, else for a causal LM (labels shifted inside the model's loss) the token-exact
        :meth:`~torchloom.SumLoss.from_hf` (the Trainer's ``num_items_in_batch`` normalisation: the mean over every
        valid token of the global batch), else None (the output's ``loss``)."""
        if self.torchloom_loss_func is not None or not getattr(self, "_loss_shifts_labels", False):
            return self.torchloom_loss_func
        from torchloom.train_step import SumLoss

        def causal_lm_loss(batch, output):
            labels = getattr(batch, "held_labels", None)  # _HeldLabels: kept out of the forward
            if labels is None:
                labels = batch.get("labels") if hasattr(batch, "get") else None
            return output.loss if labels is None else SumLoss.from_hf(output, labels)

        return causal_lm_loss

    def _tl_planned_dims(self, model, strategy):
        """The mesh degrees the (resolved) strategy will have: the global batch needs the data-parallel size
        before the mesh exists."""
        from torchloom.api import plan_dims
        from torchloom.strategy.annotations import has_annotations, strategy_from_annotations
        from torchloom.strategy.strategy import Strategy
        from torchloom.utils import world_size

        if has_annotations(model):
            strategy = strategy_from_annotations(model, world_size(), strategy)
        else:
            strategy = Strategy.parse(strategy)
        return plan_dims(strategy, world_size())

    def _tl_dataset(self):
        """``(dataset, collate_fn)`` as ``Trainer._get_dataloader`` builds them (unused columns removed)."""
        dataset = self.train_dataset
        if dataset is None:
            return None
        collate = self.data_collator
        try:
            import datasets
        except ImportError:  # pragma: no cover - datasets is a transformers dependency
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(self.data_collator, description="training")
        return dataset, collate

    # ------------------------------------------------------------------------------------------ the Trainer's seams
    def get_train_dataloader(self):
        """torchloom's resumable per-rank loader of micro-batches (``res.dataloader``)."""
        if self.torchloom.dataloader is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self.torchloom.dataloader

    def get_total_train_batch_size(self, args) -> int:
        """Samples per optimizer step over all data-parallel ranks: ``per_device_train_batch_size x
        gradient_accumulation_steps x dp`` (torchloom's global batch; tensor/pipeline peers not counted)."""
        return self.torchloom.global_batch_size

    def num_examples(self, dataloader) -> int:
        """The number of samples of the loader's dataset (the whole dataset, not this rank's share)."""
        return len(dataloader.dataset)

    def _move_model_to_device(self, model, device) -> None:
        """Nothing here: ``auto_accelerate`` places the model (FSDP shard by shard, never the whole model first)."""

    def create_optimizer(self, model=None):
        """The optimizer ``auto_accelerate`` built over the sharded parameters (never a new one: the Trainer
        would build it over the unsharded model)."""
        return self.optimizer

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        """Nothing here: torchloom's checkpoint is loaded with the optimizer and scheduler in
        ``_prepare_for_training`` (the Trainer would look for HF weights in the directory)."""

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint=True`` picks the newest ``checkpoint-N`` with a
        ``trainer_state.json`` whose torchloom state is committed on disk, or (flash tier) held in shared
        memory by every rank (:func:`~torchloom.hf.trainer_args.newest_checkpoint`; rank 0 decides). Collective.

        Raises:
            ValueError: ``resume_from_checkpoint=True`` and no such checkpoint.
            NotImplementedError: ``trial=`` (hyperparameter search).
        """
        if trial is not None:
            raise NotImplementedError("TorchloomTrainer: hyperparameter search (trial=) is not supported.")
        if resume_from_checkpoint is True:
            from torchloom.checkpoint import commit

            memory = self._tl_memory_steps() if self.torchloom_checkpoint == "flash" else ()
            out = self.args.output_dir
            resume_from_checkpoint = commit.broadcast_from_rank0(lambda: newest_checkpoint(out, memory))
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({out}): no "
                                 f"{PREFIX_CHECKPOINT_DIR}-N with a {TRAINER_STATE_NAME} and a committed torchloom "
                                 "state.")
        if resume_from_checkpoint:
            # before super().train: the Trainer plans its steps per epoch from the accumulation first thing
            self._tl_hold_global_batch(str(resume_from_checkpoint))
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=None,
                             ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    def _tl_hold_global_batch(self, checkpoint: str) -> None:
        """Resume with the global batch ``checkpoint`` was trained with: on another number of data-parallel ranks
        (or another ``per_device_train_batch_size``) the accumulation is re-derived, ``global = micro x accumulation
        x dp``, in torchloom (:meth:`~torchloom.AccelerateResult.set_global_batch_size`) and in
        ``args.gradient_accumulation_steps``, with a warning. Collective (rank 0 reads the checkpoint).

        Raises:
            ValueError: the saved global batch is not divisible by ``per_device_train_batch_size x dp`` (naming the
                values that work), before any step.
        """
        from torchloom.checkpoint import commit

        saved = commit.broadcast_from_rank0(lambda: self._tl_saved_batch(checkpoint))
        res = self.torchloom
        if saved is None or res.dataloader is None or saved["global_batch_size"] == res.global_batch_size:
            return
        gbs, dp, micro = saved["global_batch_size"], res.mesh.dp_size, res.micro_batch_size
        was = (f"{gbs} samples per optimizer step (gradient_accumulation_steps={saved['grad_accum_steps']} on "
               f"{saved['world_size']} process(es))")
        if gbs % (dp * micro):
            fits = [m for m in range(1, gbs // dp + 1) if gbs % dp == 0 and (gbs // dp) % m == 0]
            fix = (f"use per_device_train_batch_size {_either(fits)} (gradient_accumulation_steps is then derived: "
                   f"{_either([gbs // (dp * m) for m in fits])})" if fits else
                   f"use a number of data-parallel ranks that divides {gbs} "
                   f"({_either([d for d in range(1, gbs + 1) if gbs % d == 0])})")
            raise ValueError(
                f"TorchloomTrainer: cannot resume from {checkpoint}: it was trained with a global batch of {was}, "
                f"which per_device_train_batch_size={micro} x dp={dp} = {micro * dp} does not divide; a resume keeps "
                f"the global batch (the optimisation would change otherwise). {fix[0].upper()}{fix[1:]}.")
        before = self.args.gradient_accumulation_steps
        accum = res.set_global_batch_size(gbs)
        self.args.gradient_accumulation_steps = accum
        if self.args.process_index == 0:
            log.warning("gradient_accumulation_steps %d -> %d keeps the checkpoint's global batch of %d samples on "
                        "dp=%d (per_device_train_batch_size=%d; %s was trained with %s)", before, accum, gbs, dp, micro,
                        Path(checkpoint).name, was)

    def _tl_saved_batch(self, checkpoint: str) -> dict | None:
        """The batch arithmetic ``checkpoint``'s torchloom state was saved with (``global_batch_size``,
        ``grad_accum_steps``, ``world_size``), from its trainer-state document in whichever tier holds the step:
        ``checkpoint-N/torchloom/step_N``, ``<output_dir>/torchloom_flash/step_N`` or this node's flash slot. None
        when there is none (the load then says what is missing)."""
        from torchloom.checkpoint import commit
        from torchloom.checkpoint import trainer_state as ts

        try:
            step = TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE_NAME)).global_step
        except (OSError, ValueError):
            return None
        name = commit.step_dirname(step)
        doc = None
        for d in (Path(checkpoint) / TORCHLOOM_CKPT_DIR / name, Path(self.args.output_dir) / FLASH_DIR / name):
            if commit.is_complete(d):
                doc = ts.read_document(d)
                break
        if doc is None and self.torchloom_checkpoint == "flash":
            for slot in self._tl_checkpointer().slots:
                header = slot.header()
                if header is not None and int(header.get("step", -1)) == step:
                    doc = ts.parse_document(header["trainer_state_text"], str(slot.header_path))
                    break
        if doc is None:
            return None
        data = doc.get("dataloader") or (doc.get("dataloader_per_rank") or [None])[0]
        accum = int((doc.get("train_step") or {}).get("grad_accum_steps", 1))
        if not data:
            return None
        gbs = (int(data["global_batch_size"]) if data.get("kind", "map") == "map"
               else int(data["dp_size"]) * int(data["micro_batch_size"]) * accum)
        return {"global_batch_size": gbs, "grad_accum_steps": accum, "world_size": int(doc.get("world_size", 1))}

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """The LR schedule for ``max_steps`` on torchloom's optimizer (stepped by ``train_step``), then the
        checkpoint. Returns ``(model, loader)``; Accelerate's ``prepare`` is never called."""
        res = self.torchloom
        if self._created_lr_scheduler:
            self.lr_scheduler, self._created_lr_scheduler = None, False
        self.create_scheduler(num_training_steps=max_steps, optimizer=res.optimizer)
        res.lr_scheduler = res.train_step.lr_scheduler = self.lr_scheduler
        from transformers.optimization import GreedyLR

        if isinstance(self.lr_scheduler, (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR)):
            res.train_step.lr_scheduler = None  # metric-driven: the Trainer steps it after each evaluation
        if resume_from_checkpoint is not None:
            from torchloom.hf.trainer_errors import resume_advice

            with resume_advice(str(resume_from_checkpoint)):  # train() takes no strict=False: say what does work
                self._tl_load(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return res.model, train_dataloader

    def _run_epoch(self, model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch, trial,
                   ignore_keys_for_eval, start_time, resume_from_checkpoint, epochs_trained,
                   steps_trained_in_current_epoch):
        """One pass of torchloom's loader: ``train_step`` per micro-batch (it accumulates and steps), the
        Trainer's callbacks, state, logging and saving around it. A resumed epoch continues from the restored
        loader position (no batches are replayed)."""
        step_fn, loader = self.torchloom.train_step, train_dataloader
        accum = step_fn.grad_accum_steps
        loader.set_epoch(epoch)  # a restored position of this epoch is kept
        # Resumed mid-epoch: creating the iterator draws from the torch RNG (the DataLoader's base seed), which the
        # uninterrupted run did at the epoch's start; re-apply the restored state after it (at an epoch start both
        # runs draw, so nothing is re-applied). Dropout masks then continue exactly.
        rng, self._tl_rng = (self._tl_rng if _position(loader) > 0 else None), None
        grad_norm, learning_rate, step = None, None, -1
        model.train()
        for inputs in loader:
            if rng is not None:
                from torchloom.checkpoint.state import restore_rng

                restore_rng(rng)
                rng = None
            step = _position(loader) - 1  # micro-batch index in the epoch
            if step_fn.micro_step % accum == 0:
                self.control = self.callback_handler.on_step_begin(self.args, self.state, self.control)
            closes_window = (step_fn.micro_step + 1) % accum == 0
            if closes_window:
                learning_rate = self._get_learning_rate()  # the LR this optimizer step uses
            if step_fn.micro_step % accum == 0 or self._tl_window is None:
                self._tl_window = torch.zeros(2, dtype=torch.float64, device=self._tr_loss.device)
            loss = step_fn(inputs)
            stat = step_fn.last_loss_stat.to(self._tl_window.device)  # [loss sum or mean(s), tokens or count]
            if self.args.logging_nan_inf_filter and not torch.isfinite(loss):
                self._tr_loss += self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
                self._tl_window[1] += stat[1]  # as the Trainer: its tokens still count in the window's divisor
            else:
                self._tl_window += stat
            self.current_flos += float(self.floating_point_ops(inputs))
            self._track_num_input_tokens(inputs)
            args = self.args
            if args.torch_empty_cache_steps is not None and self.state.global_step % args.torch_empty_cache_steps == 0:
                from accelerate.utils.memory import clear_device_cache

                clear_device_cache()
            if closes_window:
                # what the Trainer logs: the window's loss over all its tokens (its num_items_in_batch
                # normalisation; a plain mean over the micro-batches for a mean loss), the same on every rank
                window, self._tl_window = self._tl_window, None
                self._tr_loss += (window[0] / window[1].clamp(min=1.0)).to(self._tr_loss.dtype)
                grad_norm = step_fn.last_grad_norm
                self.state.global_step += 1
                self.state.epoch = epoch + (step + 1) / steps_in_epoch
                self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
                self._maybe_log_save_evaluate(self._tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                              start_time, learning_rate=learning_rate)
            else:
                self.control = self.callback_handler.on_substep_end(self.args, self.state, self.control)
            if self.control.should_epoch_stop or self.control.should_training_stop:
                break
        if step < 0:  # an empty epoch (as the Trainer: stop)
            self.control.should_training_stop = True
        self.control = self.callback_handler.on_epoch_end(self.args, self.state, self.control)
        self._maybe_log_save_evaluate(self._tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                      start_time, learning_rate=learning_rate)

    def _tl_pre_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self.is_in_train:
            self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)

    def _tl_post_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self.is_in_train:
            self.control = self.callback_handler.on_optimizer_step(self.args, self.state, self.control)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch through torchloom's ``train_step`` (accumulates; steps the optimizer at the end of
        each window). Returns the loss divided by the accumulation steps, as the Trainer's."""
        return self.torchloom.train_step(inputs).detach() / self.torchloom.grad_accum_steps

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The loss torchloom's ``train_step`` uses (``torchloom_loss_func`` or the output's ``loss``; for
        :class:`~torchloom.SumLoss` the batch's mean per item), without backward; with ``return_outputs``
        ``(loss, output)`` from the same forward (not under pipeline parallelism). Collective under FSDP/TP/PP:
        call it on every rank."""
        if return_outputs:
            return self.torchloom.train_step.eval_output(inputs)
        return self.torchloom.forward_loss(inputs)

    # ------------------------------------------------------------------------------------------ checkpoints
    def _tl_checkpointer(self):
        if self._tl_flash is None:
            from torchloom.checkpoint import FlashCheckpointer

            res = self.torchloom
            limit = self.args.save_total_limit
            # no keep_last: save_total_limit rotation (stale_checkpoints) deletes step_N with checkpoint-N, so the
            # best checkpoint the Trainer keeps keeps its state too
            self._tl_flash = FlashCheckpointer(
                Path(self.args.output_dir) / FLASH_DIR, model=res.model, optimizer=res.optimizer,
                lr_scheduler=res.lr_scheduler, dataloader=res.dataloader, train_step=res.train_step,
                trainable_only=self.torchloom_trainable_only)
        return self._tl_flash

    def _tl_memory_steps(self) -> list[int]:
        """Steps whose flash snapshot every rank holds in shared memory (after a crashed run's savers, which
        may still be committing, have finished). Collective."""
        ck = self._tl_checkpointer()
        mine = sorted(int(h["step"]) for h in (s.header() for s in ck.slots)
                      if h is not None and h.get("world_size") == ck.world and h.get("rank") == ck.rank)
        if ck.world == 1:
            return mine
        everyone: list = [None] * ck.world
        dist.all_gather_object(everyone, mine)
        return sorted(set(everyone[0]).intersection(*map(set, everyone[1:])))

    def _tl_rotate(self, run_dir: str) -> None:
        """``save_total_limit`` rotation counting only committed checkpoints (rank 0; see
        :func:`~torchloom.hf.trainer_args.stale_checkpoints`)."""
        from torchloom.checkpoint.commit import _remove_tree

        for p in stale_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint):
            _remove_tree(Path(p))

    def _save_checkpoint(self, model, trial) -> None:
        """``checkpoint-N/``: the torchloom state, then (rank 0) ``trainer_state.json``, then rotation (of the
        committed checkpoints only: a flash save still in the background keeps the previous one)."""
        from torchloom.checkpoint import save

        step = self.state.global_step
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        self.store_flos()
        res = self.torchloom
        if self.args.save_only_model:
            self.save_model(output_dir, _internal_call=True)
        elif self.torchloom_checkpoint == "flash":
            self._tl_checkpointer().save(step, persist=True)
        else:
            save(Path(output_dir) / TORCHLOOM_CKPT_DIR, step=step, model=res.model, optimizer=res.optimizer,
                 lr_scheduler=res.lr_scheduler, dataloader=res.dataloader, train_step=res.train_step,
                 trainable_only=self.torchloom_trainable_only)
        best = self.state.best_global_step
        if best and os.path.exists(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")):
            # as the Trainer: the best checkpoint (save_strategy="best", metric_for_best_model) is kept by rotation
            self.state.best_model_checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            for cb in [c for c in self.callback_handler.callbacks + [self.control] if _exportable(c)]:
                name, cb_state = type(cb).__name__, cb.state()
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(cb_state)
                else:
                    self.state.stateful_callbacks[name] = cb_state
            self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))
            if self.args.save_only_model:  # model exports only, written synchronously: as the Trainer
                rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                                   best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)
            else:
                self._tl_rotate(run_dir)
        if dist.is_initialized():
            dist.barrier()  # every rank sees the finished checkpoint (and the rotation) before going on

    def _tl_load(self, checkpoint: str) -> None:
        """Restore the torchloom state of ``checkpoint-N`` (collective)."""
        from torchloom.checkpoint import load

        res = self.torchloom
        step = TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE_NAME)).global_step
        live = dict(model=res.model, optimizer=res.optimizer, lr_scheduler=res.lr_scheduler,
                    dataloader=res.dataloader, train_step=res.train_step)
        from torchloom.checkpoint import commit

        disk = Path(checkpoint) / TORCHLOOM_CKPT_DIR
        flash_dir = Path(self.args.output_dir) / FLASH_DIR / commit.step_dirname(step)
        info = None
        if disk.is_dir():
            info = load(disk, **live)
        elif self.torchloom_checkpoint == "flash":  # the newest in-memory snapshot, if it is of this step
            info = self._tl_checkpointer().load()
        if info is None or info["step"] != step:  # the flash tier's disk copy of this step (committed)
            if not commit.broadcast_from_rank0(lambda: commit.is_complete(flash_dir)):
                memory = " or shared memory" if self.torchloom_checkpoint == "flash" else ""
                raise ValueError(
                    f"cannot resume from {checkpoint}: its torchloom training state (step {step}) is neither in "
                    f"{disk} nor committed in the flash tier ({flash_dir}{memory}). A flash save that had not "
                    "committed when the job or node died leaves only trainer_state.json: resume_from_checkpoint=True "
                    "picks the newest committed checkpoint. A save_only_model=True checkpoint holds only the model "
                    "and cannot be resumed, as with the Trainer.")
            info = load(flash_dir, **live)
        if int(info["step"]) != step:
            raise RuntimeError(f"{checkpoint}: the torchloom state is of step {info['step']}, trainer_state.json of "
                               f"step {step}.")
        from torchloom.checkpoint.state import capture_rng

        self._tl_rng = capture_rng()
        self.torchloom_resumed_from = {"step": step, "path": str(info["path"]), "source": info.get("source", "disk")}

    # ------------------------------------------------------------------------------------------ export
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The trained model, full weights gathered from any strategy, as the Trainer saves it, plus
        ``training_args.bin`` and the tokenizer/processor (``processing_class``, else the collator's tokenizer).
        A Hugging Face model (``PreTrainedModel`` or ``PeftModel``): :func:`torchloom.hf.save_pretrained`
        (``from_pretrained``-loadable; a PEFT model's adapter). Any other module: its state dict as
        ``model.safetensors`` (:func:`torchloom.checkpoint.export_safetensors`; tied weights stored once and
        restored by :func:`torchloom.checkpoint.load_safetensors`). Collective: every rank. An
        ``output_dir`` holding another model is refused (``CheckpointError`` naming it, before anything is written;
        :mod:`torchloom.hf.trainer_errors`: another directory, or ``torchloom.hf.save_pretrained(...,
        overwrite=True)``)."""
        from transformers import PreTrainedModel

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        tokenizer = self.processing_class if hasattr(self.processing_class, "save_pretrained") else getattr(
            self.data_collator, "tokenizer", None)
        if isinstance(self.model, PreTrainedModel) or _is_peft_model(self.model):
            from torchloom.hf import save_pretrained
            from torchloom.hf.trainer_errors import save_model_advice

            with save_model_advice(output_dir):  # save_model takes no overwrite=True: say what does work
                save_pretrained(self.torchloom.model, output_dir, tokenizer=tokenizer)
        else:  # as the Trainer for a plain module: "only saving its state dict"
            from transformers.utils import SAFE_WEIGHTS_NAME

            from torchloom.checkpoint import export_safetensors

            export_safetensors(self.torchloom.model, Path(output_dir) / SAFE_WEIGHTS_NAME)
            if self.args.should_save and hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(output_dir)
        if self.args.should_save:
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """``{prefix}_loss``: the mean loss over every sample of the evaluation set exactly once (each batch's
        mean loss weighted by its real sample count, as the Trainer's ``eval_loss``), the ``compute_metrics``
        results (``{prefix}_<name>``) and speed metrics. Collective. Logged, and ``on_evaluate`` callbacks run.
        A dict of sets is evaluated set by set (``{prefix}_{name}_...``), as by the Trainer.

        ``compute_metrics`` (unless ``prediction_loss_only``) gets an ``EvalPrediction`` as the Trainer builds it:
        ``predictions`` the model outputs but the loss and ``ignore_keys`` (default: the config's
        ``keys_to_ignore_at_inference``), after ``preprocess_logits_for_metrics``, and ``label_ids`` the batch's
        ``label_names``, every sample once in dataset order (gathered over the data-parallel ranks with
        :meth:`torchloom.data.EvalLoader.gather_for_metrics`: no padding repeats), numpy arrays padded with -100
        where batches differ in length.

        Raises:
            ValueError: no evaluation dataset.
        """
        override = eval_dataset is not None
        dataset = eval_dataset if override else self.eval_dataset
        if isinstance(dataset, dict):
            metrics = {}
            for name, one in dataset.items():
                metrics.update(self.evaluate(one, ignore_keys=ignore_keys,
                                             metric_key_prefix=f"{metric_key_prefix}_{name}"))
            return metrics
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        gather = self.compute_metrics is not None and not self.args.prediction_loss_only
        out = self._tl_eval_loop(dataset, metric_key_prefix, ignore_keys, gather)
        self.log(out.metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, out.metrics)
        return out.metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test"):
        """``PredictionOutput(predictions, label_ids, metrics)`` over every sample of ``test_dataset`` once, as
        :meth:`evaluate` gathers them (``label_ids`` and the loss only when the set has labels; ``compute_metrics``
        when set). Collective. ``on_predict`` callbacks run.

        Raises:
            NotImplementedError: a pipelined model (only its last stage holds the predictions).
        """
        from transformers.trainer_utils import PredictionOutput

        out = self._tl_eval_loop(test_dataset, metric_key_prefix, ignore_keys, not self.args.prediction_loss_only)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, out.metrics)
        return PredictionOutput(predictions=out.predictions, label_ids=out.label_ids, metrics=out.metrics)

    def _tl_eval_loop(self, dataset, prefix: str, ignore_keys, gather: bool):
        """Every sample of ``dataset`` once (:func:`torchloom.data.eval_loader`): the loss weighted by real samples
        and, with ``gather``, the predictions and labels of every rank in dataset order. Returns an
        ``EvalLoopOutput``. Collective."""
        import numpy as np
        from transformers.trainer_pt_utils import EvalLoopContainer
        from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize

        from torchloom.data.eval import eval_loader

        collate = self.data_collator
        try:
            import datasets
        except ImportError:  # pragma: no cover
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="evaluation")
        else:
            collate = self._get_collator_with_removed_columns(self.data_collator, description="evaluation")
        res = self.torchloom
        if gather and res.train_step._pipeline is not None:
            raise NotImplementedError("TorchloomTrainer: predictions under pipeline parallelism are not supported "
                                      "(only the last stage holds them); evaluate() gives the loss.")
        if ignore_keys is None:
            config = getattr(self.model, "config", None)
            ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", ["cache"])) if config is not None else []
        loader = eval_loader(dataset, self.args.per_device_eval_batch_size, mesh=res.mesh, collate_fn=collate,
                             num_workers=self.args.dataloader_num_workers)
        start = time.time()
        was_training = res.model.training
        res.model.eval()
        total, count, any_loss = torch.zeros((), dtype=torch.float64), 0, False
        concat = self.args.eval_do_concat_batches
        preds, labels = EvalLoopContainer(concat, padding_index=-100), EvalLoopContainer(concat, padding_index=-100)
        with torch.no_grad():
            for batch in loader:
                # a rank with no real sample left still runs the (collective) forward on its filler batch
                rows = _take_rows(batch, loader.num_valid or loader.rows)
                # as the Trainer's prediction_step: no loss for a batch without its label_names (a test set);
                # without label_names (a module whose forward names none) the loss function decides
                has_labels = all(_get(rows, k) is not None for k in self.label_names)
                if gather:
                    loss, output = res.train_step.eval_output(rows, with_loss=has_labels)
                else:
                    loss = res.forward_loss(rows) if has_labels else None
                if loss is not None and loader.num_valid:
                    total += loss.double().cpu() * loader.num_valid
                    count += loader.num_valid
                any_loss = any_loss or loss is not None
                if gather:
                    p, y = _predictions(output, ignore_keys), None
                    if has_labels and self.label_names:
                        y = tuple(_get(rows, k).to(res.device) for k in self.label_names)
                        y = y[0] if len(y) == 1 else y
                    if p is not None and self.preprocess_logits_for_metrics is not None:
                        p = self.preprocess_logits_for_metrics(p, y)
                    got = loader.gather_for_metrics({"p": p, "y": y} if y is not None else {"p": p}, pad_value=-100)
                    for container, key in ((preds, "p"), (labels, "y")):
                        if got.get(key) is not None:
                            container.add(got[key])
                    preds.to_cpu_and_numpy()
                    labels.to_cpu_and_numpy()
                self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        res.model.train(was_training)
        metrics: dict[str, Any] = {}
        all_preds, all_labels = preds.get_arrays(), labels.get_arrays()
        if self.compute_metrics is not None and all_preds is not None and all_labels is not None:
            metrics = denumpify_detensorize(self.compute_metrics(EvalPrediction(predictions=all_preds,
                                                                                label_ids=all_labels)))
        if any_loss:
            metrics["loss"] = loader.reduce_metrics(total, count).item()
        metrics = {k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in metrics.items()}
        n = len(dataset)
        steps = math.ceil(n / (self.args.per_device_eval_batch_size * res.mesh.dp_size))
        metrics.update(speed_metrics(prefix, start, num_samples=n, num_steps=steps))
        return EvalLoopOutput(predictions=all_preds, label_ids=all_labels, metrics=metrics, num_samples=n)

    def _finalize_training(self, trial, num_train_samples, start_time):
        out = super()._finalize_training(trial, num_train_samples, start_time)
        if self._tl_flash is not None:  # flash tier: the last background save is committed before train() returns
            self._tl_flash.finalize()
            self._tl_flash = None
            if self.args.should_save and not self.args.save_only_model:
                self._tl_rotate(self._get_output_dir(trial))  # the older ones the last save's commit replaces
            if dist.is_initialized():
                dist.barrier()
        return out


# ---------------------------------------------------------------------------------------------- helpers
def _position(loader) -> int:
    """Micro-batches this rank's loader has yielded in its current epoch (from its public state)."""
    st = loader.state_dict()
    if st.get("kind") == "iterable":
        return int(st["batches_yielded"])
    return int(st["consumed"]) // (loader.dp_size * loader.micro_batch_size)


class _HeldLabels(Mapping):
    """A batch whose ``labels`` are held back from ``model(**batch)`` (the mapping holds the model's inputs;
    ``held_labels`` the labels, read by the default causal-LM loss)."""

    def __init__(self, inputs: dict, labels: Any):
        self._inputs, self.held_labels = inputs, labels

    def __getitem__(self, key):
        return self._inputs[key]

    def __iter__(self):
        return iter(self._inputs)

    def __len__(self) -> int:
        return len(self._inputs)


def _holding_labels(prepare_input: Callable | None) -> Callable:
    """``prepare_input`` (default: move to the device), then the labels held out of the model's inputs."""
    from torchloom.train_step import move_to_device

    prepare = prepare_input or move_to_device

    def prepare_holding_labels(batch, device):
        batch = prepare(batch, device)
        if not isinstance(batch, Mapping) or "labels" not in batch:
            return batch
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return _HeldLabels(inputs, batch["labels"])

    return prepare_holding_labels


def _either(values: list) -> str:
    """``"1, 2, 4 or 8"``."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _exportable(cb) -> bool:
    from transformers.trainer_callback import ExportableState

    return isinstance(cb, ExportableState)


def _is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is optional
        return False
    return isinstance(model, PeftModel)


def _get(batch: Any, key: str) -> Any:
    return batch.get(key) if hasattr(batch, "get") else None


def _plain(t: Any) -> Any:
    """A tensor of the output as one process holds it whole (a tensor-parallel DTensor gathered), detached."""
    if not isinstance(t, torch.Tensor):
        return t
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _predictions(output: Any, ignore_keys: list[str]) -> Any:
    """What the Trainer's ``prediction_step`` calls the logits: the output's tensors but the loss and
    ``ignore_keys`` (a tuple, or the tensor when there is one), or None."""
    if isinstance(output, torch.Tensor):
        items = [output]
    elif isinstance(output, Mapping) or hasattr(output, "items"):
        items = [v for k, v in output.items() if k not in [*ignore_keys, "loss"]]
    elif isinstance(output, (tuple, list)):
        items = list(output[1:] if output and isinstance(output[0], torch.Tensor) and output[0].dim() == 0
                     else output)
    else:
        items = []
    items = [_plain(v) for v in items if isinstance(v, torch.Tensor)]
    if not items:
        return None
    return items[0] if len(items) == 1 else tuple(items)


def _take_rows(batch: Any, rows: int) -> Any:
    """The first ``rows`` rows of every per-row tensor of a (dict) batch."""
    if isinstance(batch, dict) or hasattr(batch, "items"):
        return type(batch)({k: v[:rows] if torch.is_tensor(v) and v.dim() > 0 else v for k, v in batch.items()})
    return batch

"""`auto_accelerate`: an unchanged model and training recipe in, a distributed job out."""
from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .context import AccelContext
from .data import build_dataloader, plan_batches
from .errors import StrategyError
from .parallel.distributed import init_distributed
from .parallel.materialize import materialize_meta_model
from .parallel.mesh import ParallelDims, ParallelMesh, set_current_mesh
from .parallel.unused_params import install_fsdp_zero_fill
from .strategy.annotations import has_annotations, strategy_from_annotations
from .strategy.config_file import default_strategy
from .strategy.data_parallel import replicating_data_parallel
from .strategy.strategy import Strategy, StrategyLike
from .train_step import TrainStep
from .utils import world_size as _world_size

log = logging.getLogger("torchloom")


@dataclass
class AccelerateResult:
    """What :func:`auto_accelerate` returns.

    Attributes:
        model: the transformed model (DDP/FSDP-wrapped, cast, checkpointed, compiled as the strategy says).
        optimizer: built after sharding, over the trainable parameters only (wrapped for zero1).
        dataloader: a ``StatefulDataLoader`` yielding this rank's micro-batches (None without a dataset).
        loss_func: the user's loss function.
        lr_scheduler: built on the optimizer, or None.
        strategy: the validated :class:`Strategy` (with implied methods).
        mesh: the :class:`ParallelMesh` (degrees, groups, dp rank/size).
        train_step: ``train_step(batch) -> loss``; see :class:`torchloom.train_step.TrainStep`.
        grad_accum_steps / micro_batch_size / global_batch_size: the derived batch arithmetic (changed together
            by :meth:`set_global_batch_size`).
        loss_scaler: the fp16 dynamic loss scaler (amp fp16), else None.
        device: this rank's device (``cuda:LOCAL_RANK`` or CPU).
        compute_dtype: dtype of the matmuls (amp's or half's dtype, else fp32): what MFU should divide by.
        notes: what each method did, in order.
        replica_monitor: the :class:`~torchloom.parallel.consistency.ReplicaMonitor` when
            ``check_replicas_every`` was given, else None.
        search: with ``strategy="auto"`` or a plan file, the :class:`~torchloom.search.result.SearchResult`
            (predictions, trials, the chosen plan); else None.
        prediction_check: with ``check_prediction=True``, the
            :class:`~torchloom.search.drift.PredictionDrift` comparing the measured step time with the cost
            model's prediction (``record()`` for your logs, ``summary()``); else None.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    dataloader: Any
    loss_func: Callable | None
    lr_scheduler: Any
    strategy: Strategy
    mesh: ParallelMesh
    train_step: TrainStep
    grad_accum_steps: int = 1
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    loss_scaler: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    compute_dtype: torch.dtype = torch.float32
    notes: list[str] = field(default_factory=list)
    replica_monitor: Any = None
    search: Any = None
    prediction_check: Any = None
    _trackers: Any = field(default=None, init=False, repr=False)  # TrackerGroup of init_trackers / the first log

    def check_replicas(self, raise_error: bool = True):
        """Compare the parameters of every data-parallel replica now (a collective: call it on every rank at
        the same point). Returns a :class:`~torchloom.parallel.consistency.ReplicaReport`; raises
        :class:`~torchloom.errors.ReplicaDivergenceError` naming the first differing parameter unless
        ``raise_error=False``. See docs/methods/ddp.md, "Replica consistency"."""
        from .parallel.consistency import check_replicas

        parts = getattr(self.model, "parts", None) or [self.model]
        return check_replicas(parts, self.mesh, self.device, raise_error=raise_error)

    def set_global_batch_size(self, global_batch_size: int) -> int:
        """Change the samples per optimizer step (over all data-parallel ranks) from the next step on, keeping
        the micro-batch and the mesh: the accumulation becomes ``global_batch_size / (dp x micro_batch_size)``
        in ``train_step``, the data loader (and its sampler's epoch length) and this result alike. Call it on
        every rank at an optimizer-step boundary (before the first step, or right after a step), e.g. for a
        batch-size ramp, or to keep a checkpoint's global batch on another number of ranks. Returns the new
        ``grad_accum_steps``. Nothing is changed when it raises.

        Raises:
            DataError: not a positive multiple of ``dp x micro_batch_size`` (the message names sizes that are), no
                micro-batch size known (no dataset and no batch sizes given), or a loader position the new
                global batch does not fit (``ElasticDistributedSampler.set_global_batch_size``).
            ValueError: called inside an accumulation window.
        """
        from .data.sampler import DataError

        if self.micro_batch_size is None:
            raise DataError("set_global_batch_size needs the micro-batch size: auto_accelerate was given no dataset "
                            "and no dataloader_args batch sizes (give micro_batch_size or batch_size there).")
        plan = plan_batches(global_batch_size, self.micro_batch_size, self.mesh.dp_size)
        step = self.train_step
        if step.micro_step % step.grad_accum_steps:
            raise ValueError(
                f"set_global_batch_size({global_batch_size}) inside an accumulation window: "
                f"{step.micro_step % step.grad_accum_steps} of its {step.grad_accum_steps} micro-batches have run. "
                "Call it before the first step or right after an optimizer step.")
        if self.dataloader is not None:
            self.dataloader.set_global_batch_size(plan.global_batch_size)
        step.set_grad_accum_steps(plan.grad_accum_steps)
        self.global_batch_size, self.grad_accum_steps = plan.global_batch_size, plan.grad_accum_steps
        return plan.grad_accum_steps

    def forward_loss(self, batch: Any) -> torch.Tensor:
        """Loss of one batch without backward (for evaluation); runs the model as ``train_step`` does.
        See :meth:`TrainStep.eval_loss`."""
        return self.train_step.eval_loss(batch)

    # -- experiment tracking (torchloom.tracking; docs/hf.md, "Trackers and main-process helpers") ------------
    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None, log_with: Any = "jsonl",
                      logging_dir: Any = None, init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Start the trackers :meth:`log` writes to (collective: call it on every rank; rank 0 builds and writes them, and a failure there raises on every rank).

        Args:
            project_name: the run's name and directory under ``logging_dir``.
            config: hyper-parameters to record (JSONL: ``config.json``; TensorBoard: a text summary; MLflow:
                params; W&B: ``run.config``).
            log_with: ``"jsonl"`` (default), ``"tensorboard"``, ``"mlflow"``, ``"wandb"``, ``"all"``, a
                :class:`torchloom.tracking.Tracker` instance, or a list of these.
            logging_dir: root directory (default ``./torchloom_logs``).
            init_kwargs: per back end, arguments of its tracker (e.g. ``{"wandb": {"name": "run-1"}}``).

        Raises:
            RuntimeError: trackers are already running (call :meth:`end_training` first).
            ValueError / TypeError / ImportError: see :func:`torchloom.tracking.start_trackers`.
        """
        from .tracking import start_trackers

        if self._trackers is not None and not self._trackers.closed:
            raise RuntimeError("init_trackers() called while trackers are running; call end_training() first.")
        self._trackers = start_trackers(project_name, config=config, log_with=log_with, logging_dir=logging_dir,
                                        init_kwargs=init_kwargs)

    def log(self, values: dict[str, Any], step: int) -> None:
        """Log scalars at ``step`` to every tracker (written on the global main process only; no communication,
        so call it on every rank or on rank 0 alone). Without :meth:`init_trackers`, the first call starts a
        JSONL tracker in ``./torchloom_logs/run-<UTC time>/`` and warns once with the path.

        Args:
            values: ``{name: python number or 0-dim tensor}`` (a CUDA tensor syncs on the main process).
            step: ``int >= 0`` (e.g. the optimizer step).

        Raises:
            TypeError: a non-scalar value (named), a non-int step. ValueError: a negative step.
            RuntimeError: after :meth:`end_training`.
        """
        if self._trackers is None:
            from .tracking.group import start_default_trackers

            self._trackers = start_default_trackers()
        self._trackers.log(values, step)

    def get_tracker(self, name: str) -> Any:
        """The running tracker called ``name`` (e.g. ``"wandb"``: ``.run`` is the W&B run), or None (also on
        ranks other than the main process)."""
        return self._trackers.get(name) if self._trackers is not None else None

    def end_training(self) -> None:
        """Flush and close every tracker (call it on every rank; a no-op without trackers)."""
        if self._trackers is not None:
            self._trackers.finish()


def auto_accelerate(
    model: nn.Module,
    optim_func: Callable[..., torch.optim.Optimizer] | type[torch.optim.Optimizer] | None = None,
    dataset: Any = None,
    loss_func: Callable[[Any, Any], Any] | None = None,
    strategy: StrategyLike = None,
    *,
    optim_args: dict[str, Any] | None = None,
    dataloader_args: dict[str, Any] | None = None,
    model_input_format: str | None = None,
    prepare_input: Callable[[Any, torch.device], Any] | None = None,
    lr_scheduler_cls: Callable | None = None,
    lr_scheduler_args: dict[str, Any] | None = None,
    max_grad_norm: float | None = None,
    seed: int = 0,
    check_replicas_every: int | None = None,
    search: dict[str, Any] | None = None,
    check_prediction: bool = False,
) -> AccelerateResult:
    """Turn a single-device model and recipe into a distributed one (ATorch-compatible signature).

    Args:
        model: an unchanged ``nn.Module`` on CPU or the meta device (materialised after sharding).
        optim_func: optimizer class or ``callable(params, **optim_args)``; built after sharding over the
            parameters that require grad.
        dataset: map-style or iterable dataset, or None.
        loss_func: ``loss_func(batch, output) -> loss`` (0-dim tensor), a tuple whose first item is the loss,
            or :class:`~torchloom.train_step.SumLoss` to normalise by the global item count. None: use the
            model output's ``loss`` (Hugging Face models given ``labels``).
        strategy: list of methods (``["fsdp", ("amp", {"dtype": "bfloat16"})]``, ATorch lists accepted), a
            :class:`Strategy`, a JSON/YAML file path, or None: the ``loom config`` file's strategy when there
            is one (noted in ``res.notes``; docs/config.md), else plain data parallel (``[]``: always plain data
            parallel, no file read). A model annotated with ``torchloom.replicate``/``split`` scopes gives its
            own strategy; one given here is merged into it (see
            :func:`torchloom.strategy.annotations.strategy_from_annotations`, docs/annotations.md).
        optim_args: keyword arguments of ``optim_func`` (e.g. ``{"lr": 3e-4}``).
        dataloader_args: ``DataLoader`` arguments; ``batch_size`` is the **global** batch (samples per
            optimizer step over all data-parallel ranks). ``micro_batch_size`` (per rank) may be given too;
            gradient-accumulation steps = global / (dp * micro). ``seed``/``shuffle``/``drop_last`` set
            the elastic sampler. An iterable dataset's ranks agree when its data ends (``uneven``: "drop"
            the surplus with a warning, the default, or "error"; docs/data.md).
        model_input_format: None -> ``model(batch)``; "unpack_sequence" -> ``model(*batch)``;
            "unpack_dict" -> ``model(**batch)``.
        prepare_input: ``prepare_input(batch, device) -> batch`` (default: move tensors to the device).
        lr_scheduler_cls / lr_scheduler_args: scheduler built on the final optimizer.
        max_grad_norm: clip the global gradient norm (across all shards and ranks) to this value.
        seed: ``torch.manual_seed(seed)`` runs on every rank before the methods are applied (so meta-device
            initialisation is the same on every rank); also the default shuffling seed of the sampler.
        search: options of ``strategy="auto"`` (the strategy search, docs/search.md): ``exclude``/``include``
            (method names), ``fixed`` (degrees such as ``{"tp": 2}``), ``time_limit_s``, ``top_k`` (confirming
            runs), ``model_factory`` (a fresh model per trial; default a deep copy of ``model``),
            ``on_mismatch`` (``"research"``: search again when a plan file was made for another setup),
            ``cache``, ``seq_len``, ``sample_batch``; see :class:`torchloom.search.options.SearchOptions`.
        check_replicas_every: compare a checksum of every parameter across its data-parallel replicas after
            the first optimizer step and then every N steps, and raise ReplicaDivergenceError naming the
            first parameter that differs (one small all-gather per replica group; docs/methods/ddp.md).
            None (default) or 0 = off (``loom train`` spells off as 0); a bool is rejected.
        check_prediction: compare each optimizer step's measured wall time (from the end of the previous
            ``train_step`` optimizer step) with the cost model's prediction for the plan that runs, and warn once
            (:class:`~torchloom.search.drift.PredictionDriftWarning`, rank 0) when the median of the last 20
            steps after 3 warm-up steps is off by more than the published error band (``STEP_TIME_BAND``, 60%: the
            largest step-time error the accuracy benchmark measured), naming the
            ``loom calibrate --refresh`` command. Costs the model analysis (~0.5 s for a 4M-parameter LLaMA;
            none with ``strategy="auto"``) and the calibration check (~0.3 s when cached; ~10 s, once per
            machine, when not). ``res.prediction_check.record()`` gives ``predicted_step_s``,
            ``measured_step_s`` and ``drift`` for your logs; it never raises (docs/cost_model.md, "Online check").

    Returns:
        :class:`AccelerateResult`.

    Raises:
        StrategyError: invalid strategy, a mesh that does not fit the world size, or a mesh degree no
            method uses.
        DataError: batch sizes that do not divide (global batch vs dp size x micro batch), bad
            ``dataloader_args``.
        ValueError: a bad ``model_input_format``, no ``optim_func``, no trainable parameters, or a
            ``check_replicas_every`` that is not a non-negative int or None.
        TypeError: ``model`` is not an ``nn.Module``; ``optim_func`` rejects ``optim_args``.
        NotImplementedError: ``zero1`` with several parameter groups.
        RuntimeError: a meta-device model that cannot be fully initialised.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if model_input_format not in (None, "unpack_sequence", "unpack_dict"):
        raise ValueError(
            f"model_input_format={model_input_format!r} is not valid; use None, 'unpack_sequence' or 'unpack_dict'."
        )
    _check_arguments(optim_func, max_grad_norm, seed)
    if check_replicas_every is not None and (isinstance(check_replicas_every, bool) or not isinstance(
            check_replicas_every, int) or check_replicas_every < 0):
        raise ValueError(f"check_replicas_every must be a positive int, or 0 or None (off), got "
                         f"{check_replicas_every!r}.")
    check_replicas_every = check_replicas_every or None  # 0 = off, as in loom train's config
    if not isinstance(check_prediction, bool):
        raise ValueError(f"check_prediction must be True or False, got {check_prediction!r}.")
    device = init_distributed()
    strategy, config_note = default_strategy(strategy, model)  # None: a `loom config` file's (docs/config.md)
    strategy, dataloader_args, searched = _resolve_search(model, strategy, search, dict(
        optim_func=optim_func, optim_args=optim_args, dataset=dataset, loss_func=loss_func,
        dataloader_args=dataloader_args, model_input_format=model_input_format, prepare_input=prepare_input,
        max_grad_norm=max_grad_norm, seed=seed))
    annotated = has_annotations(model)  # replicate/split scopes: they become (or merge into) the strategy
    strategy = strategy_from_annotations(model, _world_size(), strategy) if annotated else Strategy.parse(strategy)
    ctx = AccelContext(model=model, strategy=strategy, device=device)
    if config_note:
        ctx.note(config_note)
    if annotated:
        ctx.note(f"annotations: replicate/split scopes give {strategy!r}")
    ctx.on_meta = any(p.is_meta for p in model.parameters())
    methods = strategy.ordered()

    # 1. configure: methods record settings; data parallel takes the rest of the world by default
    for m in methods:
        m.configure(ctx)
    _default_dims(ctx)
    ctx.mesh = ParallelMesh(ctx.dims, device.type)
    # gradients must be reduced over dp, and over cp under a sequence split (cp peers hold different tokens)
    if ctx.mesh.degree(ctx.mesh.grad_view) > 1 and not any(type(m).data_parallel for m in methods):
        # DDP cannot hold tensor-parallel DTensor parameters: replicate them with FSDP2 instead (the mesh
        # already put the data-parallel degree on dp_replicate, so nothing is sharded: DDP semantics)
        name, spec = replicating_data_parallel(tensor_parallel="tensor_parallel" in strategy)
        strategy = strategy.with_method(spec)
        ctx.strategy = strategy
        added = next(m for m in strategy.ordered() if type(m).name == name)
        added.configure(ctx)
        methods = sorted([*methods, added], key=lambda m: type(m).stage)
        ctx.note(f"no data-parallel method given for {ctx.mesh.grad_view}={ctx.mesh.degree(ctx.mesh.grad_view)}: "
                 f"added {name}"
                 + (" over dp_replicate (DDP cannot hold tensor-parallel DTensors)" if name == "fsdp" else ""))
    _check_dims_used(ctx.mesh.dims, methods)
    set_current_mesh(ctx.mesh)  # eval_loader / reduce_metrics without mesh= use its dp view
    if ctx.loss_scaler is not None:
        ctx.loss_scaler.group = None  # world: every rank must agree on skipping

    analysis = None
    if check_prediction:  # the unchanged model's analysis, before any method transforms it
        from .search.drift import analysis_before_apply

        analysis = analysis_before_apply(model, dataset, dataloader_args, model_input_format, loss_func, searched)

    # 2. apply: each method transforms the model in stage order
    torch.manual_seed(seed)
    if "fsdp" not in strategy:
        if ctx.on_meta:  # only FSDP materialises shard by shard; everything else needs the full model now
            materialize_meta_model(ctx.model, device)
            ctx.on_meta = False
        ctx.model.to(device)
    for m in methods:
        m.apply(ctx)
    for fn in ctx.post_apply:
        fn(ctx)
    install_fsdp_zero_fill(ctx.model_parts)  # ranks that skip a branch must not desync FSDP's reduce-scatter
    from .hf.save import route_save_pretrained  # HF's own save_pretrained cannot read sharded (DTensor) weights

    if route_save_pretrained(ctx.model):
        ctx.note("save_pretrained of the sharded model goes through torchloom.hf.save_pretrained (collective)")
    for holder in {id(m): m for m in (ctx.model, *ctx.model_parts)}.values():
        holder._torchloom_param_groups = ctx.param_groups  # which mesh each group lives on (param_groups_of)

    # 3. optimizer after sharding (it must see the sharded parameters), then optimizer-level methods
    params = list({id(p): p for part in ctx.model_parts for p in part.parameters() if p.requires_grad}.values())
    if not params:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False).")
    ctx.optimizer = _build_optimizer(optim_func, params, optim_args or {})
    for m in methods:
        m.wrap_optimizer(ctx)
    for fn in ctx.post_optimizer:
        fn(ctx)
    monitor = None
    if check_replicas_every is not None:
        from .parallel.consistency import ReplicaMonitor  # DTensor's import (~0.7 s): not on loom plan's path

        monitor = ReplicaMonitor(ctx.model_parts, ctx.mesh, device, check_replicas_every).attach(ctx.optimizer)
        ctx.note(f"replica check: parameters compared across data-parallel replicas after step 1 and every "
                 f"{check_replicas_every} steps")
    lr_scheduler = lr_scheduler_cls(ctx.optimizer, **(lr_scheduler_args or {})) if lr_scheduler_cls else None

    # 4. data: the global batch is split over dp ranks and accumulation steps
    dataloader, accum, micro, global_bs = _build_data(dataset, dataloader_args, ctx.mesh, seed)

    step = TrainStep(
        model=ctx.model, optimizer=ctx.optimizer, loss_func=loss_func, device=device, grad_accum_steps=accum,
        max_grad_norm=max_grad_norm, lr_scheduler=lr_scheduler, loss_scaler=ctx.loss_scaler,
        model_input_format=model_input_format, prepare_input=prepare_input,
        # gradients and the loss's token counts are reduced over dp, or dp x cp under a sequence split
        dp_group=ctx.mesh.group(ctx.mesh.grad_view), dp_size=ctx.mesh.degree(ctx.mesh.grad_view),
        step_contexts=ctx.step_contexts, sequence_split=ctx.sequence_split,
        grad_norm_groups=ctx.grad_norm_groups, pre_step_hooks=ctx.pre_step_hooks,
        sync_every_microbatch=ctx.sync_every_microbatch,
    )
    res = AccelerateResult(
        model=ctx.model, optimizer=ctx.optimizer, dataloader=dataloader, loss_func=loss_func,
        lr_scheduler=lr_scheduler, strategy=strategy, mesh=ctx.mesh, train_step=step, grad_accum_steps=accum,
        micro_batch_size=micro, global_batch_size=global_bs, loss_scaler=ctx.loss_scaler, device=device,
        compute_dtype=ctx.autocast_dtype or ctx.param_dtype or torch.float32,
        notes=ctx.notes if searched is None else [*searched.notes, *ctx.notes], replica_monitor=monitor,
        search=None if searched is None else searched.search,
    )
    if analysis is not None:
        from .search.drift import attach

        res.prediction_check = attach(res, *analysis)
    return res


def _resolve_search(model, strategy, search, recipe):
    """``strategy="auto"`` / a plan file -> ``(strategy, dataloader_args, resolved)`` (``torchloom.search.auto``);
    anything else passes through with ``resolved=None``."""
    from .search.auto import resolve, wants_search

    if not wants_search(strategy):
        if search is not None:
            raise StrategyError("search=... options are read only with strategy='auto' (or a plan file written by "
                                f"the search); got strategy={strategy!r}. Drop search= or pass strategy='auto'.")
        return strategy, recipe["dataloader_args"], None
    if strategy == "auto" and has_annotations(model):
        raise StrategyError("strategy='auto' cannot be combined with torchloom.replicate/split annotations (they "
                            "give the strategy themselves); drop the annotations or pass strategy=None.")
    resolved = resolve(model, strategy, search, recipe=recipe)
    return resolved.strategy, resolved.dataloader_args, resolved


def plan_dims(strategy: StrategyLike, world_size: int) -> ParallelDims:
    """The mesh degrees ``auto_accelerate`` would use for ``strategy`` on ``world_size`` processes, without
    a process group or a model (for checks before launching).

    Raises:
        StrategyError: invalid strategy or degrees that do not fit ``world_size``.
    """
    strategy = Strategy.parse(strategy)
    ctx = AccelContext(model=nn.Module(), strategy=strategy, device=torch.device("cpu"))
    for m in strategy.ordered():
        m.configure(ctx)
    _default_dims(ctx)
    dims = ctx.dims.resolve(world_size)
    _check_dims_used(dims, strategy.ordered())
    return dims


def _check_arguments(optim_func, max_grad_norm, seed) -> None:
    """Cheap checks before anything distributed happens (a wrong value here would train silently wrong)."""
    if optim_func is None:
        raise ValueError("optim_func is required: pass an optimizer class such as torch.optim.AdamW.")
    if isinstance(optim_func, torch.optim.Optimizer):
        raise TypeError(
            f"optim_func must be an optimizer class or a factory `fn(params, **optim_args)`, not an optimizer instance "
            f"({type(optim_func).__name__}): the optimizer is built after sharding, over the sharded parameters. Pass "
            f"{type(optim_func).__name__} and its arguments in optim_args."
        )
    if not callable(optim_func):
        raise TypeError(f"optim_func must be callable (an optimizer class or factory), got {optim_func!r}.")
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not math.isfinite(
                max_grad_norm) or max_grad_norm <= 0:
            raise ValueError(
                f"max_grad_norm must be a positive finite number or None (no clipping), got {max_grad_norm!r}; a "
                "non-positive value would freeze or reverse the updates."
            )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}.")


def _check_dims_used(dims: ParallelDims, methods) -> None:
    """A degree > 1 on a dimension no method parallelises would silently duplicate work."""
    for dim in ("tp", "pp", "ep", "cp"):
        degree = getattr(dims, dim)
        if degree > 1 and not any(dim in type(m).mesh_dims for m in methods):
            raise StrategyError(
                f"parallel_mode sets {dim}={degree} but no method in the strategy parallelises the '{dim}' dimension "
                f"(the ranks would all compute the same thing); add the method for it or set {dim}=1."
            )


def _default_dims(ctx: AccelContext) -> None:
    """Data parallelism takes the rest of the world unless the user fixed it: nothing given -> the sharded
    dim (fsdp) or the replicated dim (else) is -1; only one of dp_replicate/dp_shard given -> the other is
    -1 when no dimension is -1 yet (so ``dp_replicate: 2`` with fsdp on 8 ranks is HSDP 2 x 4)."""
    d = ctx.dims
    c = ctx.strategy.config("parallel_mode")
    named = {k for k in ("dp", "dp_replicate", "dp_shard") if c is not None and getattr(c, k) is not None}
    if not named:
        if "fsdp" in ctx.strategy:
            d.dp_shard = -1
        else:
            d.dp_replicate = -1
        return
    if len(named) == 1 and "dp" not in named and -1 not in d.as_dict().values():
        other = "dp_shard" if "dp_replicate" in named else "dp_replicate"
        setattr(d, other, -1)


def _build_optimizer(optim_func, params, optim_args) -> torch.optim.Optimizer:
    """``optim_func(params, **optim_args)``; a list mixing DTensor and plain parameters (tensor parallelism
    leaves norms plain) gets ``foreach=False`` unless the user chose (the foreach kernels reject such lists)."""
    from .parallel.tensor.optim import foreach_safe_args

    optim_args, note = foreach_safe_args(optim_func, params, optim_args)
    if note:
        log.info(note)
    try:
        return optim_func(params, **optim_args)
    except TypeError as e:
        sig = ""
        try:
            sig = str(inspect.signature(optim_func))
        except (TypeError, ValueError):
            pass
        raise TypeError(f"could not build the optimizer with optim_args={optim_args}: {e}. Signature: {sig}") from e


def _build_data(dataset, dataloader_args, mesh: ParallelMesh, seed: int):
    args = dict(dataloader_args or {})
    global_bs = args.pop("batch_size", None)
    micro = args.pop("micro_batch_size", None)
    if dataset is None:
        if global_bs is None and micro is None:
            return None, 1, None, None
        plan = plan_batches(global_bs, micro, mesh.dp_size)
        return None, plan.grad_accum_steps, plan.micro_batch_size, plan.global_batch_size
    args.setdefault("seed", seed)
    loader = build_dataloader(
        dataset, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size, global_batch_size=global_bs,
        micro_batch_size=micro, **args,
    )
    return loader, loader.grad_accum_steps, loader.micro_batch_size, loader.global_batch_size

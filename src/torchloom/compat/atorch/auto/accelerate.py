"""ATorch's ``atorch.auto.accelerate``: ``auto_accelerate``, ``save_strategy``, ``get_strategy``,
``adjust_strategy``, translated onto :func:`torchloom.auto_accelerate` (docs/compat_atorch.md)."""
from __future__ import annotations

import collections
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from ....api import auto_accelerate as native_auto_accelerate
from ....api import plan_dims
from ....errors import StrategyError
from ..data import atorch_dataloader, data_to_device
from ..distributed.parallel_groups import set_current_mesh
from ..plain_loop import AmpNativeOptimizer, add_clip_grad_norm, cast_inputs, scaled_loss_func
from ..strategy_io import read_strategy_bytes, to_json
from ..strategy_map import EXPERT_DIMS, Translation, translate
from .strategy import SEMIAUTO_STRATEGIES, Strategy

log = logging.getLogger("torchloom.compat.atorch")

AutoAccelerateResult = collections.namedtuple(
    "AutoAccelerateResult",
    "model, optim, dataloader, loss_func, prepare_input, lr_scheduler, args",
)

#: ATorch's ``AutoAccelerateExtraArgs`` and the other keyword arguments its ``auto_accelerate`` reads.
_EXTRA_ARGS = ("find_unused_parameters", "sample_batch", "batch_size", "expand_sample_batch", "sampler_seed",
               "verbose", "time_limit", "ignore_dryrun_on_load_strategy", "meta_init_offload_name")

#: keyword arguments only the search reads (the semi-automatic run after it does not get them)
_SEARCH_ONLY = ("sample_batch", "batch_size", "expand_sample_batch", "time_limit")


# -- strategies -------------------------------------------------------------------------------------
def get_strategy(load_strategy):
    """ATorch's ``get_strategy``: ``(status, strategy)`` from a file name, bytes, a Strategy or a list of names
    / ``(name, config)`` pairs. Files written by :func:`save_strategy` are JSON; ATorch's pickled files and bytes
    are read by the restricted unpickler (:mod:`torchloom.compat.atorch.strategy_io`). On failure the reason is
    logged and ``(False, None)`` returned, as ATorch does."""
    try:
        return True, _load_strategy(load_strategy)
    except (OSError, StrategyError) as e:
        log.error("get_strategy: %s", e)
        return False, None


def _load_strategy(load_strategy) -> Strategy:
    if isinstance(load_strategy, (str, os.PathLike)):
        with open(load_strategy, "rb") as fp:
            return read_strategy_bytes(fp.read(), f"strategy file '{load_strategy}'")
    if isinstance(load_strategy, (bytes, bytearray)):
        return read_strategy_bytes(bytes(load_strategy), "strategy bytes")
    if isinstance(load_strategy, Strategy):
        return load_strategy
    if isinstance(load_strategy, list):
        strategy = Strategy()
        for item in load_strategy:
            if isinstance(item, str):
                strategy.add_opt((item, None, None))
            elif isinstance(item, (tuple, list)) and len(item) == 2:
                strategy.add_opt((item[0], item[1], item[0] in SEMIAUTO_STRATEGIES))
            elif isinstance(item, (tuple, list)) and len(item) == 3:
                strategy.add_opt(tuple(item))
            else:
                raise StrategyError(f"load_strategy list items are names, (name, config) or (name, config, tunable); "
                                    f"got {item!r:.120}.")
        return strategy
    raise StrategyError(f"load_strategy must be a file name, bytes, a Strategy or a list of methods; got "
                        f"{type(load_strategy).__name__}.")


def save_strategy(strategy, filename):
    """Write ``strategy`` to ``filename`` as JSON, whatever the file name (ATorch pickles; this never does).
    :func:`get_strategy` reads it back equal (torch dtypes, ``torch.nn`` classes and tuples kept; other
    module classes come back as their class names)."""
    if isinstance(strategy, list):
        strategy = _load_strategy(strategy)
    with open(filename, "w", encoding="utf-8") as fp:
        fp.write(to_json(strategy))


class DeviceContext:
    """The part of ATorch's device context ``adjust_strategy`` reads: nodes x processes per node."""

    def __init__(self, node_num: int = 1, nproc_per_node: int = 1):
        self.node_num = node_num
        self.nproc_per_node = nproc_per_node


def adjust_strategy(strategy, device_context, finetune_strategy=False, opt_lib=None):
    """ATorch's ``adjust_strategy``: fit ``parallel_mode``'s data degree to ``node_num * nproc_per_node``
    processes, drop distributed-only methods in one process, reset configs for ``finetune_strategy``, set
    ``tunable``. Returns ``(status, strategy)``; ``(False, None)`` (reason logged) when it cannot fit."""
    world = getattr(device_context, "node_num", 1) * getattr(device_context, "nproc_per_node", 1)
    try:
        return True, _adjust(strategy, world, finetune_strategy, opt_lib, distributed=_world_size() > 1)
    except StrategyError as e:
        log.error("adjust_strategy: %s", e)
        return False, None


def _adjust(strategy: Strategy, world: int, finetune: bool, opt_lib=None, distributed: bool | None = None,
            notes: list | None = None) -> Strategy:
    found, mode = strategy.get_parallel_mode()
    if mode is not None:
        total, data, has_data = 1, 1, False
        for name, size in mode[0]:
            if name in EXPERT_DIMS:
                continue  # carved out of the data-parallel ranks, not a factor of the world (strategy_map)
            total *= size
            if name == "data":
                data, has_data = size, True
        multi = mode[2] if len(mode) > 2 else False
        if total != world and not multi:
            if mode[1] is not None or not has_data:
                raise StrategyError(
                    f"parallel_mode {mode[0]} needs {total} processes, the job has {world}; only a 'data' degree can "
                    "be adjusted (and only without a custom rank order). Fix the degrees or add ('data', n)."
                )
            if world * data % total != 0:
                raise StrategyError(f"cannot fit parallel_mode {mode[0]} to {world} processes: the non-data degrees "
                                    f"({total // data}) must divide the world size.")
            strategy.adjust_data_parallel(world * data // total)
    elif found:
        strategy.adjust_data_parallel(world)
    if not (distributed if distributed is not None else world > 1):
        removed = strategy.remove_distributed_method(opt_lib)
        if removed:
            log.info("These distributed optimization methods are ignored in non-distributed case: %s", removed)
            if notes is not None:
                notes.append(f"These distributed optimization methods are ignored in non-distributed case: {removed}")
    if finetune:
        strategy.reset_config()
    strategy.set_tunable_value(opt_lib)
    return strategy


# -- auto_accelerate --------------------------------------------------------------------------------
def auto_accelerate(
    model,
    optim_func=None,
    dataset=None,
    loss_func=None,
    prepare_input=None,
    model_input_format=None,
    optim_args=None,
    optim_param_func=None,
    dataloader_args=None,
    distributed_sampler_cls=None,
    excluded=None,
    included=None,
    load_strategy=None,
    lr_scheduler_cls=None,
    lr_scheduler_args=None,
    finetune_strategy=False,
    save_strategy_to_file=None,
    **kargs,
):
    """ATorch's ``auto_accelerate`` (same parameters, order and defaults), applied by torchloom.

    ``load_strategy`` (a list of names or ``(name, config)`` pairs, a :class:`Strategy`, a file name or
    pickled bytes) is adjusted as ATorch does (``parallel_mode``'s data degree fitted to the world size;
    distributed-only methods dropped in one process), translated to torchloom methods
    (:mod:`torchloom.compat.atorch.strategy_map`) and applied by :func:`torchloom.auto_accelerate`.

    ``load_strategy=None`` (fully automatic): torchloom's strategy search chooses the strategy
    (:mod:`torchloom.compat.atorch.auto.automatic`: predicted by the cost model, the best confirmed by short real
    runs of deep copies of ``model``), honouring ``excluded`` / ``included`` (ATorch method names),
    ``time_limit`` (seconds for the whole search) and, without a dataset, ``sample_batch`` (+ ``batch_size``);
    then it is applied as a loaded strategy and returned as ``best_strategy``. As ATorch, it needs
    ``optim_func`` and a dataset or ``sample_batch`` (else ``(False, None, None)``, logged).

    ``dataloader_args["batch_size"]`` is the total batch over the data-parallel ranks, as in ATorch: each
    rank's DataLoader yields ``batch_size // dp`` samples (at least 1, with a warning when it does not
    divide, as ATorch); ``shuffle`` defaults to True with several data-parallel ranks and to the DataLoader's
    False in one, ``drop_last`` to False. ``kargs``: ATorch's ``sample_batch``, ``batch_size``,
    ``expand_sample_batch``, ``time_limit`` (read by the search only), ``sampler_seed``,
    ``find_unused_parameters``, ``verbose``, ``ignore_dryrun_on_load_strategy`` (no dry run here).

    Returns:
        ``(status, result, best_strategy)``: True, an ``AutoAccelerateResult(model, optim, dataloader,
        loss_func, prepare_input, lr_scheduler, args)`` for a plain training loop, and the adjusted strategy;
        ``(False, None, None)`` when the strategy cannot be loaded or fitted to the world size, or the search
        finds no strategy that fits (logged with the reason). After a search ``result.args["search"]`` holds
        the :class:`~torchloom.search.result.SearchResult`.

    Raises:
        StrategyError: a method or option without a counterpart (the message names it and the alternative); an
            unknown name in ``excluded``/``included`` or an included method the search does not choose.
        TypeError: an unknown keyword argument.
        ValueError: ``distributed_sampler_cls`` or ``meta_init_offload_name`` given (not supported).
    """
    unknown = sorted(set(kargs) - set(_EXTRA_ARGS))
    if unknown:
        raise TypeError(f"auto_accelerate() got unexpected keyword argument(s) {unknown}; ATorch's extra arguments "
                        f"are {list(_EXTRA_ARGS)}.")
    if kargs.get("meta_init_offload_name") is not None:
        raise ValueError("auto_accelerate(meta_init_offload_name=...) is not supported: a meta-device model is "
                         "materialised by torchloom (shard by shard under fsdp); remove the argument.")
    if distributed_sampler_cls is not None:
        raise ValueError(
            "auto_accelerate(distributed_sampler_cls=...) is not supported: torchloom's DataLoader uses its own "
            "resumable ElasticDistributedSampler (seed via sampler_seed=, shuffle via dataloader_args). Remove the "
            "argument, or build your own DataLoader and pass dataset=None."
        )
    assert model_input_format in (None, "unpack_sequence", "unpack_dict"), (  # ATorch asserts too
        f"model_input_format={model_input_format!r} is not valid; use None, 'unpack_sequence' or 'unpack_dict'.")
    if load_strategy is None:
        return _fully_automatic(model, optim_func, dataset, loss_func, prepare_input, model_input_format, optim_args,
                                optim_param_func, dataloader_args, excluded, included, lr_scheduler_cls,
                                lr_scheduler_args, save_strategy_to_file, kargs)
    notes: list[str] = []
    status, strategy = get_strategy(load_strategy)
    if not status:
        log.error("Error in loading strategy.")
        return False, None, None
    world = _world_size()
    if world == 1 and not finetune_strategy:
        # one process drops the distributed-only methods (as ATorch); check their options all the same, so a
        # typo fails here as it does on several ranks
        from .strategy import distributed_only

        translate(Strategy([tuple(i) for i in strategy if isinstance(i, (tuple, list)) and len(i) == 3
                            and distributed_only(i[0], i[1])]), 2)
    try:
        strategy = _adjust(strategy, world, finetune_strategy, notes=notes)
    except StrategyError as e:
        log.error("Loaded strategy is not consistent with the job: %s", e)
        return False, None, None
    _note_search_only(kargs, excluded, included, finetune_strategy, notes)
    plan = translate(strategy, world)
    notes.extend(plan.notes)
    native_strategy = _native_methods(plan, optim_func, kargs, world, notes)
    # tunable methods were "tuned": torchloom plans tensor/pipeline splits itself (ATorch marks them done)
    for idx, (name, config, tunable) in enumerate(list(strategy)):
        if tunable:
            strategy[idx] = (name, config, False)
    if save_strategy_to_file:
        save_strategy(strategy, save_strategy_to_file)

    native_strategy = _drop_absent_classes(model, native_strategy, notes)
    if plan.limited_checkpoint is not None:
        names, limit = plan.limited_checkpoint
        present = {type(m).__name__ for m in model.modules()}
        _checkpoint_first_blocks(model, [n for n in names if n in present], limit, notes)
    user_prepare = prepare_input if prepare_input is not None else data_to_device
    dl_args = _dataloader_args(dataloader_args, dataset, native_strategy, world, kargs)
    res = native_auto_accelerate(
        model,
        _optimizer_factory(model, optim_func, optim_param_func),
        dataset,
        loss_func,
        native_strategy,
        optim_args=optim_args,
        dataloader_args=dl_args,
        model_input_format=model_input_format,
        prepare_input=user_prepare,
        lr_scheduler_cls=lr_scheduler_cls if optim_func is not None else None,
        lr_scheduler_args=lr_scheduler_args,
    )
    notes.extend(res.notes)
    set_current_mesh(res.mesh)
    for n in notes:
        (log.info if kargs.get("verbose") else log.debug)("auto_accelerate: %s", n)

    dataloader = res.dataloader
    if dataset is not None and not dl_args["drop_last"] and not isinstance(dataset, torch.utils.data.IterableDataset):
        # torchloom's sampler fills the last batch with repeated samples; ATorch's DataLoader does not
        extra = {k: v for k, v in dl_args.items() if k not in ("batch_size", "micro_batch_size", "shuffle",
                                                                "drop_last", "seed")}
        dataloader = atorch_dataloader(dataset, dp_rank=res.mesh.dp_rank, dp_size=res.mesh.dp_size,
                                       micro_batch_size=dl_args["micro_batch_size"], shuffle=dl_args["shuffle"],
                                       seed=dl_args["seed"], drop_last=False, **extra)
    optim = res.optimizer if optim_func is not None else None
    out_loss = loss_func
    scaler = res.loss_scaler
    if plan.skip_if_nonfinite and scaler is None:
        from ....parallel.loss_scaler import DynamicLossScaler

        scaler = DynamicLossScaler(init_scale=1.0, growth_factor=1.0, backoff_factor=1.0, min_scale=0.0)
    if scaler is not None and optim is not None and loss_func is not None:
        optim = AmpNativeOptimizer(optim, scaler)
        out_loss = scaled_loss_func(loss_func, scaler) if res.loss_scaler is not None else loss_func
    if any((m if isinstance(m, str) else m[0]) == "fsdp" for m in native_strategy):
        add_clip_grad_norm(res.model)  # ATorch's FSDP model.clip_grad_norm_
    out_prepare = cast_inputs(user_prepare, plan.input_dtype) if plan.input_dtype is not None else user_prepare
    args = {"use_optim_backward": False, "requires_set_gradient_accumulation_boundary": False,
            "torchloom_result": res, "notes": notes}
    log.info("Load strategy successfully and ready for use.\n%s", strategy)
    return True, AutoAccelerateResult(res.model, optim, dataloader, out_loss, out_prepare, res.lr_scheduler,
                                      args), strategy


def _fully_automatic(model, optim_func, dataset, loss_func, prepare_input, model_input_format, optim_args,
                     optim_param_func, dataloader_args, excluded, included, lr_scheduler_cls, lr_scheduler_args,
                     save_strategy_to_file, kargs):
    """``load_strategy=None``: search (every rank), then apply the found strategy as a loaded one."""
    from .automatic import run_search, search_options

    missing = [n for n, bad in (("optim_func", optim_func is None),
                                ("a dataset or sample_batch", dataset is None and kargs.get("sample_batch") is None))
               if bad]
    if missing:  # ATorch refuses the same (its engine dry-runs training steps)
        log.error("`load_strategy` should not be None: the automatic search trains candidate strategies and needs "
                  "%s; pass them, or a load_strategy.", " and ".join(missing))
        return False, None, None
    options, notes = search_options(excluded, included, kargs.get("time_limit"))
    if optim_param_func is not None:
        notes.append("search trials: the optimizer gets the model's parameters without optim_param_func's groups "
                     "(the trials train copies of the model); the final run uses optim_param_func")
    user_prepare = prepare_input if prepare_input is not None else data_to_device
    try:
        found, result = run_search(model, optim_func=optim_func, optim_args=optim_args, dataset=dataset,
                                   loss_func=loss_func, prepare_input=user_prepare,
                                   model_input_format=model_input_format, dataloader_args=dataloader_args,
                                   sample_batch=kargs.get("sample_batch"), options=options, kargs=kargs)
    except StrategyError as e:
        log.error("auto_accelerate cannot find a valid strategy to train model! %s", e)
        return False, None, None
    notes.extend(result.notes)
    log.info("auto_accelerate: the search chose %s (%s)\n%s", result.chosen.label(), result.chosen_by, found)
    rest = {k: v for k, v in kargs.items() if k not in _SEARCH_ONLY}
    status, res, strategy = auto_accelerate(
        model, optim_func, dataset, loss_func, prepare_input, model_input_format, optim_args, optim_param_func,
        dataloader_args, load_strategy=found, lr_scheduler_cls=lr_scheduler_cls,
        lr_scheduler_args=lr_scheduler_args, save_strategy_to_file=save_strategy_to_file, **rest)
    if status:
        res.args["search"] = result
        res.args["notes"] = notes + res.args["notes"]
    return status, res, strategy


def _world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def _note_search_only(kargs, excluded, included, finetune, notes) -> None:
    for key in ("sample_batch", "batch_size", "expand_sample_batch", "time_limit"):
        if kargs.get(key) is not None:
            notes.append(f"{key} is used by ATorch's dry run and search only; accepted and unused (no dry run here)")
    if kargs.get("ignore_dryrun_on_load_strategy", True) is False:
        notes.append("ignore_dryrun_on_load_strategy=False: torchloom has no dry run; the strategy is applied directly")
    if excluded or included:
        notes.append("excluded/included choose methods for ATorch's search; with load_strategy they change nothing")
    if finetune:
        notes.append("finetune_strategy: configs reset to their defaults (parallel_mode kept); torchloom has no "
                     "tuning search, so the defaults are used")


def _native_methods(plan: Translation, optim_func, kargs, world: int, notes: list) -> list:
    methods = list(plan.methods)
    if optim_func is None and "zero1" in methods:
        methods.remove("zero1")
        notes.append("zero1 skipped: no optim_func (as ATorch)")
    if kargs.get("find_unused_parameters"):
        names = [m if isinstance(m, str) else m[0] for m in methods]
        if "ddp" in names:
            i = names.index("ddp")
            methods[i] = ("ddp", {"find_unused_parameters": True})
        elif "fsdp" not in names and world > 1:
            methods.append(("ddp", {"find_unused_parameters": True}))
    return methods


def _optimizer_factory(model, optim_func, optim_param_func):
    """torchloom builds the optimizer after sharding, calling ``factory(params, **optim_args)``; ATorch's
    ``optim_param_func(model)`` gives parameter groups of the (transformed) model instead."""
    if optim_func is None:
        # torchloom always builds an optimizer; ATorch returns optim=None without optim_func: a placeholder
        # SGD(lr=0) keeps no state and is not returned
        return lambda params, **_: torch.optim.SGD(params, lr=0.0)
    if optim_param_func is None:
        return optim_func

    def factory(params, **optim_args):
        groups = _as_groups(optim_param_func(model))
        allowed = {id(p) for p in params}
        for g in groups:
            stray = [p for p in g["params"] if id(p) not in allowed and p.requires_grad]
            if stray:
                raise StrategyError(
                    "optim_param_func(model) returned parameters that are not the model's trained parameters after "
                    "the strategy was applied (a pipeline split or a module replaced by a copy): build the groups "
                    "from the model passed to optim_param_func, or drop optim_param_func."
                )
        return optim_func(groups, **optim_args)

    return factory


def _as_groups(groups) -> list[dict]:
    """``optim_param_func``'s result as a list of groups with parameter lists (generators such as
    ``model.base.parameters()`` are read once here)."""
    if isinstance(groups, torch.Tensor):
        groups = [groups]
    items = list(groups)
    if items and not isinstance(items[0], dict):
        return [{"params": items}]
    out = []
    for g in items:
        ps = g["params"]
        out.append({**g, "params": [ps] if isinstance(ps, torch.Tensor) else list(ps)})
    return out


def _dataloader_args(dataloader_args, dataset, native_strategy, world: int, kargs) -> dict[str, Any] | None:
    """ATorch's DataLoader arguments -> torchloom's (total batch -> global batch, per-rank micro batch)."""
    if dataset is None:
        return dataloader_args  # torchloom derives the batch arithmetic; there is no loader to build
    args = dict(dataloader_args or {})
    dp = plan_dims(native_strategy, world).dp
    given = "batch_size" in args
    total = args.pop("batch_size", 1)  # torch's DataLoader default
    micro = max(total // dp, 1)
    if micro * dp != total and given:  # ATorch logs nothing when no batch_size was given
        log.warning("Batchsize=%s is not a multiple of data parallel size %s, adjusted to %s.", total, dp, micro * dp)
    args["batch_size"] = micro * dp
    args["micro_batch_size"] = micro
    args.setdefault("shuffle", dp > 1)
    args.setdefault("drop_last", False)
    args["seed"] = kargs.get("sampler_seed", 0) or 0
    return args


def _drop_absent_classes(model, methods: list, notes: list) -> list:
    """ATorch resolves class names against the model and silently drops those that do not occur in it
    (``to_module_class_by_name``); torchloom raises. Do as ATorch, with a warning: a checkpoint left with no
    class is dropped, an fsdp ``wrap_cls`` left empty falls back to the repeated blocks."""
    import warnings

    present = {type(m).__name__ for m in model.modules()}
    out = []
    for m in methods:
        if isinstance(m, tuple) and m[0] in ("checkpoint", "fsdp") and m[1].get("wrap_cls"):
            absent = [c for c in m[1]["wrap_cls"] if c not in present]
            if absent:
                kept = [c for c in m[1]["wrap_cls"] if c in present]
                msg = (f"{m[0]}: module class(es) {absent} do not occur in {type(model).__name__}; ignored as ATorch "
                       "does" + ("" if kept else (": nothing is checkpointed" if m[0] == "checkpoint"
                                                  else ": the repeated blocks are the FSDP units")))
                warnings.warn(msg, UserWarning, stacklevel=3)
                notes.append(msg)
                config = dict(m[1])
                if kept:
                    config["wrap_cls"] = kept
                else:
                    config.pop("wrap_cls")
                    if m[0] == "checkpoint":
                        continue
                m = (m[0], config)
        out.append(m)
    return out


def _checkpoint_first_blocks(model, class_names, limit: int, notes: list) -> None:
    """ATorch's ``max_checkpoint_module_num``: checkpoint only the first ``limit`` matching blocks."""
    from ....methods.activation_checkpoint import checkpoint_module
    from ....parallel.blocks import find_blocks

    blocks = find_blocks(model, class_names)
    for _, block in blocks[:limit]:
        checkpoint_module(block)
    notes.append(f"checkpoint: max_checkpoint_module_num={limit}, checkpointed {min(limit, len(blocks))} of "
                 f"{len(blocks)} {class_names} blocks")

"""ATorch strategy items -> torchloom native strategy methods.

:func:`translate` reads an adjusted ATorch :class:`~torchloom.compat.atorch.auto.strategy.Strategy` (triples)
and returns a :class:`Translation`: the native method list for :func:`torchloom.auto_accelerate`, what the
compat layer does around it (ATorch's fp16 loss scaling in a plain training loop, ``half``'s input cast,
``max_checkpoint_module_num``) and one note per ATorch option that has no counterpart. Every option the
table below does not name is a :class:`~torchloom.errors.StrategyError` naming the option and what to use.
docs/compat_atorch.md lists the mapping.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import StrategyError

_DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", torch.float16: "float16", torch.bfloat16: "bfloat16",
                "float16": "float16", "bfloat16": "bfloat16"}
# ATorch parallel_mode dimension names torchloom's parallel_mode reads (torchloom/methods/parallel_mode.py)
_PARALLEL_DIMS = ("data", "tensor", "model", "pipeline", "pipe", "zero", "fsdp", "shard", "replicate", "expert",
                  "expert_fsdp", "sequence")
#: ATorch's expert groups (atorch.modules.moe / create_parallel_group([("expert", ep), ("expert_fsdp", edp)])):
#: ep is carved out of the data-parallel ranks (ep x edp = data), so these are not factors of the world size
EXPERT_DIMS = ("expert", "expert_fsdp")


@dataclass
class Translation:
    """The native strategy and the compat-side extras of one ATorch strategy."""

    methods: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: amp_native fp16: ATorch's plain-loop loss scaling (result.loss_func scales, result.optim unscales/skips)
    loss_scaling: bool = False
    #: amp_native bf16 with skip_if_nonfinite: skip steps whose gradients hold inf/NaN, no scaling
    skip_if_nonfinite: bool = False
    #: half: ATorch casts the floating inputs to this dtype in prepare_input
    input_dtype: torch.dtype | None = None
    #: checkpoint with max_checkpoint_module_num: (class names, max) applied by the compat layer
    limited_checkpoint: tuple[list[str] | None, int] | None = None
    #: data-parallel degree asked by parallel_mode (None: the rest of the world)
    find_unused_parameters: bool = False


def class_names(value: Any, option: str) -> list[str]:
    """A module class, a class name, or a tuple/list of them -> class names (torchloom matches by name)."""
    items = value if isinstance(value, (tuple, list, set, frozenset)) else (value,)
    out = []
    for c in items:
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, type):
            out.append(c.__name__)
        else:
            raise StrategyError(f"ATorch option {option}: expected module classes or class names, got {c!r:.80}.")
    return out


def _dtype_name(value: Any, option: str) -> str:
    if value not in _DTYPE_NAMES:
        raise StrategyError(f"ATorch option {option}={value!r} is not supported: use 'fp16', 'bf16', torch.float16 "
                            "or torch.bfloat16.")
    return _DTYPE_NAMES[value]


def _check_dict(name: str, config: Any) -> dict:
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise StrategyError(f"ATorch method '{name}' takes a dict config (or None); got {config!r:.120}.")
    return dict(config)


def _reject_unknown(name: str, config: dict, known: set[str], hint: str) -> None:
    unknown = sorted(set(config) - known)
    if unknown:
        raise StrategyError(
            f"ATorch method '{name}': option(s) {unknown} are not supported by torchloom.compat.atorch. "
            f"Supported: {sorted(known)}. {hint}"
        )


# -- per-method translations ------------------------------------------------------------------------
def _amp_native(config, t: Translation) -> None:
    c = _check_dict("amp_native", config)
    _reject_unknown("amp_native", c, {"enabled", "dtype", "skip_if_nonfinite", "cache_enabled"},
                    "Other torch.autocast arguments have no counterpart.")
    if c.get("enabled", True) is False:
        t.notes.append("amp_native: enabled=False, so mixed precision is off (ATorch's autocast(enabled=False))")
        return
    dtype = _dtype_name(c.get("dtype", "fp16") if c.get("dtype") is not None else "fp16", "amp_native dtype")
    if "cache_enabled" in c:
        t.notes.append("amp_native: cache_enabled is accepted and ignored (torch.autocast's default weight-cast cache)")
    t.methods.append(("amp", {"dtype": dtype}))
    if dtype == "float16":
        t.loss_scaling = True
        if c.get("skip_if_nonfinite") is not None:
            t.notes.append("amp_native: fp16 always skips steps with inf/NaN gradients (dynamic loss scaling); "
                           "skip_if_nonfinite changes nothing")
    elif c.get("skip_if_nonfinite", False):
        t.skip_if_nonfinite = True


def _half(config, t: Translation) -> None:
    if config is None:
        t.notes.append("half: no dtype given, fp16 used (ATorch's default dtype for half)")
        config = "fp16"
    if config not in ("fp16", "bf16"):
        raise StrategyError(f"ATorch method 'half' takes 'fp16' or 'bf16'; got {config!r}. For mixed precision "
                            "with fp32 master weights use ('amp_native', {'dtype': 'bf16'}).")
    dtype = _DTYPE_NAMES[config]
    t.methods.append(("half", {"dtype": dtype}))
    t.input_dtype = getattr(torch, dtype)


def _checkpoint(config, t: Translation) -> None:
    if config is None:
        t.methods.append("checkpoint")
        t.notes.append("checkpoint: no wrap_class given, the model's repeated blocks are checkpointed")
        return
    if not isinstance(config, dict):
        t.methods.append(("checkpoint", {"wrap_cls": class_names(config, "checkpoint")}))
        return
    c = dict(config)
    for bad, instead in (("use_te_impl", "remove it (TransformerEngine's checkpoint is not used)"),
                         ("selective_offload", "remove it; torchloom checkpoints whole blocks")):
        if c.get(bad):
            raise StrategyError(f"ATorch checkpoint option '{bad}' is not supported: {instead}.")
        c.pop(bad, None)
    _reject_unknown("checkpoint", c, {"wrap_class", "no_reentrant", "max_checkpoint_module_num"},
                    "Use wrap_class (a class, a class name or a tuple of them).")
    if "wrap_class" not in c:
        raise StrategyError("ATorch checkpoint dict config needs 'wrap_class' (a module class, a class name or a "
                            "tuple of them), e.g. ('checkpoint', {'wrap_class': (GPT2Block,)}).")
    names = class_names(c["wrap_class"], "checkpoint wrap_class")
    if c.get("no_reentrant") is not True:
        t.notes.append("checkpoint: torchloom always uses non-reentrant checkpointing (same gradients; "
                       f"no_reentrant={c.get('no_reentrant')!r} asked for the reentrant one)")
    limit = c.get("max_checkpoint_module_num")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise StrategyError(f"ATorch checkpoint max_checkpoint_module_num must be an int >= 0, got {limit!r}.")
        t.limited_checkpoint = (names, limit)
        return
    t.methods.append(("checkpoint", {"wrap_cls": names}))


_FSDP_NOTES = {
    "limit_all_gathers": "FSDP2 limits in-flight all-gathers by design (no rate limiter option)",
    "forward_prefetch": "FSDP2 prefetches the next unit's all-gather implicitly",
    "backward_prefetch": "FSDP2 prefetches in backward implicitly",
    "use_orig_params": "FSDP2 always keeps the original parameters (as DTensor shards)",
    "wrap_trainable_outmost": "units are the model's repeated blocks (or atorch_wrap_cls)",
    "atorch_size_based_min_num_params": "units are the model's repeated blocks (or atorch_wrap_cls), not chosen "
                                        "by parameter count",
}
_FSDP_KNOWN = {"sync_module_states", "cpu_offload", "atorch_wrap_cls", "sharding_strategy", "mixed_precision",
               "reshard_after_forward", *_FSDP_NOTES}


def _fsdp(name: str, config, t: Translation, zero2: bool = False) -> None:
    c = _check_dict(name, config)
    if c.get("use_ds_zero"):
        raise StrategyError(f"ATorch {name} option use_ds_zero (DeepSpeed ZeRO) is not supported: remove it; "
                            f"torchloom's {name} is FSDP2.")
    c.pop("use_ds_zero", None)
    if zero2 and c.pop("not_use_fsdp", False):
        t.notes.append("zero2: not_use_fsdp (fairscale ShardedDDP) is not used; FSDP2 with "
                       "reshard_after_forward=False gives the same ZeRO-2 sharding")
    if c.get("atorch_ignored_cls"):
        raise StrategyError(
            f"ATorch {name} option atorch_ignored_cls is not supported: FSDP1 leaves those modules unsharded and "
            "does not synchronise their gradients, which FSDP2 here cannot reproduce. Remove it (the modules are "
            "then sharded with the rest) or use ddp for the whole model."
        )
    c.pop("atorch_ignored_cls", None)
    _reject_unknown(name, c, _FSDP_KNOWN, "See docs/compat_atorch.md for the FSDP option table.")
    out: dict[str, Any] = {}
    if zero2:
        out["reshard_after_forward"] = False
    for key, why in _FSDP_NOTES.items():
        if key in c:
            t.notes.append(f"{name}: {key}={c[key]!r} accepted with no effect: {why}")
    if "sync_module_states" in c:
        out["sync_module_states"] = bool(c["sync_module_states"])
    if "cpu_offload" in c:
        out["cpu_offload"] = bool(c["cpu_offload"]) if isinstance(c["cpu_offload"], bool) else True
    if c.get("atorch_wrap_cls") is not None:
        out["wrap_cls"] = class_names(c["atorch_wrap_cls"], f"{name} atorch_wrap_cls")
    if "reshard_after_forward" in c:
        out["reshard_after_forward"] = bool(c["reshard_after_forward"])
    if "sharding_strategy" in c:
        out.update(_sharding_strategy(name, c["sharding_strategy"]))
    if c.get("mixed_precision") is not None:
        out.update(_mixed_precision(name, c["mixed_precision"]))
    t.methods.append(("fsdp", out))


def _sharding_strategy(name: str, value) -> dict:
    s = getattr(value, "name", value)
    if s == "FULL_SHARD":
        return {"reshard_after_forward": True}
    if s == "SHARD_GRAD_OP":
        return {"reshard_after_forward": False}
    raise StrategyError(
        f"ATorch {name} sharding_strategy={s!r} is not supported: use FULL_SHARD or SHARD_GRAD_OP (HYBRID_SHARD: "
        "give parallel_mode ([('replicate', r), ('zero', s)], None) with fsdp; NO_SHARD: use parallel_mode data "
        "parallel without fsdp, which is DDP)."
    )


def _mixed_precision(name: str, mp) -> dict:
    fields = mp if isinstance(mp, dict) else {k: getattr(mp, k, None) for k in ("param_dtype", "reduce_dtype",
                                                                                "buffer_dtype")}
    if fields.get("param_dtype") is not None:
        raise StrategyError(
            f"ATorch {name} mixed_precision param_dtype is not supported here: add ('amp_native', {{'dtype': "
            "'bf16'}) to the strategy (with fsdp it becomes FSDP2's MixedPrecisionPolicy)."
        )
    if fields.get("buffer_dtype") is not None:
        raise StrategyError(f"ATorch {name} mixed_precision buffer_dtype is not supported: buffers stay fp32; "
                            "remove it.")
    rd = fields.get("reduce_dtype")
    if rd is None:
        return {}
    if rd in (torch.float32, "fp32", "float32"):
        return {"reduce_dtype": "float32"}  # FSDP2 MixedPrecisionPolicy(reduce_dtype=float32): native fsdp's default
    return {"reduce_dtype": _dtype_name(rd, f"{name} mixed_precision reduce_dtype")}


def _sequence_parallel(config, t: Translation) -> None:
    """ATorch's ``sequence_parallel`` is Ulysses-style (an all-to-all that swaps the sequence shard for a head
    shard around attention): torchloom's ``ulysses`` method. Its degree comes from the config (``size``,
    ``sp_size``, ``sequence_parallel_size``) or from parallel_mode's ``("sequence", n)``."""
    c = {} if config is None else dict(_check_dict("sequence_parallel", config))
    size = None
    for key in ("size", "sp_size", "sequence_parallel_size", "degree"):
        if key in c:
            size = int(c.pop(key))
    causal = c.pop("causal", True)
    split_fn = c.pop("batch_sp_processing_fn", None)
    _reject_unknown("sequence_parallel", c, {"size", "sp_size", "causal", "batch_sp_processing_fn"},
                    "give its degree as size (or ('sequence', n) in parallel_mode).")
    if split_fn is not None:
        t.notes.append("sequence_parallel: batch_sp_processing_fn is not called: torchloom splits every mapping batch "
                       "itself (labels shifted over the whole sequence first, position ids kept global; "
                       "docs/methods/context_parallel.md)")
    t.methods.append(("ulysses", {**({"size": size} if size is not None else {}), "causal": bool(causal)}))
    t.notes.append("sequence_parallel: Ulysses all-to-all sequence parallelism (torchloom's ulysses method; "
                   "FSDP shards over data x sequence)")


def _zero1(config, t: Translation) -> None:
    c = _check_dict("zero1", config)
    if c.get("use_ds_zero"):
        raise StrategyError("ATorch zero1 option use_ds_zero (DeepSpeed ZeRO) is not supported: remove it; torchloom's "
                            "zero1 is torch's ZeroRedundancyOptimizer over ddp.")
    c.pop("use_ds_zero", None)
    _reject_unknown("zero1", c, set(), "zero1 has no options here.")
    t.methods.append("zero1")


def _parallel_mode(config, world_size: int, t: Translation) -> None:
    if config is None:
        return  # adjust_data_parallel filled it in before translation; None means data over the world
    dims, rank_order = config[0], config[1] if len(config) > 1 else None
    if rank_order is not None and list(rank_order) != list(range(world_size)):
        raise StrategyError(f"ATorch parallel_mode rank order {rank_order!r} is not supported: torchloom builds the "
                            "mesh in rank order; give None as the second item.")
    if len(config) > 2 and config[2]:
        raise StrategyError("ATorch parallel_mode support_multi_parallel_instance is not supported; remove the "
                            "third item.")
    out: dict[str, int] = {}
    for name, size in dims:
        if name not in _PARALLEL_DIMS:
            raise StrategyError(f"ATorch parallel_mode dimension '{name}' is not supported; use one of "
                                f"{', '.join(_PARALLEL_DIMS)}.")
        out[name] = int(size)
    edp = out.pop("expert_fsdp", None)
    t.methods.append(("parallel_mode", out))
    _expert(out, edp, world_size, t)


def _expert(dims: dict[str, int], edp: int | None, world_size: int, t: Translation) -> None:
    """``("expert", ep)``: expert parallel over ``ep`` of the data-parallel ranks (torchloom's layout, and
    ATorch's ``set_experts_process_group``: consecutive ranks hold different experts); ``("expert_fsdp", n)``
    names the remaining expert-data-parallel degree, which must be data / ep."""
    ep = dims.get("expert", 1)
    if edp is not None and ep == 1:
        raise StrategyError(f"ATorch parallel_mode ('expert_fsdp', {edp}) needs an ('expert', n) degree > 1 beside it; "
                            "add ('expert', n) or remove expert_fsdp.")
    if ep == 1:
        return
    dp = dims.get("data") or (dims.get("replicate", 1) * dims.get("zero", dims.get("fsdp", dims.get("shard", 1))))
    if dp % ep:
        raise StrategyError(
            f"ATorch parallel_mode ('expert', {ep}): the expert-parallel ranks are carved out of the data-parallel "
            f"ranks (data = expert x expert_fsdp), so ep must divide the data degree {dp}; choose ep among "
            f"{[k for k in range(2, dp + 1) if dp % k == 0] or 'none (data degree 1)'} or raise the data degree.")
    if edp is not None and edp != dp // ep:
        raise StrategyError(
            f"ATorch parallel_mode ('expert_fsdp', {edp}) does not match ('expert', {ep}) on data degree {dp}: the "
            f"expert-data-parallel degree is data / expert = {dp // ep}. Give ('expert_fsdp', {dp // ep}) or leave "
            "it out (it is derived).")
    t.methods.append("expert_parallel")
    t.notes.append(f"parallel_mode: ('expert', {ep}) is expert parallelism over {ep} of the {dp} data-parallel ranks "
                   f"(expert_fsdp = {dp // ep}), not a factor of the world size: the dense layers stay data parallel "
                   f"over all {dp} ranks; expert_parallel shards the experts modules")


_UNSUPPORTED = {
    "fp8": "use ('amp_native', {'dtype': 'bf16'})",
    "mixed_parallel": "use parallel_mode with tensor_parallel and pipeline_parallel",
    "deepspeed_3d_parallel": "use parallel_mode with tensor_parallel, pipeline_parallel and fsdp",
    "ds_zero": "use zero2 or fsdp",
}


def translate(strategy, world_size: int) -> Translation:
    """The native strategy of an ATorch strategy already adjusted to ``world_size``.

    Raises:
        StrategyError: an unknown method, a method without a counterpart, or an unsupported option
            (each message names the ATorch option and what to use instead).
    """
    t = Translation()
    for item in strategy:
        if not isinstance(item, (tuple, list)) or len(item) != 3:
            raise StrategyError(f"ATorch strategy items are (name, config, tunable); got {item!r:.120}.")
        name, config, _ = item
        if name == "parallel_mode":
            _parallel_mode(config, world_size, t)
        elif name == "amp_native":
            _amp_native(config, t)
        elif name == "half":
            _half(config, t)
        elif name == "checkpoint":
            _checkpoint(config, t)
        elif name in ("fsdp", "fsdp2"):
            _fsdp(name, config, t)
        elif name == "zero2":
            _fsdp("zero2", config, t, zero2=True)
        elif name == "zero1":
            _zero1(config, t)
        elif name == "auto_ddp":
            _check_dict("auto_ddp", config)
            t.methods.append("ddp")
            t.notes.append("auto_ddp: DDP over the data-parallel ranks")
        elif name == "module_replace":
            if config is not None:
                raise StrategyError("ATorch module_replace config is not supported: give ('module_replace', None); "
                                    "torchloom replaces the modules it has fused versions of.")
            t.methods.append("module_replace")
        elif name == "native_dynamo":
            if config is not None:
                raise StrategyError("ATorch native_dynamo config is not supported: give ('native_dynamo', None) or "
                                    "use torchloom's ('compile', {...}).")
            t.methods.append("compile")
        elif name in ("tensor_parallel", "pipeline_parallel"):
            if config is not None:
                raise StrategyError(
                    f"ATorch {name} config {config!r:.80} is not supported: give ('{name}', None) with its degree in "
                    "parallel_mode; torchloom plans the split itself (docs/methods/).")
            t.methods.append(name)
        elif name == "sequence_parallel":
            _sequence_parallel(config, t)
        elif name in _UNSUPPORTED:
            raise StrategyError(f"ATorch method '{name}' is not supported by torchloom.compat.atorch: "
                                f"{_UNSUPPORTED[name]}.")
        else:
            raise StrategyError(
                f"unknown ATorch method '{name}'. Supported: parallel_mode, amp_native, half, checkpoint, fsdp, "
                "fsdp2, zero1, zero2, auto_ddp, module_replace, native_dynamo, tensor_parallel, pipeline_parallel, "
                "sequence_parallel."
            )
    return t

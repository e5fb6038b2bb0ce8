"""ATorch's fully automatic mode (``auto_accelerate(..., load_strategy=None)``) on torchloom's strategy search.

ATorch's engine dry-runs data-parallel combinations chosen by Bayesian optimisation. Here the search of
issue [7] does the work (:func:`torchloom.search.search.search`: enumerate, prune by memory, rank by the
calibrated cost model, confirm the best with short real runs, :mod:`torchloom.search.runner`), restricted to
what an ATorch strategy can say and an ATorch training loop can run:

- every candidate must have an ATorch form that :func:`~torchloom.compat.atorch.strategy_map.translate`
  turns back into exactly the candidate's methods and degrees (:func:`to_atorch`); others (pipeline
  schedules, sequence parallel, checkpointing every k-th block, user methods) are left out;
- no gradient accumulation: ATorch's loop steps the optimizer once per batch of ``batch_size / dp``.

The chosen candidate is returned as an ATorch :class:`Strategy` and applied through the semi-automatic path
(``load_strategy=<it>``), so ``best_strategy`` can be saved and loaded again as in ATorch. ``excluded`` /
``included`` take ATorch method names (:data:`SEARCH_NAMES`), ``time_limit`` (seconds) bounds the whole
search, ``sample_batch`` (+ ``batch_size``) trains the trials when there is no dataset.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate

from ....errors import StrategyError
from ....search.candidate import Candidate
from ..strategy_map import translate
from .strategy import Strategy

#: ATorch method names -> the search's vocabulary (torchloom.search.options); None: not searched
SEARCH_NAMES: dict[str, str | None] = {
    "parallel_mode": None, "auto_ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "fsdp": "fsdp",
    "fsdp2": "fsdp", "amp_native": "amp", "checkpoint": "checkpoint", "tensor_parallel": "tensor_parallel",
    "pipeline_parallel": "pipeline_parallel", "half": None, "module_replace": None, "native_dynamo": None,
    "fp8": None, "mixed_parallel": None, "deepspeed_3d_parallel": None, "sequence_parallel": None,
    "ds_zero": None, "amp_apex_o1": None, "amp_apex_o2": None,
}


def search_options(excluded, included, time_limit) -> tuple[dict[str, Any], list[str]]:
    """ATorch's ``excluded`` / ``included`` / ``time_limit`` as a ``search={...}`` dict, and notes.

    Raises:
        StrategyError: an unknown ATorch method name, or an ``included`` method the search does not choose.
    """
    notes: list[str] = []
    opts: dict[str, Any] = {"exclude": ["sequence_parallel", "pipeline_parallel"]}
    for key, names in (("exclude", excluded), ("include", included)):
        for name in names or ():
            if name not in SEARCH_NAMES:
                raise StrategyError(f"{key}d method '{name}' is not an ATorch method name; known: "
                                    f"{', '.join(SEARCH_NAMES)}.")
            mapped = SEARCH_NAMES[name]
            if mapped is None:
                if key == "include":
                    raise StrategyError(f"included method '{name}' is not chosen by torchloom's search; give it in "
                                        f"load_strategy instead (semi-automatic mode), or drop it from included.")
                notes.append(f"excluded '{name}': torchloom's search never chooses it")
                continue
            if key == "include" and mapped == "pipeline_parallel":
                raise StrategyError("included 'pipeline_parallel': ATorch's training loop runs forward and "
                                    "backward itself, torchloom's pipeline schedule runs them in train_step; use "
                                    "torchloom.auto_accelerate(strategy='auto') for pipelined plans.")
            if mapped not in opts.setdefault(key, []):
                opts[key].append(mapped)
    if time_limit is not None:
        opts["time_limit_s"] = float(time_limit)
    return opts, notes


def to_atorch(cand: Candidate, world_size: int) -> Strategy | None:
    """The ATorch strategy that :func:`translate` turns into exactly ``cand``'s methods and mesh degrees, or
    None when there is none (a pipeline schedule, sequence parallel, checkpointing every k-th block, a
    method ATorch does not name)."""
    d = cand.dims
    dims: list[tuple[str, int]] = []
    if d.dp_replicate > 1 and d.dp_shard > 1:
        dims += [("replicate", d.dp_replicate), ("zero", d.dp_shard)]
    elif d.dp > 1:
        dims.append(("data", d.dp))
    dims += [(name, size) for name, size in (("tensor", d.tp), ("pipeline", d.pp), ("expert", d.ep)) if size > 1]
    items: list[tuple] = [("parallel_mode", (dims or [("data", 1)], None), False)]
    for name, cfg in cand.methods:
        cfg = dict(cfg)
        if name == "ddp" and not cfg:
            continue  # parallel_mode's data degree gives DDP
        if name == "expert_parallel" and not cfg and d.ep > 1:
            continue  # parallel_mode's ("expert", ep) gives expert_parallel
        if name == "zero1" and not cfg:
            items.append(("zero1", None, False))
        elif name == "fsdp" and cfg == {"reshard_after_forward": False}:
            items.append(("zero2", None, False))
        elif name == "fsdp" and set(cfg) <= {"cpu_offload", "reshard_after_forward"}:
            items.append(("fsdp", cfg or None, False))
        elif name == "amp" and cfg.get("dtype", "bfloat16") in ("bfloat16", "float16") and set(cfg) <= {"dtype"}:
            items.append(("amp_native", {"dtype": getattr(torch, cfg.get("dtype", "bfloat16"))}, False))
        elif name == "checkpoint" and not cfg:
            items.append(("checkpoint", None, False))
        elif name == "tensor_parallel" and not cfg:
            items.append(("tensor_parallel", None, False))
        else:
            return None
    strategy = Strategy(items)
    return strategy if _round_trips(strategy, cand, world_size) else None


def _round_trips(strategy: Strategy, cand: Candidate, world_size: int) -> bool:
    from ....api import plan_dims

    try:
        plan = translate(Strategy([tuple(i) for i in strategy]), world_size)
        native = plan.methods
        if any(n == "ddp" or (isinstance(n, tuple) and n[0] == "ddp") for n in native):
            return False
        methods = [m for m in native if (m if isinstance(m, str) else m[0]) != "parallel_mode"]
        got = [(m, {}) if isinstance(m, str) else (m[0], dict(m[1])) for m in methods]
        want = [(n, dict(c)) for n, c in cand.methods if not (n == "ddp" and not c)]
        # translate puts expert_parallel beside parallel_mode; the candidate may list it elsewhere
        got, want = ([m for m in ms if m != ("expert_parallel", {})] for ms in (got, want))
        return got == want and plan_dims(native, world_size) == cand.dims and not plan.loss_scaling
    except StrategyError:
        return False


def restricted_predict(world_size: int):
    """The cost model, refusing what ATorch's loop cannot run (a StrategyError prunes the candidate)."""
    from ....search.pricing import predict

    def predict_atorch(cand: Candidate, info, hw):
        if cand.grad_accum != 1:
            raise StrategyError("ATorch's training loop steps the optimizer once per batch: no gradient accumulation")
        if to_atorch(cand, world_size) is None:
            raise StrategyError("no ATorch strategy gives this candidate")
        return predict(cand, info, hw)

    return predict_atorch


def global_batch(dataset, dataloader_args, sample_batch, kargs) -> int:
    """ATorch's total batch: ``dataloader_args['batch_size']`` (DataLoader default 1), or with only a
    ``sample_batch`` the ``batch_size`` argument (else the sample batch's size)."""
    if dataset is not None:
        return int((dataloader_args or {}).get("batch_size", 1))
    if kargs.get("batch_size") is not None:
        return int(kargs["batch_size"])
    return _leading_size(sample_batch)


def sample_input(dataset, sample_batch) -> Any:
    """One batch of one sample (what the analysis traces): the dataset's first sample collated, or the first
    sample of ``sample_batch``."""
    from ....search.runner import resize_batch

    if dataset is None:
        return resize_batch(sample_batch, 1)
    first = next(iter(dataset)) if isinstance(dataset, IterableDataset) else dataset[0]
    return default_collate([first])


def seq_len_of(batch: Any) -> int:
    """Tokens per sample: the last dimension of ``input_ids`` when the batch has it, else 1 (a sample is
    one item: tokens/s then reads as samples/s)."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor) and batch["input_ids"].dim() > 1:
        return int(batch["input_ids"].shape[-1])
    return 1


def _leading_size(batch: Any) -> int:
    from torch.utils._pytree import tree_leaves

    sizes = [t.shape[0] for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not sizes:
        raise StrategyError("sample_batch holds no tensor with a batch dimension; give batch_size= as well.")
    return int(sizes[0])


def run_search(model, *, optim_func, optim_args, dataset, loss_func, prepare_input, model_input_format,
               dataloader_args, sample_batch, options: dict[str, Any], kargs) -> tuple[Strategy, Any]:
    """Search on every rank of the live group; returns ``(ATorch strategy, SearchResult)``.

    Raises:
        StrategyError: nothing fits, or the chosen plan has no ATorch form (cannot happen: the predictor
            prunes those).
    """
    import torch.distributed as dist

    from ....parallel.distributed import init_distributed
    from ....cost.analysis import analyze_model
    from ....cost.calibrate import job_hardware
    from ....search.runner import run_trials
    from ....search.search import search

    init_distributed()
    world = dist.get_world_size()
    batch = sample_input(dataset, sample_batch)
    seq = seq_len_of(batch)
    info = analyze_model(model, seq_len=seq, sample_input=batch, input_format=model_input_format,
                         loss_func=loss_func)
    extra = {k: v for k, v in (dataloader_args or {}).items() if k not in ("batch_size", "micro_batch_size")}
    extra.setdefault("drop_last", True)  # every trial step a full batch (the final run keeps ATorch's default)
    runner = functools.partial(
        run_trials, make_model=model, optim_func=optim_func, optim_args=optim_args, dataset=dataset,
        loss_func=loss_func, dataloader_args=extra, model_input_format=model_input_format,
        prepare_input=prepare_input, sample_batch=sample_batch, seed=kargs.get("sampler_seed", 0) or 0)
    result = search(model, world_size=world, global_batch=global_batch(dataset, dataloader_args, sample_batch,
                                                                        kargs),
                    hw=job_hardware(), info=info, seq_len=seq, options=options, runner=runner,
                    predict=restricted_predict(world))
    chosen = to_atorch(result.chosen, world)
    if chosen is None:
        raise StrategyError(f"the search chose {result.chosen.label()}, which has no ATorch strategy form.")
    return chosen, result

"""``auto_accelerate(strategy="auto")`` and ``auto_accelerate(strategy=plan_file)``: turn the request into a
concrete strategy and batch split before ``auto_accelerate`` applies it to the user's model.

``"auto"``: analyse the model (meta device / fake tensors), calibrate the machine
(:func:`torchloom.cost.calibrate.job_hardware`), reuse the cached plan for the same model, batch, world
size, machine and options, else search (the confirming trials train fresh copies of the model:
``search["model_factory"]`` or a deep copy) and cache the result. A plan file: check it was made for this
model, world size, global batch and machine, else refuse (or search again with ``on_mismatch="research"``).
Every decision that reads a file or a clock is rank 0's, broadcast, so all ranks apply the same plan.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..errors import StrategyError
from ..strategy.strategy import Strategy
from .options import SearchOptions
from .plan_file import (batch_args, cache_dir, cache_key, cached_plan, is_path_like, read_plan, refusal,
                        save_plan)
from .result import SearchResult

log = logging.getLogger("torchloom.search")


@dataclass
class Resolved:
    """What ``auto_accelerate`` applies: the strategy, the dataloader arguments with the plan's batch split,
    the search result (None for a plain strategy file), and notes for ``AccelerateResult.notes``."""

    strategy: Strategy
    dataloader_args: dict[str, Any]
    search: SearchResult | None = None
    notes: list[str] = field(default_factory=list)


def wants_search(strategy: Any) -> bool:
    """True when ``strategy`` is ``"auto"`` or a JSON file (a plan file is checked; a plain one is not)."""
    if isinstance(strategy, str) and strategy == "auto":
        return True
    return is_path_like(strategy) and str(strategy).lower().endswith(".json") and Path(strategy).exists()


def resolve(model: nn.Module, strategy: Any, search: dict | SearchOptions | None, *, recipe: dict[str, Any]) -> Resolved:
    """Resolve ``strategy="auto"`` or a plan file for this job (call on every rank, after the process group
    exists).

    Args:
        model: the user's unchanged model (CPU or meta).
        strategy: ``"auto"`` or a JSON strategy/plan file path.
        search: the ``search=`` options.
        recipe: ``auto_accelerate``'s other arguments (``optim_func``, ``optim_args``, ``dataset``,
            ``loss_func``, ``dataloader_args``, ``model_input_format``, ``prepare_input``, ``max_grad_norm``,
            ``seed``) for the confirming trials.

    Raises:
        StrategyError: bad ``search`` options, no global batch, a plan for another setup (each difference
            named), or a model that fits no candidate.
    """
    options = SearchOptions.parse(search)
    loader_args = dict(recipe.get("dataloader_args") or {})
    world = dist.get_world_size()
    if strategy != "auto":
        strat, plan = read_plan(strategy)
        if plan is None:
            if search is not None:
                raise StrategyError(f"search=... options are read only with strategy='auto' or a plan file; "
                                    f"'{strategy}' is a plain strategy file (no 'plan' section). Drop search= or "
                                    "pass strategy='auto'.")
            return Resolved(strat, loader_args)
        diffs = plan.differences(model=model_signature(model), world_size=world,
                                 global_batch=loader_args.get("batch_size"), machine=machine_fingerprint())
        if not diffs:
            loader_args.update(plan.dataloader_args())
            saved = plan.result
            if saved is not None:
                saved.chosen_by = "plan"
            return Resolved(strat, loader_args, saved,
                            [f"plan file {strategy}: {plan.candidate.label()} (searched before; no new search)"])
        if options.on_mismatch != "research":
            raise refusal(strategy, diffs)
        note = f"plan file {strategy} does not match ({'; '.join(diffs)}): searching again (on_mismatch='research')"
        log.warning(note)
        out = _search(model, options, loader_args, world, recipe)
        out.notes.insert(0, note)
        return out
    return _search(model, options, loader_args, world, recipe)


def model_signature(model: nn.Module) -> str:
    """The model's identity for plan files: a hash of its class, parameter and buffer names, shapes and
    dtypes (independent of the sequence length)."""
    from ..cost.analysis import signature

    return signature(model, 0)


def check_factory(factory: Callable[[], nn.Module], model: nn.Module) -> None:
    """Check that ``search["model_factory"]`` builds the model being planned: the trials time the factory's
    model, so another one (other layers, shapes or dtypes) would confirm a plan for a different model.

    One factory model is built under ``torch.device("meta")`` (cheap: no storage; a factory that cannot build
    on meta is built as it is) and discarded; its :func:`model_signature` is compared with ``model``'s.

    Raises:
        StrategyError: the factory does not return an ``nn.Module``, or its parameters/buffers differ from
            ``model``'s (names the first difference: a name, a shape, a dtype or ``requires_grad``).
    """
    try:
        with torch.device("meta"):
            built = factory()
    except Exception:  # e.g. a factory that loads weights: build it as the trials will
        built = factory()
    if not isinstance(built, nn.Module):
        raise StrategyError(f"search: model_factory must return an nn.Module, got {type(built).__name__}.")
    if model_signature(built) == model_signature(model):
        return
    raise StrategyError("search: model_factory builds a different model from the one given, so the confirming "
                        f"trials would time another model: {_first_difference(built, model)}. Return the same "
                        "architecture (same parameter names, shapes and dtypes) from the factory, or drop "
                        "model_factory (the trials then deep-copy the model).")


def _first_difference(built: nn.Module, model: nn.Module) -> str:
    """The first parameter or buffer where the factory's model and the user's differ, in words."""
    def entries(m: nn.Module) -> dict[str, tuple]:
        out = {f"parameter {n}": (tuple(p.shape), p.dtype, p.requires_grad)
               for n, p in m.named_parameters(remove_duplicate=False)}
        out.update({f"buffer {n}": (tuple(b.shape), b.dtype, None) for n, b in m.named_buffers(remove_duplicate=False)})
        return out

    if type(built).__qualname__ != type(model).__qualname__:
        return f"the factory returns a {type(built).__qualname__}, the model is a {type(model).__qualname__}"
    a, b = entries(built), entries(model)
    for name in [*b, *(n for n in a if n not in b)]:
        if name not in a:
            return f"the factory's model has no {name} (the model has {len(b)} parameters/buffers, it {len(a)})"
        if name not in b:
            return f"the factory's model has an extra {name} {a[name][0]}"
        for what, x, y in zip(("shape", "dtype", "requires_grad"), a[name], b[name]):
            if x != y:
                return f"{name}: {what} {x} in the factory's model, {y} in the model"
    order = [n for n in a if n in b]
    return "the parameters are registered in another order" if order != list(b) else "their structure differs"


def machine_fingerprint() -> dict[str, Any]:
    """This machine's fingerprint with the job's backend (:func:`torchloom.cost.calibrate.fingerprint`)."""
    from ..cost.calibrate import fingerprint

    return fingerprint(str(dist.get_backend()) if dist.is_initialized() else None)


def _search(model, options: SearchOptions, loader_args: dict, world: int, recipe: dict) -> Resolved:
    from ..cost.analysis import analyze_model
    from ..cost.calibrate import job_hardware
    from .search import search as run_search

    global_batch = loader_args.get("batch_size")
    if global_batch is None:
        raise StrategyError("strategy='auto' needs the global batch: pass dataloader_args={'batch_size': N} (samples "
                            "per optimizer step over all data-parallel ranks).")
    user_micro = loader_args.pop("micro_batch_size", None)
    sample = options.sample_batch if options.sample_batch is not None else _sample(recipe.get("dataset"), loader_args)
    seq_len = options.seq_len or _seq_len(sample)
    sequence = seq_len is not None
    seq_len = seq_len or 1  # no sequence dimension: throughput in samples
    info = analyze_model(model, seq_len=seq_len, sample_input=sample, input_format=recipe.get("model_input_format"),
                         loss_func=recipe.get("loss_func"))
    info.sequence = sequence
    hw = job_hardware()
    machine = machine_fingerprint()
    key = cache_key(model=info.signature, world_size=world, global_batch=global_batch, seq_len=seq_len,
                    machine=machine, options=options.cache_dict())
    box: list[Any] = [None]
    if options.cache and dist.get_rank() == 0:
        hit = cached_plan(key)
        box = [None if hit is None else (str(hit[0]), hit[1].to_dict(), hit[2].search)]
    dist.broadcast_object_list(box, src=0)
    notes = []
    if user_micro is not None and "micro_batch" not in options.fixed:
        notes.append(f"search: dataloader_args micro_batch_size={user_micro} is chosen by the search (pin it with "
                     "search={'fixed': {'micro_batch': N}})")
    if box[0] is not None:
        path, strat_dict, saved = box[0]
        result = SearchResult.from_dict(saved)
        result.chosen_by = "cache"
        loader_args.update(batch_args(result.chosen))
        log.info("search: reusing the cached plan %s (%s)", path, result.chosen.label())
        return Resolved(Strategy.from_dict(strat_dict), loader_args, result,
                        [f"search: reused the cached plan {path}: {result.chosen.label()} (no new search; "
                         "search={'cache': False} searches again)", *notes])
    runner = _runner(model, options, recipe, loader_args, sample) if options.top_k else None
    result = run_search(info=info, world_size=world, global_batch=global_batch, hw=hw, seq_len=seq_len,
                        options=options, runner=runner)
    if options.cache and dist.get_rank() == 0:
        path = save_plan(cache_dir() / f"{key}.json", result,
                         model={"signature": model_signature(model), "name": info.name,
                                "analysis_signature": info.signature}, machine=machine,
                         options=options.cache_dict())
        notes.append(f"search: plan cached at {path}")
    loader_args.update(batch_args(result.chosen))
    return Resolved(result.chosen.strategy(), loader_args, result, [*result.notes, *notes])


def _runner(model, options: SearchOptions, recipe: dict, loader_args: dict, sample) -> Callable:
    from .runner import run_trials

    if options.model_factory is not None and isinstance(model, nn.Module):
        check_factory(options.model_factory, model)
    make_model = options.model_factory or model
    trial_args = {k: v for k, v in loader_args.items() if k not in ("batch_size", "micro_batch_size")}

    def run(cands, *, total_time_s, time_budget_s, steps):
        return run_trials(
            cands, make_model=make_model, optim_func=recipe["optim_func"], optim_args=recipe.get("optim_args"),
            dataset=recipe.get("dataset"), loss_func=recipe.get("loss_func"), dataloader_args=trial_args,
            model_input_format=recipe.get("model_input_format"), prepare_input=recipe.get("prepare_input"),
            sample_batch=sample if recipe.get("dataset") is None else None, steps=steps, warmup=1,
            time_budget_s=time_budget_s, total_time_s=total_time_s, max_grad_norm=recipe.get("max_grad_norm"),
            seed=recipe.get("seed", 0))

    return run


def _sample(dataset, loader_args: dict) -> Any:
    """One sample of ``dataset`` as a batch of 1 (through the loader's ``collate_fn``), for the analysis."""
    if dataset is None:
        raise StrategyError("strategy='auto' needs data to size the model's inputs: pass a dataset, or "
                            "search={'sample_batch': batch} (one batch; samples on dim 0).")
    from torch.utils.data import IterableDataset
    from torch.utils.data._utils.collate import default_collate

    try:
        item = next(iter(dataset)) if isinstance(dataset, IterableDataset) else dataset[0]
    except (StopIteration, IndexError) as e:
        raise StrategyError("strategy='auto': the dataset is empty; the search needs one sample.") from e
    collate = loader_args.get("collate_fn") or default_collate
    return collate([item])


def _seq_len(sample: Any) -> int | None:
    """Tokens per sample (:func:`torchloom.cost.analysis.sample_seq_len`): None for an input without a
    sequence dimension (images, feature vectors), whose throughput the search counts in samples."""
    from ..cost.analysis import sample_seq_len

    try:
        return sample_seq_len(sample)
    except ValueError:
        raise StrategyError("strategy='auto' cannot tell the sequence length from the sample batch (no tensor with a "
                            "batch and a sample dimension); pass search={'seq_len': N}.") from None

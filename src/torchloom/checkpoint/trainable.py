"""Trainable-only checkpoints (LoRA and other adapters): what is kept, and the check of the frozen base.

A trainable-only checkpoint (``save(..., trainable_only=True)``, ``FlashCheckpointer(..., trainable_only=True)``)
stores, of the model, the parameters with ``requires_grad=True`` and **every persistent buffer**; the frozen
parameters are left out. Buffers are kept because they are training state, not base weights: a frozen
BatchNorm in train mode still updates its running statistics, and which buffers changed cannot be told at
save time; they are small next to the weights (a Hugging Face Llama has none: ``inv_freq`` is not
persistent). Optimizer state: only trainable parameters may have some (a frozen parameter with state was
trained, so its trained value would be lost: :func:`check_no_frozen_state` refuses). Everything else (step,
scheduler, dataloader, RNG, ``TrainStep`` counters, extra) is saved as usual.

The document records :data:`RECORD`: ``{"params": [trainable names], "frozen": fingerprint}``, where the
fingerprint of the frozen base is, per frozen parameter, its global shape, dtype, and the float64 sum and
sum of squares of its values (one read of the local shards plus one all-reduce per mesh dimension group).
Loading (:func:`check_load`) refuses (``strict``) or warns (``strict=False``) when the live trainable set
differs from the saved one (an adapter not loaded would silently keep its initial values), or when the
frozen base differs: other names/shapes/dtypes, or values whose sums differ by more than
:data:`REL_TOL` (different seed, another fine-tune, another base checkpoint). The sums are not a
cryptographic hash: a permutation of a tensor's values, or a change below the tolerance, passes.
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from torchloom.errors import CheckpointError

log = logging.getLogger("torchloom.checkpoint")
RECORD = "trainable_only"
REL_TOL = 1e-6  # float64 sums of the same values in another shard order differ by ~1e-16 * n relative
#: the advice a strict refusal ends with (reworded for TorchloomTrainer: torchloom.hf.trainer_errors)
STRICT_ADVICE = "Pass strict=False to load the overlap anyway (with a warning)"
_CHUNK = 1 << 24  # elements converted to float64 at a time (bounded extra memory)


def param_sets(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(trainable, frozen)``: ``{canonical name: parameter}`` of this rank's parameters (every name of a
    tied parameter), split by ``requires_grad``."""
    from torchloom.checkpoint.state import canonical_key, wrapper_components

    comps = wrapper_components(model)
    trainable: dict[str, torch.Tensor] = {}
    frozen: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        (trainable if p.requires_grad else frozen)[canonical_key(name, comps)] = p
    return trainable, frozen


def _pipelined(model: nn.Module) -> bool:
    from torchloom.checkpoint.state import _holds_part_of_model

    return _holds_part_of_model(model) and dist.is_available() and dist.is_initialized()


def _union(model: nn.Module, local: Any, merge) -> Any:
    """Pipeline stages hold different parameters: the job's view is the union of every rank's."""
    if not _pipelined(model):
        return local
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return merge(everyone)


def _local_stats(t: torch.Tensor) -> torch.Tensor:
    """``[sum, sum of squares]`` of a local tensor in float64, converted in chunks."""
    flat = t.detach().reshape(-1)
    out = torch.zeros(2, dtype=torch.float64, device=flat.device)
    for chunk in flat.split(_CHUNK):
        c = chunk.to(torch.float64)
        out[0] += c.sum()
        out[1] += (c * c).sum()
    return out


def frozen_fingerprint(model: nn.Module) -> dict[str, Any]:
    """The fingerprint of the frozen base: ``{"count", "numel", "tensors": {name: {"shape", "dtype", "sum",
    "sumsq"}}}`` over the job's frozen parameters (global shapes; sums of the global values). Collective
    (all ranks, same model): DTensor shards are summed over their sharded mesh dimensions."""
    _trainable, frozen = param_sets(model)
    seen: dict[int, str] = {}
    entries: dict[str, dict[str, Any]] = {}
    groups: dict[tuple, list[tuple]] = {}  # (mesh, sharded mesh dims) -> [(name, local stats, mesh)]
    for name in sorted(frozen):
        p = frozen[name]
        if id(p) in seen:  # a tied alias: the same values as its owner
            entries[name] = {"same_as": seen[id(p)]}
            continue
        seen[id(p)] = name
        local = p.to_local() if hasattr(p, "to_local") else p
        entries[name] = {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
        dims: tuple = ()
        mesh = None
        if hasattr(p, "device_mesh"):
            mesh = p.device_mesh
            dims = tuple(i for i, pl in enumerate(p.placements) if not pl.is_replicate())
        groups.setdefault((id(mesh), dims), []).append((name, _local_stats(local), mesh))
    for (_mesh_id, dims), items in groups.items():  # the same order on every rank (first sorted name)
        stats = torch.stack([s for _n, s, _m in items])
        mesh = items[0][2]
        if dims and mesh.device_type != "cpu":  # CPU-offloaded shards, reduced over an accelerator's group
            stats = stats.to(mesh.device_type)
        for d in dims:
            dist.all_reduce(stats, group=mesh.get_group(d))
        for (name, _s, _m), row in zip(items, stats.cpu().tolist()):
            entries[name]["sum"], entries[name]["sumsq"] = row
    entries = _union(model, entries, lambda e: {k: v for part in e for k, v in part.items()})
    numel = sum(math.prod(v["shape"]) for v in entries.values() if "shape" in v)
    return {"count": len(entries), "numel": numel, "tensors": entries}


def check_no_frozen_state(live: Any) -> None:
    """Refuse to save trainable-only when a frozen parameter has optimizer state: it was trained, and its
    trained value would be lost (the base it is reloaded onto holds the untrained one).

    Raises:
        CheckpointError: naming the parameter.
    """
    from torchloom.checkpoint.state import is_zero_optimizer

    trainable, frozen = param_sets(live.model)
    if not trainable:
        raise CheckpointError("trainable_only=True but the model has no parameter with requires_grad=True: "
                              "nothing would be saved of the model (save a full checkpoint)")
    name_of = {id(p): n for n, p in frozen.items()}
    for o in live.optimizers():
        state = o.optim.state if is_zero_optimizer(o) else o.state
        for p, st in state.items():
            if st and id(p) in name_of:
                raise CheckpointError(
                    f"trainable_only=True but the frozen parameter {name_of[id(p)]!r} has optimizer state: it was "
                    f"trained, and a trainable-only checkpoint would drop its trained value (resuming onto the "
                    f"base would silently revert it). Save a full checkpoint (trainable_only=False), or unfreeze it")


def record(live: Any) -> dict[str, Any]:
    """The document's :data:`RECORD` entry of a trainable-only save. Collective."""
    from torchloom.checkpoint.commit import run_everywhere

    run_everywhere(lambda: check_no_frozen_state(live), "checking the trainable-only state")
    names = _union(live.model, sorted(param_sets(live.model)[0]), lambda e: sorted(set().union(*map(set, e))))
    return {"params": names, "frozen": frozen_fingerprint(live.model)}


def saved_model_keys(model: nn.Module, msd_keys: set[str]) -> set[str]:
    """The state-dict keys a trainable-only save keeps: all but the frozen parameters'."""
    return msd_keys - set(param_sets(model)[1])


# ---------------------------------------------------------------------------------------------- load
def _report(problems: list[str], where: str, strict: bool) -> None:
    if not problems:
        return
    text = f"trainable-only checkpoint {where}: " + "; ".join(problems)
    if strict:
        raise CheckpointError(f"{text}. {STRICT_ADVICE}")
    log.warning(text)
    warnings.warn(text, stacklevel=4)


def _trainable_problems(rec: dict, saved_keys: set[str], model: nn.Module,
                        per_rank: bool) -> tuple[list[str], set[str]]:
    """The trainable-set mismatches, and every name trainable on either side (reported here, not again by
    the base check)."""
    saved = set(rec.get("params") or []) & saved_keys if per_rank else set(rec.get("params") or [])
    trainable, frozen = param_sets(model)
    live = set(trainable)
    if not per_rank:
        live = _union(model, live, lambda e: set().union(*e))
        frozen_names = _union(model, set(frozen), lambda e: set().union(*e))
    else:
        frozen_names = set(frozen)
    out = []
    not_saved = sorted(live - saved)
    if not_saved:
        out.append(f"{len(not_saved)} parameters are trainable in the model but not in the checkpoint "
                   f"{not_saved[:5]} (they would keep their initial values: an adapter not loaded; build the "
                   f"model with the same adapters/target modules as the saving run)")
    now_frozen = sorted(saved & frozen_names)
    if now_frozen:
        out.append(f"{len(now_frozen)} parameters saved as trainable are frozen in the model {now_frozen[:5]}")
    absent = sorted(saved - live - frozen_names)
    if absent:
        out.append(f"{len(absent)} saved trainable parameters are not in the model {absent[:5]}")
    return out, saved | live


def _close(a: float, b: float, scale: float) -> bool:
    return abs(a - b) <= REL_TOL * max(scale, 1e-30)


def _base_problems(saved: dict, live: dict, skip: set[str]) -> list[str]:
    st, lt = saved.get("tensors") or {}, live.get("tensors") or {}
    out = []
    missing, extra = sorted(set(st) - set(lt) - skip), sorted(set(lt) - set(st) - skip)
    if missing or extra:
        sides = [f"frozen when saved, not in the model {missing[:5]}" if missing else "",
                 f"frozen in the model, not when saved {extra[:5]}" if extra else ""]
        out.append("the frozen base differs from the saving run's: " + "; ".join(x for x in sides if x))
    layout = [n for n in sorted(set(st) & set(lt)) if (st[n].get("shape"), st[n].get("dtype"), st[n].get("same_as"))
              != (lt[n].get("shape"), lt[n].get("dtype"), lt[n].get("same_as"))]
    if layout:
        n = layout[0]
        out.append(f"{len(layout)} frozen parameters have another shape/dtype than when saved, e.g. {n!r}: "
                   f"saved {st[n].get('shape')} {st[n].get('dtype')}, live {lt[n].get('shape')} {lt[n].get('dtype')}")
    values = []
    for n in sorted(set(st) & set(lt)):
        a, b = st[n], lt[n]
        if "sum" not in a or "sum" not in b or n in layout:
            continue
        numel = max(math.prod(a["shape"]), 1)
        if not (_close(a["sum"], b["sum"], math.sqrt(numel * max(a["sumsq"], b["sumsq"])))
                and _close(a["sumsq"], b["sumsq"], max(a["sumsq"], b["sumsq"]))):
            values.append(n)
    if values:
        n = values[0]
        out.append(f"{len(values)} frozen parameters hold other values than the base the checkpoint was trained "
                   f"on, e.g. {n!r} (sum {st[n]['sum']:.9g} saved, {lt[n]['sum']:.9g} live): load the same base "
                   f"weights (same pretrained checkpoint, or the same seed for a randomly initialised base) "
                   f"before loading the adapters")
    return out


def check_load(rec: dict, model: nn.Module, saved_keys: set[str], *, strict: bool, where: str,
               per_rank: bool) -> None:
    """Check a trainable-only checkpoint against the live model before loading. Collective.

    ``saved_keys``: the checkpoint's model keys (this rank's own for a flash snapshot, ``per_rank``).

    Raises:
        CheckpointError: ``strict`` and the trainable set or the frozen base differ (naming the keys);
            with ``strict=False`` the same text is a warning and the overlap is loaded. On every rank.
    """
    from torchloom.checkpoint.commit import run_everywhere

    problems, reported = _trainable_problems(rec, saved_keys, model, per_rank)  # collective for pipelines
    fingerprint = frozen_fingerprint(model)  # collective
    problems += _base_problems(rec.get("frozen") or {}, fingerprint, reported)
    run_everywhere(lambda: _report(problems, where, strict), f"loading {where}")


__all__ = ["RECORD", "REL_TOL", "STRICT_ADVICE", "check_load", "check_no_frozen_state", "frozen_fingerprint",
           "param_sets", "record", "saved_model_keys"]

"""One-time check that tensor parallelism did not change the function a module computes.

A plan only says which weights to split; the model's own code consumes the sharded activations. Code that
keeps a full-size count of its own (``q.reshape(B, T, self.n_heads, -1)`` with the count in a closure, a
tuple or a config object) keeps running after sharding, but each rank then computes all heads at a fraction
of their width: a different model, with no error. The probe compares, on a small input, the output of one
representative *region* of each kind before and after sharding.

Regions. For every column-wise target (``colwise``, ``fused_qkv``), its lowest ancestor that also holds a
``rowwise`` target: the module whose code turns the split activations back into a full result (an
attention, an MLP, a BERT layer). One region per (module class, planned children) is probed: the first
block stands for the others.

Inputs, computed on tp rank 0 before sharding and broadcast to the tp group (the sharded parameters are cut
from rank 0's values, so rank 0's unsharded output is the reference):

* a Hugging Face model (``config.vocab_size`` and an ``input_ids`` argument): one forward on random token ids
  of shape :data:`PROBE_SHAPE` (``use_cache=False``), stopped once every region's first call has been
  recorded; the regions' real arguments (rotary embeddings, masks) and outputs are kept;
* otherwise a region whose ``forward`` needs only its first argument gets random hidden states
  ``(2, 8, in_features of its first column-wise projection)`` (standard normal, fixed seed, the projection's
  dtype and device);
* anything else cannot be probed and is reported (a note; a warning under a user plan).

Both forwards run in eval mode (no dropout) under ``no_grad``, with a private generator: the global RNG,
and so initialisation and dropout later, are untouched. Under sequence parallelism the region's hidden
states enter as the ``Shard(1)`` DTensor the stream carries. The region's primary output (its first
tensor: Hugging Face attentions also return per-head attention weights, which stay legitimately split over
the ranks; a DTensor is gathered) is compared by ``max |sharded - reference| / max |reference|``; the
tolerance :func:`tolerance` is 1e-4 in fp32 (reorderings of sums give ~1e-7; a wrong head split gives
1e-2 and more). Memory: one forward of 16 tokens up to the first block, and the recorded activations.
"""
from __future__ import annotations

import inspect
import pickle
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .conv1d import is_conv1d
from .heads import COLUMN_STYLES
from .plans import hf_config
from .styles import SEQUENCE_STYLES

#: (batch, sequence) of the probe input
PROBE_SHAPE = (2, 8)
_SEED = 20240611


def tolerance(dtype: torch.dtype) -> float:
    """Largest accepted ``max |sharded - reference| / max |reference|`` for outputs of ``dtype``: 1e-4 in
    fp32/fp64; 2e-2 in bf16 (eps 7.8e-3), 4e-3 in fp16 (eps 9.8e-4): a few rounding steps of the format."""
    return {torch.bfloat16: 2e-2, torch.float16: 4e-3}.get(dtype, 1e-4)


@dataclass
class ProbeCase:
    """One region's recorded call (CPU tensors): arguments, and the tensors of its unsharded output."""

    region: str
    args: tuple
    kwargs: dict
    expected: list[torch.Tensor]
    source: str  # where the input came from, for messages


@dataclass
class Probe:
    """Recorded cases, and the regions that could not be probed (name -> why). ``expected`` holds the primary
    output only (see the module docstring)."""

    cases: list[ProbeCase] = field(default_factory=list)
    unverified: dict[str, str] = field(default_factory=dict)


def probe_regions(part: nn.Module, targets: dict[str, str]) -> list[str]:
    """One representative region per (class, planned children) in plan order (see the module docstring)."""
    rows = [n for n, s in targets.items() if s == "rowwise"]
    modules = dict(part.named_modules())
    regions: dict[tuple, str] = {}
    for name, style in targets.items():
        if style not in COLUMN_STYLES:
            continue
        region = _parent(name)
        while region and not any(r.startswith(region + ".") for r in rows):
            region = _parent(region)
        if not region:
            continue  # no row-wise partner below the root: nothing here can be run on its own
        inside = tuple((n[len(region) + 1:], s) for n, s in targets.items() if n.startswith(region + "."))
        regions.setdefault((type(modules[region]), inside), region)
    return list(regions.values())


def record(part: nn.Module, targets: dict[str, str], mesh: DeviceMesh) -> Probe:
    """Before sharding: tp rank 0 records every representative region's input and output; the tp group
    receives them (collective over ``mesh``).

    Raises:
        RuntimeError: on every tp rank, when recording failed on rank 0 (the other ranks would otherwise
            wait for the broadcast forever).
    """
    payload: list[Any] = [None]
    if mesh.get_local_rank() == 0:
        try:
            payload[0] = _record_reference(part, targets, probe_regions(part, targets))
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            payload[0] = f"{type(e).__name__}: {e}"
    group = mesh.get_group()
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(payload[0], str):
        raise RuntimeError(f"tensor_parallel: recording the probe of the unsharded model failed on tp rank 0 "
                           f"({payload[0]}); pass ('tensor_parallel', {{'verify': False}}) to skip the probe.")
    return payload[0]


def compare(part: nn.Module, probe: Probe, targets: dict[str, str], mesh: DeviceMesh,
            sequence_parallel: bool) -> tuple[dict[str, float], dict[str, str]]:
    """After sharding: run every recorded region on its recorded input (collective over ``mesh``).

    Returns:
        (region -> relative difference, region -> failure message), the failures agreed over the tp group
        (a failure on any rank counts for all, so every rank stops together).
    """
    modules = dict(part.named_modules())
    device = next((p.device for p in part.parameters()), torch.device("cpu"))
    diffs: dict[str, float] = {}
    failures: dict[str, str] = {}
    with _eval(part), torch.no_grad():
        for case in probe.cases:
            args, kwargs = _to(case.args, device), _to(case.kwargs, device)
            if sequence_parallel and targets.get(case.region) in SEQUENCE_STYLES:
                args, kwargs = _shard_hidden(args, kwargs, mesh)
            try:
                got = [_full(t).cpu() for t in _leaves(modules[case.region](*args, **kwargs))[:1]]
            except Exception as e:  # noqa: BLE001 - any failure of the sharded forward is reported
                failures[case.region] = f"raised {type(e).__name__}: {e}"
                continue
            diff, why = _difference(got, case.expected)
            diffs[case.region] = diff
            tol = tolerance(case.expected[0].dtype) if case.expected else 0.0
            if why or diff > tol:
                failures[case.region] = why or (
                    f"differs from its unsharded forward by {diff:.1e} (max |sharded - unsharded| / max "
                    f"|unsharded|; tolerance {tol:.0e}) on {case.source}")
    everyone: list[Any] = [None] * mesh.size()
    dist.all_gather_object(everyone, failures, group=mesh.get_group())
    agreed: dict[str, str] = {}
    for f in everyone:
        for k, v in f.items():
            agreed.setdefault(k, v)
    return diffs, agreed


# ------------------------------------------------------------------ reference (tp rank 0, unsharded)
def _record_reference(part: nn.Module, targets: dict[str, str], regions: list[str]) -> Probe:
    probe = Probe()
    modules = dict(part.named_modules())
    gen = torch.Generator().manual_seed(_SEED)
    with _eval(part), torch.no_grad():
        captured = _capture_hf(part, regions, gen) if _takes_input_ids(part) else {}
        for name in regions:
            case = captured.get(name)
            if case is None:
                case = _random_hidden_case(modules[name], name, targets, modules, gen, probe.unverified)
            if case is not None and not case.expected:
                probe.unverified[name] = "its forward returns no tensor"
                continue
            if case is not None:
                try:
                    pickle.dumps(case)  # what cannot travel to the other tp ranks cannot be compared there
                except Exception as e:  # noqa: BLE001
                    probe.unverified[name] = f"its recorded arguments cannot be sent to the tp ranks ({e})"
                    continue
                probe.cases.append(case)
                probe.unverified.pop(name, None)
    return probe


class _Recorded(Exception):
    """Stops the probe forward once every region's first call is recorded."""


def _takes_input_ids(part: nn.Module) -> bool:
    cfg = hf_config(part)
    return isinstance(getattr(cfg, "vocab_size", None), int) and "input_ids" in _parameters(part.forward)


def _capture_hf(part: nn.Module, regions: list[str], gen: torch.Generator) -> dict[str, ProbeCase]:
    """One forward of the Hugging Face model on random ids, recording each region's first call."""
    modules = dict(part.named_modules())
    device = next((p.device for p in part.parameters()), torch.device("cpu"))
    ids = torch.randint(0, hf_config(part).vocab_size, PROBE_SHAPE, generator=gen).to(device)
    kwargs: dict[str, Any] = {"input_ids": ids}
    if "use_cache" in _parameters(part.forward):
        kwargs["use_cache"] = False  # a cache would be extended by the second (sharded) call
    calls: dict[str, list] = {}
    done: dict[str, ProbeCase] = {}

    def pre_hook(name):
        def hook(mod, args, kw):
            calls.setdefault(name, [_to(args, "cpu"), _to(kw, "cpu")])
        return hook

    def post_hook(name):
        def hook(mod, args, out):
            if name not in done and name in calls:
                a, kw = calls[name]
                done[name] = ProbeCase(name, a, kw, [t.detach().cpu().clone() for t in _leaves(out)[:1]],
                                       f"its arguments in a forward of the model on random token ids {PROBE_SHAPE}")
                if len(done) == len(regions):
                    raise _Recorded
        return hook

    handles = [h for n in regions for h in (modules[n].register_forward_pre_hook(pre_hook(n), with_kwargs=True),
                                            modules[n].register_forward_hook(post_hook(n)))]
    try:
        part(**kwargs)
    except _Recorded:
        pass
    except Exception:  # noqa: BLE001 - e.g. a later pipeline stage: the regions fall back to random inputs
        pass
    finally:
        for h in handles:
            h.remove()
    return done


def _random_hidden_case(module: nn.Module, name: str, targets: dict[str, str], modules: dict[str, nn.Module],
                        gen: torch.Generator, unverified: dict[str, str]) -> ProbeCase | None:
    params = list(inspect.signature(module.forward).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [p.name for p in params[1:] if p.default is inspect.Parameter.empty and p.kind not in variadic]
    if not params or params[0].kind not in positional or required:
        unverified[name] = (f"its forward needs arguments besides the hidden states "
                            f"({', '.join(required) or 'no positional input'})")
        return None
    first = next(modules[n] for n, s in targets.items() if s in COLUMN_STYLES and n.startswith(name + "."))
    width = first.nx if is_conv1d(first) else first.in_features
    x = torch.randn(*PROBE_SHAPE, width, generator=gen).to(first.weight.device, first.weight.dtype)
    try:
        out = [t.detach().cpu().clone() for t in _leaves(module(x))[:1]]
    except Exception as e:  # noqa: BLE001 - the guess at its input was wrong: not probed, said so
        unverified[name] = f"its forward did not accept random hidden states {tuple(x.shape)} ({type(e).__name__})"
        return None
    return ProbeCase(name, (x.cpu(),), {}, out, f"random hidden states of shape {tuple(x.shape)}")


# ------------------------------------------------------------------ helpers
def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _parameters(fn) -> dict:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


@contextmanager
def _eval(part: nn.Module):
    """Eval mode for the probe (no dropout), the training flags restored afterwards."""
    flags = [(m, m.training) for m in part.modules()]
    part.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


def _leaves(out: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) output: tensors, tuples, lists, dicts and Hugging Face ``ModelOutput``s."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _leaves(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _leaves(v)]
    return []


def _to(obj: Any, device) -> Any:
    """A copy of ``obj`` with every tensor detached, cloned and moved to ``device`` (other values kept)."""
    if isinstance(obj, DTensor):
        obj = obj.full_tensor()
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device).clone()
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_to(v, device) for v in obj)
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    if type(obj) is dict:
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _shard_hidden(args: tuple, kwargs: dict, mesh: DeviceMesh) -> tuple[tuple, dict]:
    """The hidden states (first positional argument, else ``hidden_states=``) as the sequence-sharded stream."""
    def shard(x):
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])

    if args:
        return (shard(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": shard(kwargs["hidden_states"])}
    return args, kwargs


def _difference(got: list[torch.Tensor], expected: list[torch.Tensor]) -> tuple[float, str | None]:
    """(max over outputs of max |got - expected| / max |expected|, a structural mismatch or None)."""
    if len(got) != len(expected):
        return float("inf"), f"returned {len(got)} tensors instead of {len(expected)}"
    worst = 0.0
    for i, (g, e) in enumerate(zip(got, expected)):
        if g.shape != e.shape:
            return float("inf"), f"returned shape {tuple(g.shape)} instead of {tuple(e.shape)} (output {i})"
        if not e.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(g, e) else float("inf"))
            continue
        scale = e.abs().max().clamp_min(torch.finfo(e.dtype).tiny).float()
        worst = max(worst, float((g.float() - e.float()).abs().max() / scale))
    return worst, None

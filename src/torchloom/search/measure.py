"""The one way torchloom measures a training step: time and peak memory of optimizer steps run through an
:class:`~torchloom.api.AccelerateResult` (the search's confirming trials and ``benchmarks/search_accuracy.py``
both call :func:`measure_steps`, so predictions are always compared with the same numbers).

Time: wall-clock seconds of whole optimizer steps (``res.grad_accum_steps`` calls of ``res.train_step``;
with pipeline parallelism one call runs the whole schedule), after ``warmup`` untimed steps, every rank
synchronised once before the first timed step (and the device synchronised after each step on CUDA).
The step time of a job is the slowest rank's: per step the maximum over ranks, then the median over steps.

Peak memory, per rank, then the maximum over ranks:

- CUDA: ``torch.cuda.max_memory_allocated`` over the timed steps after ``reset_peak_memory_stats`` (every
  tensor the caching allocator hands out; not NCCL's own buffers nor the allocator's cached-free blocks).
- CPU: the peak of live tensor bytes during **one extra optimizer step** run after the timed ones (the
  tracking slows a step, so it is never timed), from PyTorch's
  :class:`torch.distributed._tools.mem_tracker.MemTracker` (:class:`~torch.distributed._tools.
  fsdp2_mem_tracker.FSDPMemTracker` for a root FSDP2 model). It counts the storage bytes of every tensor
  created through the dispatcher on the calling thread during the step (activations, gradients,
  temporaries, optimizer state, FSDP's gathered parameters, freed by ``resize_(0)``) plus the parameters,
  buffers and optimizer state that exist before it. It does not count memory outside tensors (the
  ~0.5 GiB PyTorch runtime, RSS fragmentation) nor buffers allocated in C++ before the step without a
  Python-visible tensor (gloo's scratch) — except DDP's gradient buckets, which are added as ``grads``
  (their bytes minus the gradients the tracker saw in them at the peak; see :func:`_ddp_bucket_bytes`).
  What the planner's per-rank memory categories predict is the tensor part, so that is what is compared.
"""
from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# MemTracker's category names -> the cost model's (Prediction.memory)
_CATEGORY = {"Parameter": "params", "Buffer": "params", "Gradient": "grads", "Optstate": "optimizer",
             "Activation": "activations", "Temp": "temporary", "Other": "temporary"}


@dataclass
class StepMeasurement:
    """What :func:`measure_steps` measured (identical on every rank).

    Attributes:
        step_time_s: median over the timed steps of the slowest rank's step time, seconds.
        step_times: the timed steps, seconds, each the maximum over ranks (in order).
        rank_step_times: ``[rank][step]`` seconds as each rank saw them.
        peak_memory_bytes: the largest rank's peak bytes (see the module docstring for what is counted);
            -1 when it could not be measured (``memory_error`` says why).
        rank_peak_bytes: each rank's peak bytes.
        memory: bytes by category at the peak of the largest rank, in the cost model's names (``params``
            incl. buffers, ``grads``, ``optimizer``, ``activations``, ``temporary``); sums to
            ``peak_memory_bytes``; empty where the method gives no breakdown (CUDA allocator).
        state_bytes: bytes of the local parameters, gradients and optimizer state the largest rank holds
            right after a step (gradients are freed by ``zero_grad(set_to_none=True)``, so usually 0).
        memory_method: ``"memtracker"``, ``"fsdp_memtracker"`` or ``"cuda_max_memory_allocated"``;
            ``"+ddp_buckets"`` appended when DDP's gradient buckets were added.
        memory_error: why the memory could not be measured, else ``""``.
        world_size / steps / warmup: the run's shape.
    """

    step_time_s: float
    step_times: list[float]
    rank_step_times: list[list[float]]
    peak_memory_bytes: int
    rank_peak_bytes: list[int]
    memory: dict[str, int] = field(default_factory=dict)
    state_bytes: dict[str, int] = field(default_factory=dict)
    memory_method: str = ""
    memory_error: str = ""
    world_size: int = 1
    steps: int = 0
    warmup: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepMeasurement":
        return cls(**d)


BatchSource = Sequence[Any] | Callable[[int], Any]


def measure_steps(res: Any, batches: BatchSource, steps: int = 5, warmup: int = 2, *,
                  track_memory: bool = True) -> StepMeasurement:
    """Run ``warmup + steps`` optimizer steps (plus one memory-tracked step on CPU) and measure them.

    Collective: every rank of the default process group must call it with the same ``steps``/``warmup``.

    Args:
        res: an :class:`~torchloom.api.AccelerateResult` (anything with ``train_step``, ``grad_accum_steps``,
            ``model``, ``optimizer`` and ``device``).
        batches: this rank's per-call batches (as ``res.train_step`` takes them: the micro-batch, or with
            pipeline parallelism the whole per-rank batch the schedule splits), either a non-empty sequence
            used in turn (cycled) or ``batch_fn(i) -> batch`` for call ``i`` (0, 1, ... over all steps).
        steps: timed optimizer steps (>= 1). warmup: untimed steps before them (>= 0).
        track_memory: measure the peak memory (False: ``peak_memory_bytes = -1``, no extra step on CPU).

    Returns:
        :class:`StepMeasurement`, the same on every rank.

    Raises:
        ValueError: ``steps < 1``, ``warmup < 0``, or an empty ``batches`` sequence.
        Whatever ``train_step`` raises (an out-of-memory error, a failing collective): the caller records it.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"measure_steps: steps must be an int >= 1, got {steps!r}.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"measure_steps: warmup must be an int >= 0, got {warmup!r}.")
    if not callable(batches):
        if len(batches) == 0:
            raise ValueError("measure_steps: batches is empty; give at least one batch or a batch_fn(i).")
        seq = batches
        batches = lambda i: seq[i % len(seq)]  # noqa: E731
    cuda = getattr(res, "device", torch.device("cpu")).type == "cuda"
    calls = _Calls(res, batches)

    for _ in range(warmup):
        calls.step()
    _barrier()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        calls.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)

    peak, categories, method, error = -1, {}, "", ""
    if track_memory and cuda:
        peak, method = int(torch.cuda.max_memory_allocated()), "cuda_max_memory_allocated"
    elif track_memory and _split_backward_schedule(res):
        # MemTracker's module backward hooks break the separate input/weight backward of zero-bubble schedules
        # on some ranks only ("Failed to run stage backward input"), leaving the peer stage blocked in a recv:
        # decided from the strategy, so every rank skips alike
        method, error = "untracked", "no CPU memory tracking under zero-bubble pipeline schedules"
    elif track_memory:
        try:
            peak, categories, method = _tracked_step(res, calls)
        except Exception as e:  # noqa: BLE001 - a tracker limitation must not lose the time measurement
            error = f"{type(e).__name__}: {e}"
            print(f"measure_steps: memory tracking failed: {error}", file=sys.stderr)
    state = model_state_bytes(res)

    rows = _gather({"times": times, "peak": peak, "categories": categories, "state": state, "error": error})
    rank_times = [r["times"] for r in rows]
    per_step = [max(ts[i] for ts in rank_times) for i in range(steps)]
    top = max(range(len(rows)), key=lambda i: rows[i]["peak"])
    errors = sorted({f"rank {i}: {r['error']}" for i, r in enumerate(rows) if r["error"]})
    failed = bool(errors)
    return StepMeasurement(
        step_time_s=statistics.median(per_step), step_times=per_step, rank_step_times=rank_times,
        peak_memory_bytes=-1 if failed else rows[top]["peak"], rank_peak_bytes=[r["peak"] for r in rows],
        memory={} if failed else rows[top]["categories"], state_bytes=rows[top]["state"],
        memory_method=method, memory_error="; ".join(errors), world_size=len(rows), steps=steps, warmup=warmup)


def _split_backward_schedule(res) -> bool:
    strategy = getattr(res, "strategy", None)
    config = strategy.config("pipeline_parallel") if strategy is not None else None
    return getattr(config, "schedule", None) in ("zero_bubble", "zbv")


class _Calls:
    """Feeds ``train_step`` its batches, one optimizer step at a time."""

    def __init__(self, res, batch_fn):
        self.res, self.batch_fn, self.i = res, batch_fn, 0

    def step(self, after_call: Callable[[], None] | None = None) -> None:
        for _ in range(max(1, int(getattr(self.res, "grad_accum_steps", 1) or 1))):
            self.res.train_step(self.batch_fn(self.i))
            self.i += 1
            if after_call is not None:
                after_call()


def _parts(res) -> list[nn.Module]:
    return list(getattr(res.model, "parts", None) or [res.model])


def _optimizers(res) -> list[torch.optim.Optimizer]:
    opt = res.optimizer
    inner = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer keeps this rank's shard in .optim
    return [opt] + ([inner] if isinstance(inner, torch.optim.Optimizer) else [])


def _tracked_step(res, calls: _Calls) -> tuple[int, dict[str, int], str]:
    """One optimizer step under MemTracker: (peak bytes, bytes by category at the peak, method name)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule

    parts = _parts(res)
    pipelined = getattr(res.model, "parts", None) is not None
    if not pipelined and len(parts) == 1 and isinstance(parts[0], FSDPModule):
        tracker, method = _frozen_safe(FSDPMemTracker)(parts[0], res.optimizer), "fsdp_memtracker"
    else:
        tracker, method = _repeatable_tracker_class()(), "memtracker"
        tracker.track_external(*parts, *_optimizers(res))
    with tracker:
        # module stats per call: MemTracker refuses a module seen twice (accumulation, pipeline schedules)
        calls.step(after_call=tracker.reset_mod_stats)
    snap = tracker.get_tracker_snapshot("peak")
    if not snap:
        return 0, {}, method
    dev, dsnap = max(snap.items(), key=lambda kv: kv[1].get("Total", 0))
    categories: dict[str, int] = {}
    for key, nbytes in dsnap.items():
        name = str(getattr(key, "value", key))
        if name == "Total" or not nbytes:
            continue
        cat = _CATEGORY.get(name, _fsdp_category(name))
        categories[cat] = categories.get(cat, 0) + int(nbytes)
    peak = int(dsnap.get("Total", sum(categories.values())))
    missed = _ddp_bucket_bytes(parts, categories.get("grads", 0))
    if missed:
        categories["grads"] = categories.get("grads", 0) + missed
        peak += missed
        method += "+ddp_buckets"
    return peak, categories, method


def _ddp_bucket_bytes(parts: list[nn.Module], grads_seen: int) -> int:
    """Bytes of DDP's gradient buckets the tracker did not see at the peak. DDP allocates them in C++ once
    (before the tracked step) and keeps them between steps; the tracker only learns of a bucket when the
    first gradient lands in it (``gradient_as_bucket_view``: the gradients are views of the buckets), so
    at a peak early in backward they are missing. Bucket bytes = the bytes of the parameters that require
    grad; with bucket views the gradients seen at the peak are already part of them."""
    from torch.nn.parallel import DistributedDataParallel

    total, views = 0, False
    for part in parts:
        if isinstance(part, DistributedDataParallel):
            total += sum(p.numel() * p.element_size() for p in part.parameters() if p.requires_grad)
            views = views or bool(getattr(part, "gradient_as_bucket_view", False))
    return max(0, total - grads_seen) if views else total


class _NoHook:
    def remove(self) -> None:
        pass


@functools.lru_cache(maxsize=None)
def _frozen_safe(cls):
    """``cls`` (a MemTracker) that skips frozen parameters when it installs its gradient hooks: torch 2.13's
    tracker calls ``register_hook`` on every parameter, which raises for one with ``requires_grad=False``
    (LoRA, frozen embeddings), so no model with a frozen parameter could be measured. A frozen parameter gets
    no gradient, so there is nothing for the hook to see; its bytes are still counted as parameters."""

    class FrozenSafe(cls):
        def _track_module_params_and_buffers(self, module, *args, **kwargs):
            for p in module.parameters():
                if not p.requires_grad and self._param_to_grad_hook_handles.get(p, None) is None:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, *args, **kwargs)

    FrozenSafe.__name__ = f"FrozenSafe{cls.__name__}"
    return FrozenSafe


@functools.lru_cache(maxsize=1)
def _repeatable_tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker

    class RepeatableMemTracker(_frozen_safe(MemTracker)):
        """MemTracker that accepts a root module run forward several times in one step (a pipeline stage
        runs once per micro-batch, interleaved with backward): the module's per-call stats are restarted.
        The whole-step peak and its breakdown, which is what is read here, are not per module."""

        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                fqn = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {fqn} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    return RepeatableMemTracker


def _fsdp_category(name: str) -> str:
    """FSDPMemTracker's finer names (torch 2.13 ``_FSDPRefType``): the gathered (unsharded) parameters and
    gradients and the collectives' buffers are per-block transients; anything unknown is temporary."""
    return _FSDP_CATEGORY.get(name, "temporary")


_FSDP_CATEGORY = {"Sharded Param": "params", "Buffer": "params", "Sharded Grad": "grads", "OptState": "optimizer",
                  "Activation": "activations", "Inputs": "activations", "Unsharded Param": "temporary",
                  "Unsharded Grad": "temporary", "All Gather": "temporary", "Reduce Scatter": "temporary",
                  "Temp": "temporary"}


def model_state_bytes(res: Any) -> dict[str, int]:
    """Bytes of the local parameters (+ buffers), gradients and optimizer state this rank holds now
    (local shards of DTensors; each storage counted once)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()

    def nbytes(t) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        t = t.to_local() if isinstance(t, DTensor) else t
        if t.device.type == "meta":
            return 0
        st = t.untyped_storage()
        if st.data_ptr() in seen and st.nbytes():
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()

    parts = _parts(res)
    params = sum(nbytes(p) for m in parts for p in [*m.parameters(), *m.buffers()])
    grads = sum(nbytes(p.grad) for m in parts for p in m.parameters() if p.grad is not None)
    opt = sum(nbytes(v) for o in _optimizers(res) for s in o.state.values() for v in s.values())
    return {"params": params, "grads": grads, "optimizer": opt}


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _gather(obj: dict) -> list[dict]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]

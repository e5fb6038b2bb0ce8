"""Confirming trial runs: each candidate strategy applied to a fresh model and trained for a few real steps.

:func:`run_trials` runs on **every rank of the live process group** (all ranks call it with the same
candidates in the same order). Each trial builds a fresh model (the user's factory, or a deep copy of a
meta/CPU model), applies the candidate with :func:`torchloom.auto_accelerate`, runs ``warmup`` + ``steps``
optimizer steps on real batches of its own dataloader, and records the step time (median over the measured
steps of the slowest rank's time) and the peak memory per rank, both measured by
:func:`torchloom.search.measure.measure_steps` (as the accuracy benchmark measures). Then everything the trial created is torn down
(:class:`~torchloom.search.isolation.ProcessState`: its process groups, the current mesh, the random state,
DTensor/dynamo caches; the model, optimizer and dataloader are dropped): the real run that follows reads the
same data and draws the same random numbers as without the trials. The trial's dataloader is its own (a new
sampler over ``dataset``), so the real run's sampler position is untouched; a dataset that records what it
was asked for (e.g. ``RecordingWindows``) sees the trials' reads.

Failures are results, not errors: an out-of-memory (``torch.OutOfMemoryError``) or any exception in a trial is
recorded in its :class:`TrialResult` and the next trial runs. The ranks agree after every phase of a trial
(building the model, applying the strategy, each warm-up step, each measured block) with one small
all-reduce (max) of ``[failed, oom, seconds since the trial started, seconds of the phase]`` on the default
group, so a rank that failed and the ranks that did not stop together, and a time budget ends every rank's
trial at the same step. Limitation: a rank that raises *inside* a collective region that its peers are still
in (e.g. an OOM in one rank's forward while the others wait in FSDP's all-gather) leaves the peers blocked
in that collective; Python cannot interrupt it. The trial's time budget is checked only between steps, so it
does not end such a hang: the process group's timeout (``dist.init_process_group(timeout=...)``) or
torchloom's watchdog (``watchdog.timeout_s`` in ``loom train``; docs/elastic.md) does, failing the job.
"""
from __future__ import annotations

import copy
import logging
import math
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .candidate import Candidate
from .isolation import ProcessState

log = logging.getLogger("torchloom.search")

STATUSES = ("ok", "timeout", "oom", "error", "skipped")


@dataclass
class TrialResult:
    """What one confirming run measured (the same on every rank).

    Attributes:
        candidate: the candidate that ran.
        status: ``"ok"`` (all steps measured), ``"timeout"`` (the trial's time budget ended it; ``step_times``
            holds the steps measured before), ``"oom"`` (out of memory on some rank), ``"error"`` (any other
            exception on some rank: ``error`` says which), ``"skipped"`` (the total time limit was spent
            before it started).
        step_time_s: median of ``step_times`` in seconds (None when no step was measured).
        step_times: seconds per measured optimizer step, each the slowest rank's.
        peak_memory_bytes: the largest of ``peak_memory_per_rank`` (None when not measured).
        peak_memory_per_rank: peak bytes per rank during one steady-state step.
        memory: bytes by category at the largest rank's peak (``params``, ``grads``, ``optimizer``,
            ``activations``, ``temporary``; CPU only), as :func:`torchloom.search.measure.measure_steps` gives.
        memory_source: how the peak was measured (``"memtracker"``, ``"fsdp_memtracker"``,
            ``"cuda_max_memory_allocated"``); ``memory_error`` says why it could not be, else ``""``.
        error: ``"rank R: Type: message"`` of the first failing rank, else None.
        wall_s: seconds the trial took on the slowest rank (build, warm-up, measurement, tear-down).
        groups_destroyed: process groups the tear-down destroyed.
    """

    candidate: Candidate
    status: str
    step_time_s: float | None = None
    step_times: list[float] = field(default_factory=list)
    peak_memory_bytes: float | None = None
    peak_memory_per_rank: list[float] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    memory_source: str | None = None
    memory_error: str = ""
    error: str | None = None
    wall_s: float = 0.0
    groups_destroyed: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["candidate"] = self.candidate.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrialResult":
        d = dict(d)
        d["candidate"] = Candidate.from_dict(d["candidate"])
        return cls(**d)


def run_trials(
    candidates: list[Candidate],
    *,
    make_model: Callable[[], nn.Module] | nn.Module,
    optim_func: Callable[..., torch.optim.Optimizer],
    optim_args: dict[str, Any] | None = None,
    dataset: Any = None,
    loss_func: Callable | None = None,
    dataloader_args: dict[str, Any] | None = None,
    model_input_format: str | None = None,
    prepare_input: Callable | None = None,
    sample_batch: Any = None,
    steps: int = 3,
    warmup: int = 1,
    time_budget_s: float | None = None,
    total_time_s: float | None = None,
    measure_memory: bool = True,
    max_grad_norm: float | None = None,
    seed: int = 0,
    on_result: Callable[[int, int, TrialResult], None] | None = None,
) -> list[TrialResult]:
    """Run each candidate for ``warmup + steps`` optimizer steps on every rank; one :class:`TrialResult` each.

    Args:
        candidates: the plans to confirm (same list and order on every rank).
        make_model: ``make_model() -> nn.Module`` building a fresh, unchanged model (CPU or meta device), or a
            model to ``copy.deepcopy`` per trial (it must not have been through ``auto_accelerate``).
        optim_func / optim_args / loss_func / model_input_format / prepare_input / max_grad_norm / seed: as in
            :func:`torchloom.auto_accelerate`.
        dataset: the training dataset; each trial builds its own loader over it (``dataloader_args`` without
            ``batch_size``/``micro_batch_size``: those come from the candidate, ``candidate.global_batch``
            samples per step).
        sample_batch: with ``dataset=None``: one batch (tensors, or dicts/tuples of tensors, samples on dim 0)
            repeated or cut to the candidate's per-rank micro-batch (ATorch's ``sample_batch``).
        steps / warmup: measured and unmeasured optimizer steps per trial (``steps >= 1``).
        time_budget_s: per trial, seconds; checked between steps (the measured steps run in blocks sized to
            what the budget leaves at the step time seen so far): once spent the trial stops with the steps
            measured so far (status ``"timeout"``).
        total_time_s: for all trials together; a trial's budget is capped by what it leaves, and candidates
            not started when it is spent are ``"skipped"``.
        measure_memory: measure the peak memory in one extra, untimed step (CPU) or over the measured steps
            (CUDA).
        on_result: ``on_result(index, total, result)`` after each trial on every rank (progress display).

    Returns:
        One :class:`TrialResult` per candidate, in order; identical on every rank.

    Raises:
        ValueError: ``steps < 1``, ``warmup < 0``, no dataset and no sample_batch, or a ``make_model`` model
            that was already transformed (pass a factory instead).
        RuntimeError: no initialised process group (call ``torchloom.init_distributed()`` first).
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"run_trials needs steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}.")
    if dataset is None and sample_batch is None:
        raise ValueError("run_trials needs a dataset or a sample_batch to train the trials on.")
    if not dist.is_initialized():
        raise RuntimeError("run_trials runs on every rank of an initialised process group; call "
                           "torchloom.init_distributed() (or run under `loom run`) first.")
    factory = _factory(make_model)
    recipe = dict(optim_func=optim_func, optim_args=optim_args, dataset=dataset, loss_func=loss_func,
                  dataloader_args=dataloader_args, model_input_format=model_input_format,
                  prepare_input=prepare_input, max_grad_norm=max_grad_norm, seed=seed)
    t0 = time.perf_counter()
    out: list[TrialResult] = []
    for i, cand in enumerate(candidates):
        elapsed = _agree([time.perf_counter() - t0])[0]  # the slowest rank's clock: every rank decides alike
        if total_time_s is not None and elapsed >= total_time_s:
            res = TrialResult(cand, "skipped", error=f"total time limit of {total_time_s:.3g} s spent before it started")
        else:
            budget = time_budget_s
            if total_time_s is not None:  # a trial never runs past what the whole limit leaves
                budget = min(math.inf if budget is None else budget, total_time_s - elapsed)
            res = _run_one(cand, factory, recipe, sample_batch, steps, warmup, budget, measure_memory)
        out.append(res)
        if dist.get_rank() == 0:
            log.info("trial %d/%d %s: %s", i + 1, len(candidates), cand.label(), describe(res))
        if on_result is not None:
            on_result(i, len(candidates), res)
    return out


def describe(r: TrialResult) -> str:
    """One line: ``0.251 s/step, peak 120.0 MiB`` / ``oom: rank 1: ...``."""
    if r.step_time_s is None:
        return f"{r.status}: {r.error}" if r.error else r.status
    mem = f", peak {r.peak_memory_bytes / 2**20:.1f} MiB" if r.peak_memory_bytes is not None else ""
    tail = f" ({r.status} after {len(r.step_times)} step(s))" if r.status != "ok" else ""
    return f"{r.step_time_s:.3f} s/step{mem}{tail}"


# ------------------------------------------------------------------------------------------ one trial
def _run_one(cand, factory, recipe, sample_batch, steps, warmup, budget, measure_memory) -> TrialResult:
    state = ProcessState.capture()
    t0 = time.perf_counter()
    result = TrialResult(cand, "ok")
    try:
        _trial(result, t0, factory, recipe, sample_batch, steps, warmup, budget, measure_memory)
    finally:
        # the trial's frame is gone: its model, optimizer and dataloader can be freed before their groups
        result.groups_destroyed = state.restore(compiled="compile" in cand.names)
        result.wall_s = _agree([time.perf_counter() - t0])[0]  # the slowest rank's, so results are equal
        if result.step_times:
            result.step_time_s = statistics.median(result.step_times)
    return result


def _trial(result, t0, factory, recipe, sample_batch, steps, warmup, budget, measure_memory) -> None:
    """Build, warm up and measure one candidate; fills ``result`` (collective on every rank)."""
    from ..api import auto_accelerate
    from .measure import measure_steps

    cand = result.candidate
    phase = _Phase(result, t0, budget)
    failure, model = None, None
    try:
        model = factory()
    except Exception as e:  # noqa: BLE001
        failure = e
    if phase.end(failure):  # before auto_accelerate's collectives: a factory failing on one rank cannot hang
        return
    try:
        res = auto_accelerate(model, recipe["optim_func"], recipe["dataset"], recipe["loss_func"],
                              strategy=cand.strategy(), optim_args=recipe["optim_args"],
                              dataloader_args=_loader_args(cand, recipe["dataloader_args"]),
                              model_input_format=recipe["model_input_format"],
                              prepare_input=recipe["prepare_input"], max_grad_norm=recipe["max_grad_norm"],
                              seed=recipe["seed"])
        next_batch = _batches(res, cand, sample_batch)
    except Exception as e:  # noqa: BLE001 - a failing candidate is a result
        failure = e
    del model
    if phase.end(failure):
        return
    warm: list[float] = []
    for _ in range(warmup):  # untimed by measure_steps; their time sizes the measured block to the budget
        failure, t = None, time.perf_counter()
        try:
            for _ in range(res.grad_accum_steps):
                res.train_step(next_batch())
        except Exception as e:  # noqa: BLE001
            failure = e
        if phase.end(failure, time.perf_counter() - t):
            return
        warm.append(phase.slowest)
        if phase.over():
            phase.timeout()
            return
    remaining = steps
    while remaining:
        n = phase.steps_that_fit(remaining, result.step_times or warm)
        if n == 0:
            phase.timeout()
            return
        failure, m, last = None, None, n == remaining
        try:  # the benchmark's measurement (search/measure.py): the same numbers the predictions face
            m = measure_steps(res, lambda i: next_batch(), steps=n, warmup=0,
                              track_memory=measure_memory and last)
        except Exception as e:  # noqa: BLE001
            failure = e
        if phase.end(failure):
            return
        result.step_times.extend(m.step_times)
        remaining -= n
        if last and measure_memory:
            _record_memory(result, m)
        if remaining and phase.over():
            phase.timeout()
            return


class _Phase:
    """The ranks' agreement at the end of each phase of a trial (build, each warm-up step, each measured
    block): one all-reduce (max) of ``[failed, oom, seconds since the trial started, seconds of the phase]``
    on the default group, so every rank stops at the same point and sees the same times."""

    def __init__(self, result: TrialResult, t0: float, budget: float | None):
        self.result, self.t0, self.budget = result, t0, budget
        self.elapsed = 0.0
        self.slowest = 0.0

    def end(self, failure: BaseException | None, dt: float = 0.0) -> bool:
        """True when the trial must stop because a rank failed (``result`` then says which and why)."""
        oom = failure is not None and _is_oom(failure)
        failed, was_oom, self.elapsed, self.slowest = _agree(
            [float(failure is not None), float(oom), time.perf_counter() - self.t0, dt])
        if not failed:
            return False
        msgs = [None] * dist.get_world_size()
        mine = None if failure is None else f"rank {dist.get_rank()}: {type(failure).__name__}: {failure}"
        if failure is not None:
            log.debug("trial %s failed:\n%s", self.result.candidate.label(),
                      "".join(traceback.format_exception(failure)))
        dist.all_gather_object(msgs, mine)
        self.result.status = "oom" if was_oom else "error"
        self.result.error = next(m for m in msgs if m is not None)
        return True

    def over(self) -> bool:
        return self.budget is not None and self.elapsed > self.budget

    def steps_that_fit(self, remaining: int, seen: list[float]) -> int:
        """Measured steps to run next: all of them without a budget; else as many as the budget leaves room
        for at the median step time seen so far (one at a time before any was seen; 0 when it is spent)."""
        if self.budget is None:
            return remaining
        left = self.budget - self.elapsed
        if left <= 0:
            return 0
        if not seen:
            return 1
        return max(0, min(remaining, int(left // max(statistics.median(seen), 1e-9))))

    def timeout(self) -> None:
        r = self.result
        r.status = "timeout"
        r.error = (f"time budget of {self.budget:.3g} s spent after {len(r.step_times)} measured step(s)"
                   if r.step_times else f"time budget of {self.budget:.3g} s spent before any step was measured")


def _agree(values: list[float]) -> list[float]:
    """Element-wise max over ranks of a few numbers (one all-reduce on the default group)."""
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


# ------------------------------------------------------------------------------------- model and data
def _factory(make_model) -> Callable[[], nn.Module]:
    if isinstance(make_model, nn.Module):
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in make_model.parameters()) or hasattr(make_model, "module") and \
                isinstance(make_model, nn.parallel.DistributedDataParallel):
            raise ValueError("run_trials: the model was already transformed by auto_accelerate (DTensor or DDP "
                             "parameters); pass the unchanged model or a factory make_model() -> nn.Module.")
        return lambda: copy.deepcopy(make_model)
    if not callable(make_model):
        raise TypeError(f"make_model must be an nn.Module or a callable returning one, got {make_model!r:.80}.")

    def build():
        m = make_model()
        if not isinstance(m, nn.Module):
            raise TypeError(f"make_model() must return an nn.Module, got {type(m).__name__}.")
        return m

    return build


def _loader_args(cand: Candidate, dataloader_args: dict | None) -> dict[str, Any]:
    """The candidate's batch split as auto_accelerate's dataloader_args: ``candidate.global_batch`` samples per
    step; per-rank loader batch = ``micro_batch`` (x the pipeline's micro-batch count under pipeline
    parallelism: one pipelined ``train_step`` call runs all of them)."""
    from .plan_file import batch_args  # the one rule, shared with plan files and the final run

    args = {k: v for k, v in (dataloader_args or {}).items() if k not in ("batch_size", "micro_batch_size")}
    args.update(batch_args(cand))
    return args


def _batches(res, cand: Candidate, sample_batch) -> Callable[[], Any]:
    """``next_batch()``: the trial's next per-call batch, from its own dataloader (restarted at its end) or
    ``sample_batch`` cut/repeated to the per-call size."""
    if res.dataloader is not None:
        it = [iter(res.dataloader)]

        def next_batch():
            try:
                return next(it[0])
            except StopIteration:  # a small dataset: the next epoch
                it[0] = iter(res.dataloader)
                return next(it[0])

        return next_batch
    fixed = resize_batch(sample_batch, res.micro_batch_size or cand.micro_batch)
    return lambda: fixed


def resize_batch(batch: Any, n: int) -> Any:
    """``batch`` with ``n`` samples on dim 0 of every tensor: cut, or repeated whole then cut (a dict, tuple
    or list of tensors keeps its structure; other values are kept as they are)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        reps = math.ceil(n / batch.shape[0])
        return batch.repeat(reps, *([1] * (batch.dim() - 1)))[:n] if reps > 1 else batch[:n]
    if isinstance(batch, dict):
        return {k: resize_batch(v, n) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(resize_batch(v, n) for v in batch)
    return batch


# --------------------------------------------------------------------------------------------- memory
def _record_memory(result: TrialResult, m) -> None:
    """Copy a :class:`~torchloom.search.measure.StepMeasurement`'s memory reading (-1: not measured)."""
    result.memory_error = m.memory_error
    if m.peak_memory_bytes < 0:
        return
    result.peak_memory_bytes = float(m.peak_memory_bytes)
    result.peak_memory_per_rank = [float(b) for b in m.rank_peak_bytes]
    result.memory = dict(m.memory)
    result.memory_source = m.memory_method

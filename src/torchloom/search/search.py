"""The search: enumerate, prune, predict, rank, confirm the top-k with real runs, choose the best measured.

Every rank computes the same ranking (the enumeration order, the cost model and the tie-break by the
candidate's key are deterministic, and ``hw`` is the same on every rank), and the confirming runs agree on
their results (``runner.run_trials``), so every rank chooses the same plan without a broadcast.
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import re
import time
import warnings
from typing import Any, Callable, Sequence

from torch import nn

from ..errors import StrategyError
from ..parallel.dims import factorisations
from .candidate import Candidate, Prediction
from ..cost.hardware import Hardware
from ..cost.model_info import ModelInfo
from .options import SearchOptions
from .result import Evaluated, SearchResult, Trial
from .space import BATCH_REASONS, Space, ac_levels, check, enumerate_space, mesh_label, state_lower_bound, with_extra

log = logging.getLogger("torchloom.search")

#: ``runner(candidates, total_time_s=..., time_budget_s=..., steps=...) -> results`` (each with
#: ``candidate``, ``status``, ``step_time_s``, ``peak_memory_bytes``, ``error``, ``wall_s``), e.g.
#: ``functools.partial(torchloom.search.runner.run_trials, make_model=..., optim_func=..., ...)``.
Runner = Callable[..., Sequence[Any]]
Predictor = Callable[[Candidate, ModelInfo, Hardware], Prediction]
#: ranked candidates checked against the model's structure (the rest only against its architecture sizes)
FULL_CHECKS = 64


def search(model: nn.Module | Callable[[], nn.Module] | None = None, *, world_size: int, global_batch: int,
           hw: Hardware, info: ModelInfo | None = None, seq_len: int | None = None,
           options: SearchOptions | dict | None = None, runner: Runner | None = None,
           predict: Predictor | None = None, progress: Callable[[str], None] | None = None,
           keep: int | None = None) -> SearchResult:
    """Find the fastest plan for ``model`` on ``world_size`` ranks of ``hw`` at ``global_batch`` samples
    (of ``seq_len`` tokens) per optimizer step.

    Steps: enumerate the space (:func:`~torchloom.search.space.enumerate_space`, cheap pruning first), drop
    what ``auto_accelerate`` would reject (:func:`~torchloom.search.space.check`), predict each base with the
    least activation checkpointing that fits memory (``(1 - headroom)`` of ``hw.memory_bytes``), then FSDP
    CPU offload when nothing fits on an accelerator; rank by predicted tokens/s (ties: the candidate's key),
    confirm the ``top_k`` best with ``runner`` and choose the fastest measured one. The whole search honours
    ``time_limit_s``: the trials get what the predictions left; when no trial finishes, the best predicted
    plan is chosen with a warning.

    Args:
        model: the model (meta or CPU) or a factory, analysed on the meta device when ``info`` is not given.
        info: a ready :class:`ModelInfo` (skips the analysis).
        seq_len: tokens per sample (default ``info.seq_len``; needed to analyse ``model``).
        options: a :class:`SearchOptions` or the user's ``search={...}`` dict.
        runner: runs the confirming trials (see :data:`Runner`); None = predictions only.
        predict: the cost model (default :func:`torchloom.search.pricing.predict`).
        progress: ``progress(phase)`` is told what the search is doing, every few hundred candidates (``loom
            plan`` prints it when a plan runs long).
        keep: only the best ``keep`` ranked plans are needed (``loom plan``'s ``--top``): candidates whose
            throughput bound (:class:`~torchloom.search.bounds.StepBound`) is below the ``keep``-th best fitting
            plan found so far are skipped without a prediction (counted in ``result.skipped``). The first
            ``keep`` rows of ``result.ranked`` are the same as without it; below them the ranking is partial
            (and the model-structure checks stop after ``max(min(keep, FULL_CHECKS), top_k)`` passed instead
            of ``max(FULL_CHECKS, top_k)``), and ``result.evaluated`` holds only what was priced. None (default): every
            candidate is priced.

    Returns:
        a :class:`SearchResult`.

    Raises:
        StrategyError: bad options, a global batch no data-parallel degree divides, or a model that fits no
            candidate (by how much the smallest overflows, and what would make it fit). When nothing valid is
            left, the message leads with the refusal that removed the most layouts (batch arithmetic first).
    """
    t0 = time.perf_counter()
    say = progress or (lambda phase: None)
    options = SearchOptions.parse(options)
    if info is None:
        info = _analyse(model, seq_len)
    seq_len = seq_len or info.seq_len
    if predict is None:
        from .pricing import predict
    ranks_per_node = hw.ranks_per_node if hw.num_nodes > 1 else None
    usable = hw.memory_bytes * (1 - options.headroom)
    say(f"enumerating the layouts of {world_size:,} ranks")
    space = enumerate_space(info, world_size, global_batch, options, memory_bytes=hw.memory_bytes,
                            ranks_per_node=ranks_per_node, fp8=hw.device_type != "cpu" and "float8" in hw.peak_flops,
                            context_parallel=True)
    result = SearchResult(chosen=None, chosen_by="predicted", world_size=world_size,  # type: ignore[arg-type]
                          global_batch=global_batch, seq_len=seq_len, sequence=info.sequence)
    _count_pruned(result, space)
    # the hooks' architecture-size checks for every candidate; the model-structure checks in rank order below
    light = dataclasses.replace(info, module=None) if info.module is not None else info
    prune = _Pruner(keep, info, hw) if keep is not None and keep > 0 else None
    _predict_all(space, info, light, hw, predict, usable, seq_len, options, result, say, prune)
    if not result.ranked and hw.device_type != "cpu" and "cpu_offload" not in options.exclude:
        offload = enumerate_space(info, world_size, global_batch, options, ranks_per_node=ranks_per_node, offload=True)
        _predict_all(offload, info, light, hw, predict, usable, seq_len, options, result, say, prune)
        if result.ranked:
            result.notes.append("nothing fits in device memory without CPU offload: ranked the fsdp cpu_offload "
                                "candidates")
    if not result.evaluated and not any(p.memory for p in space.pruned):
        # nothing survived pruning and validate, and none was left out for memory: not a memory problem
        raise StrategyError(_no_valid_message(result, world_size, options, space))
    if not result.ranked:
        raise StrategyError(_no_fit_message(result, info, world_size, hw, usable, options, space))
    result.ranked.sort(key=rank_key)
    if light is not info:
        say(f"checking the model structure of the best of {len(result.ranked):,} candidates that fit")
        # only the best ``keep`` are needed: checking past them (up to FULL_CHECKS) would not change those rows
        checks = max(FULL_CHECKS if keep is None else min(keep, FULL_CHECKS), options.top_k)
        _check_structure_exact(result, info, checks, prune,
                               lambda: _predict_skipped(prune, info, light, hw, predict, usable, seq_len, options,
                                                        result, say))
    elif prune is not None and not prune.exact(result.ranked):
        _predict_skipped(prune, info, light, hw, predict, usable, seq_len, options, result, say)
        result.ranked.sort(key=rank_key)
    result.skipped = prune.skipped_count if prune is not None else 0  # type: ignore[attr-defined]
    if not result.ranked:  # every candidate that fit memory failed the model-structure checks
        raise StrategyError(_no_valid_message(result, world_size, options, space))
    batch = _batch_note(result, space)
    if batch:
        result.notes.append(batch)
    result.chosen = result.ranked[0].candidate
    top = [e for e in result.ranked[: options.top_k]]
    if runner is not None and top:
        _confirm(result, top, runner, options, t0)
    elif options.top_k and runner is None:
        result.notes.append("no runner: the best predicted plan is chosen without confirming runs")
    result.elapsed_s = time.perf_counter() - t0
    result.notes.insert(0, f"search: {len(result.ranked)} of {len(result.evaluated)} predicted candidates fit "
                           f"({result.pruned_count} pruned first) on {world_size} ranks; chose "
                           f"{result.chosen.label()} by {result.chosen_by} in {result.elapsed_s:.1f} s")
    _log_table(result)
    return result


def _analyse(model, seq_len: int | None) -> ModelInfo:
    if model is None:
        raise StrategyError("search needs a model (or a factory) or a ModelInfo (info=...).")
    if seq_len is None:
        raise StrategyError("search needs seq_len (tokens per sample) to analyse the model.")
    from ..cost.analysis import analyze_model

    return analyze_model(model, seq_len=seq_len)


def _count_pruned(result: SearchResult, space: Space) -> None:
    for p in space.pruned:
        _reject(result, p.reason, p.layout)


def _reason_kind(why: str) -> str:
    """A pruning reason without its numbers (``tp=N groups would cross nodes of N ranks``), for counting."""
    return re.sub(r"\d+(\.\d+)?", "N", why.split(". ")[0])[:100]


def _predict_all(space: Space, info, check_info, hw, predict, usable: float, seq_len: int, options, result,
                 say=lambda phase: None, prune: "_Pruner | None" = None) -> None:
    """Per base: ``check`` (against ``check_info``), then the least checkpointing that fits: the levels run
    from none to every block and the predicted peak does not grow along them, so: none (fits: done), every
    block (does not fit: nothing will), then a bisection between (at most ~log2(levels) more predictions).
    With ``prune``: bases whose throughput bound cannot reach the ``keep`` best found so far are skipped
    (kept in ``prune.skipped``; priced after all if the bound is ever seen to fail)."""
    levels = ac_levels(info, options)
    hopeless: set = set()  # groups where a smaller micro-batch fit at no checkpointing level
    for i_base, base in enumerate(space.bases):
        if i_base % 256 == 0:
            say(f"predicting candidate {i_base + 1:,} of {len(space.bases):,} on {space.meshes:,} layouts "
                f"({len(result.ranked):,} fit so far)")
        # a larger micro-batch needs more memory, within one accumulation regime: accumulating micro-batches keep
        # gradients unsharded (FSDP) where one micro-batch per step does not, so accum 1 is its own group
        group = (_group_key(base), base.grad_accum > 1)
        if group in hopeless:  # a larger micro-batch needs more memory: it cannot fit either
            continue
        base = base if base.seq_len == seq_len else Candidate(base.dims, base.methods, base.micro_batch,
                                                              base.grad_accum, seq_len)
        if prune is not None and prune.skip(base):
            continue
        if _predict_base(base, levels, info, check_info, hw, predict, usable, result, prune) == "hopeless":
            hopeless.add(group)
    if prune is not None and not prune.on and prune.skipped:
        _predict_skipped(prune, info, check_info, hw, predict, usable, seq_len, options, result, say)


def _predict_base(base, levels, info, check_info, hw, predict, usable, result, prune=None) -> str | None:
    """One base's ``check`` and checkpointing bisection (:func:`_predict_all`); the fitting level joins
    ``result.ranked``. Returns ``"hopeless"`` when no level fits."""
    why = check(base, check_info)
    if why:
        _reject(result, why, mesh_label(base.dims))
        return None
    probed: dict[int, Evaluated | None] = {}

    def probe(i: int) -> Evaluated | None:
        """Evaluated for level ``i`` (None: rejected by a check or an estimate hook)."""
        if i not in probed:
            probed[i] = _evaluate(with_extra(base, None if levels[i] is None else ("checkpoint", levels[i])),
                                  levels[i] is not None, info, check_info, hw, predict, usable, result, prune)
        return probed[i]

    def rank(ev: Evaluated) -> None:
        result.ranked.append(ev)
        if prune is not None:
            prune.add(ev)

    first = probe(0)
    if first is None:
        return None
    if first.fits:
        rank(first)
        return None
    if prune is not None and prune.skip_checkpointed(base, first):
        # checkpointing only adds time: no level can reach the best ``keep`` when none-at-all does not
        return None
    last = probe(len(levels) - 1) if len(levels) > 1 else first
    if last is None or not last.fits:
        return "hopeless"
    lo, hi = 0, len(levels) - 1  # lo does not fit, hi fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ev = probe(mid)
        if ev is not None and ev.fits:
            hi = mid
        else:
            lo = mid
    if prune is not None:
        for i, ev in probed.items():
            if i and ev is not None:
                prune.observe_checkpointed(first, ev)
    rank(probed[hi])  # type: ignore[arg-type]
    return None


def _predict_skipped(prune: "_Pruner | None", info, check_info, hw, predict, usable, seq_len, options, result,
                     say=lambda phase: None) -> None:
    """Price the bases ``prune`` skipped (the bound failed on a priced candidate, or the model-structure
    checks removed too many of the best), in their enumeration order, with no more skipping."""
    if prune is None or not prune.skipped:
        return
    prune.on = False
    todo, prune.skipped = prune.skipped, []
    say(f"pricing the {len(todo):,} candidates skipped by the throughput bound")
    levels = ac_levels(info, options)
    hopeless: set[str] = set()
    for base in todo:
        group = _group_key(base)
        if group in hopeless:
            continue
        if _predict_base(base, levels, info, check_info, hw, predict, usable, result) == "hopeless":
            hopeless.add(group)


class _Pruner:
    """The search's ``keep`` bound (:class:`~torchloom.search.bounds.StepBound`): a min-heap of the best
    ``keep`` fitting throughputs seen; a base is skipped when its throughput bound is below the heap's
    smallest (``used``: the largest threshold any skip used). Every priced candidate checks the bound; one
    failure turns skipping off (``on``)."""

    def __init__(self, keep: int, info, hw):
        from .bounds import StepBound

        self.keep, self.bound, self.on = keep, StepBound(info, hw), True
        self.best: list[float] = []
        self.skipped: list[Candidate] = []
        self.skipped_count = 0
        self.used = 0.0

    def skip(self, base: Candidate) -> bool:
        if not self.on or len(self.best) < self.keep:
            return False
        t = self.best[0]
        if self.bound.tokens_per_s(base) < t:
            self.skipped.append(base)
            self.skipped_count += 1
            self.used = max(self.used, t)
            return True
        return False

    def add(self, ev: Evaluated) -> None:
        tps = ev.prediction.tokens_per_s
        if len(self.best) < self.keep:
            heapq.heappush(self.best, tps)
        elif tps > self.best[0]:
            heapq.heapreplace(self.best, tps)

    def skip_checkpointed(self, base: Candidate, first: Evaluated) -> bool:
        """Skip the checkpointing levels of ``base`` when its level-0 prediction ``first`` (which did not fit) is
        already below the ``keep`` best: the cost model's step time does not fall as checkpointing grows (it
        adds recomputation ``R``; the larger backward window hides at most ``R`` more communication), so
        ``first``'s throughput bounds every level's. Checked on every bisection priced
        (:meth:`observe_checkpointed`)."""
        if not self.on or len(self.best) < self.keep:
            return False
        t = self.best[0]
        if first.prediction.tokens_per_s < t:
            self.skipped.append(base)
            self.skipped_count += 1
            self.used = max(self.used, t)
            return True
        return False

    def observe_checkpointed(self, first: Evaluated, ev: Evaluated) -> None:
        """The guard of :meth:`skip_checkpointed`: a checkpointed level predicted faster than level 0 turns
        skipping off (what was skipped is priced after all)."""
        if self.on and ev.prediction.step_time_s < first.prediction.step_time_s * (1 - 1e-9):
            log.warning("search: %s predicted faster (%.6g s) than without checkpointing (%.6g s); pricing every "
                        "candidate", ev.candidate.label(), ev.prediction.step_time_s, first.prediction.step_time_s)
            self.on = False

    def observe(self, ev: Evaluated) -> None:
        if self.on and not self.bound.holds(ev.candidate, ev.prediction.step_time_s):
            log.warning("search: the throughput bound failed on %s (predicted %.6g s < bound %.6g s); pricing "
                        "every candidate", ev.candidate.label(), ev.prediction.step_time_s,
                        self.bound.seconds(ev.candidate))
            self.on = False

    def exact(self, ranked: list[Evaluated]) -> bool:
        """Whether the first ``keep`` of ``ranked`` are what pricing everything gives: nothing was skipped, or
        the ``keep``-th is at least the threshold every skipped candidate fell below."""
        if not self.skipped_count or not self.skipped:
            return True
        return len(ranked) >= self.keep and ranked[self.keep - 1].prediction.tokens_per_s >= self.used


_AC_CHECKED: dict[str, str | None] = {}


def _ac_check(cand: Candidate, check_info: ModelInfo) -> str | None:
    """``check`` of a base (already checked) plus a checkpointing level, memoised per model, method names and
    level: checkpointing declares no mesh dimension and its ``validate`` reads the module's blocks only, so
    the answer does not depend on the degrees or the other methods' configs (saves a Strategy build per
    candidate and level on large worlds)."""
    key = repr((check_info.signature or id(check_info), check_info.module is not None, tuple(cand.names),
                sorted((cand.config("checkpoint") or {}).items())))
    if key not in _AC_CHECKED:
        _AC_CHECKED[key] = check(cand, check_info)
    return _AC_CHECKED[key]


def _evaluate(cand, checked: bool, info, check_info, hw, predict, usable, result, prune=None) -> Evaluated | None:
    if checked:
        why = _ac_check(cand, check_info)
        if why:
            _reject(result, why, mesh_label(cand.dims))
            return None
    try:
        pred = predict(cand, info, hw)
    except StrategyError as e:  # an estimate hook found what validate did not (e.g. too few units)
        _reject(result, str(e), mesh_label(cand.dims))
        return None
    ev = Evaluated(cand, pred, pred.peak_memory_bytes <= usable)
    result.evaluated.append(ev)
    if prune is not None:
        prune.observe(ev)
    return ev


def _check_structure(result: SearchResult, info: ModelInfo, keep: int) -> None:
    """The model-structure checks (``validate`` hooks on the meta-device module: TP plan resolution, the
    pipeline's stage plan; ~10 ms each on a 70B model) in rank order, until ``keep`` candidates passed: those
    failing leave the ranking (counted in ``pruned_reasons``); the ones below stay, ``validated=False``."""
    kept, out = 0, []
    for i, e in enumerate(result.ranked):
        if kept >= keep:
            for rest in result.ranked[i:]:
                rest.validated = False
            out += result.ranked[i:]
            break
        why = check(e.candidate, info)
        if why:
            _reject(result, why, mesh_label(e.candidate.dims))
            continue
        kept += 1
        out.append(e)
    result.ranked = out


def _check_structure_exact(result: SearchResult, info: ModelInfo, keep: int, prune: "_Pruner | None",
                           reprice: Callable[[], None]) -> None:
    """:func:`_check_structure`; when the checks removed so many of the best that the bound's skips may hide
    one of the ``prune.keep`` best, undo them, price the skipped bases and check again."""
    if prune is None or not prune.skipped:
        _check_structure(result, info, keep)
        return
    saved = (list(result.ranked), dict(result.pruned_reasons), result.pruned_count, dict(result.pruned_examples),
             {k: set(v) for k, v in result.pruned_layouts.items()})
    _check_structure(result, info, keep)
    if prune.exact(result.ranked):
        return
    result.ranked, result.pruned_reasons, result.pruned_count, result.pruned_examples, result.pruned_layouts = saved
    for e in result.ranked:
        e.validated = True
    reprice()
    result.ranked.sort(key=rank_key)
    _check_structure(result, info, keep)


def _group_key(c: Candidate) -> str:
    """Candidates that differ only in the batch split (micro-batch, accumulation / pipeline micro-batches)."""
    methods = [[n, {k: v for k, v in cfg.items() if k != "num_microbatches"}] for n, cfg in c.methods]
    return repr((c.dims, methods))  # the dataclass's repr names every degree (as_dict deep-copies: slow)


def _reject(result: SearchResult, why: str, layout: str = "") -> None:
    reason = _reason_kind(why)
    result.pruned_reasons[reason] = result.pruned_reasons.get(reason, 0) + 1
    result.pruned_count += 1
    result.pruned_examples.setdefault(reason, why)
    if layout:
        result.pruned_layouts.setdefault(reason, set()).add(layout)


def _confirm(result: SearchResult, top: list[Evaluated], runner: Runner, options: SearchOptions, t0: float) -> None:
    spent = time.perf_counter() - t0
    remaining = options.time_limit_s - spent
    cands = [e.candidate for e in top]
    if remaining <= 0:  # the enumeration and predictions used the whole limit: no trial can start
        why = (f"the search's time limit of {options.time_limit_s:.3g} s (time_limit_s) was spent before the trials "
               f"(enumeration and predictions took {spent:.3g} s)")
        result.trials += [Trial(e.candidate, e.prediction, error=why, status="skipped") for e in top]
        _fall_back(result, f"search: no confirming run started: {why}; using the best predicted plan "
                           f"{result.chosen.label()} without a measurement (raise time_limit_s to confirm it)")
        return
    log.info("search: confirming the %d best predicted plans with real runs (%.0f s left of %g s)", len(cands),
             max(remaining, 0.0), options.time_limit_s)
    results = runner(cands, total_time_s=max(remaining, 0.0), time_budget_s=max(remaining, 0.0) / len(cands),
                     steps=options.trial_steps)
    by_key = {e.candidate.key(): e.prediction for e in top}
    for r in results:
        result.trials.append(Trial(r.candidate, by_key.get(r.candidate.key()), r.step_time_s,
                                   r.peak_memory_bytes, None if _ok(r) else (r.error or r.status), r.wall_s,
                                   getattr(r, "status", "ok" if _ok(r) else "error")))
    done = [t for t in result.trials if t.ok]
    if done:
        rank = {e.candidate.key(): i for i, e in enumerate(result.ranked)}
        best = min(done, key=lambda t: (t.step_time_s, rank.get(t.candidate.key(), 0)))
        result.chosen, result.chosen_by = best.candidate, "measured"
        return
    msg = (f"search: none of the {len(cands)} confirming runs finished ("
           + "; ".join(f"{t.candidate.label()}: {t.error}" for t in result.trials)[:400]
           + f"); using the best predicted plan {result.chosen.label()} without a measurement")
    _fall_back(result, msg)


def _fall_back(result: SearchResult, msg: str) -> None:
    """Warn that the plan is chosen by prediction alone: ``warnings.warn`` (shown in a plain script), and the
    ``torchloom.search`` logger at WARNING when someone listens to it (``loom train``'s log) -- not both
    printed to a bare stderr, where an unconfigured logger would repeat the warning."""
    warnings.warn(msg, UserWarning, stacklevel=4)
    if log.hasHandlers():
        log.warning("%s", msg)
    result.notes.append(msg)


def _ok(r: Any) -> bool:
    ok = getattr(r, "ok", None)
    if ok is not None:
        return bool(ok)
    return r.error is None and r.step_time_s is not None


def _log_table(result: SearchResult) -> None:
    from ..utils import rank

    if rank() == 0:
        log.info("%s\n%s", result.notes[0], result.table())


def _is_batch(reason: str) -> bool:
    return reason.startswith(BATCH_REASONS)


def refusals(result: SearchResult) -> list[tuple[str, int, int]]:
    """The search's refusals as ``(reason kind, layouts removed, candidates removed)``, batch arithmetic first
    (the user's global batch or pinned micro-batch: the usual cause, and the easiest to change), then by how
    many layouts (mesh degrees) each removed, then by candidates. A layout pruned whole counts once as a
    candidate (its candidates were never enumerated)."""
    rows = [(k, len(result.pruned_layouts.get(k, ())), n) for k, n in result.pruned_reasons.items()]
    return sorted(rows, key=lambda r: (not _is_batch(r[0]), -r[1], -r[2]))


def _batch_fix(gb: int, dps: set[int]) -> str:
    """``a global batch divisible by D (e.g. lo or hi)`` for the data-parallel degrees ``dps`` that ``gb``
    does not split over."""
    d = math.lcm(*dps) if dps else 1
    lo, hi = gb // d * d, (gb // d + 1) * d
    eg = f"{lo:,} or {hi:,}" if lo else f"{hi:,}"
    return f"a global batch divisible by {d:,} (e.g. {eg})"


def _batch_note(result: SearchResult, space: Space) -> str | None:
    """When the global batch ruled layouts out of a search that still found plans: say which, and the fix."""
    if not space.batch_dps:
        return None
    n = sum(len(v) for k, v in result.pruned_layouts.items() if k.startswith("global batch "))
    dps = ", ".join(str(d) for d in sorted(space.batch_dps))
    return (f"global batch {result.global_batch:,} is not divisible by dp={dps}: {n:,} of the {space.layouts:,} "
            f"layouts were not considered; {_batch_fix(result.global_batch, space.batch_dps)} lets the search "
            f"try them")


def _layouts(n: int) -> str:
    return f"{n:,} layout{'s' if n != 1 else ''}"


def rank_key(e) -> tuple:
    """Ranking order: predicted throughput (to 4 significant digits: closer is a tie the model cannot
    resolve), then the smaller peak memory (ZeRO-3 before ZeRO-2 at the same speed), then the candidate."""
    return (-float(f"{e.prediction.tokens_per_s:.4g}"), e.prediction.peak_memory_bytes, e.candidate.key())


def _no_valid_message(result: SearchResult, world: int, options: SearchOptions, space: Space) -> str:
    """Why no candidate is valid: pinned degrees that cannot fit the world size, then the main cause (the
    first of :func:`refusals`: batch arithmetic, else the refusal that removed the most layouts) with its fix,
    then every refusal in that order with its first full message (a ``validate`` hook's, naming the fix)."""
    lines = []
    for k in ("pp", "dp_replicate", "dp_shard", "dp", "tp"):
        v = options.fixed.get(k)
        if isinstance(v, int) and v > 0 and world % v:
            lines.append(f"{k}={v} does not divide the world size {world} (pin a divisor of {world} or drop "
                         f"'{k}' from search['fixed'])")
    pinned = [options.fixed[k] for k in ("pp", "dp", "tp") if isinstance(options.fixed.get(k), int)]
    if not lines and pinned and world % math.prod(pinned):
        lines.append(f"the pinned degrees {dict((k, options.fixed[k]) for k in ('pp', 'dp', 'tp') if k in options.fixed)} "
                     f"multiply to {math.prod(pinned)}, which does not divide the world size {world}")
    rows = refusals(result)
    total = space.layouts

    def example(k: str) -> str:
        return result.pruned_examples.get(k, k).rstrip(". ")

    if rows and not lines:
        k, n, _ = rows[0]
        shown = sorted(result.pruned_layouts.get(k, ()))
        where = f" ({', '.join(shown[:4])}{', ...' if len(shown) > 4 else ''})" if shown else ""
        cause = f"{example(k)}, which rules out {n:,} of the {_layouts(total)}{where}"
        if k.startswith("global batch "):
            cause += f"; use {_batch_fix(result.global_batch, space.batch_dps)}"
        if len(rows) > 1:
            cause += "; the other refusals are listed below"
        lines.append(f"Main cause: {cause}")

    def item(k: str, n_layouts: int, n: int) -> str:
        count = _layouts(n_layouts) + (f" ({n:,} candidates)" if n != n_layouts else "")
        return f"{count}: {example(k)}"

    detail = "; ".join(item(*r) for r in rows[:6])
    if len(rows) > 6:
        detail += f"; and {len(rows) - 6} more kinds"
    head = (f"search: no valid candidate on {world} ranks ({_layouts(total)}; {result.pruned_count} refusals"
            + (", none left to predict)" if not result.evaluated else
               f", {len(result.evaluated)} predicted)"))
    return head + ". " + " ".join(l + "." for l in lines) + (" " if lines else "") + \
        f"Refusals, batch arithmetic first, then by layouts removed: {detail or 'nothing enumerated'}."


def _no_fit_message(result: SearchResult, info: ModelInfo, world: int, hw: Hardware, usable: float,
                    options: SearchOptions, space: Space) -> str:
    gib = _size
    per_param = 4 if info.param_dtype == "float32" else 2
    state = info.n_params * per_param + info.n_trainable * (per_param + 8)  # params + grads + Adam (fp32)
    devices = max(1, math.ceil(state / usable))
    head = (f"the model fits no candidate on {world} ranks of {hw.name}: {gib(usable)} usable per rank "
            f"({gib(hw.memory_bytes)} x (1 - headroom {options.headroom:g}))")
    if result.evaluated:
        smallest = min(result.evaluated, key=lambda e: e.prediction.peak_memory_bytes)
        p = smallest.prediction
        parts = ", ".join(f"{k} {gib(v)}" for k, v in p.memory.items() if v)
        head += (f"; the smallest, {smallest.candidate.label()}, needs {gib(p.peak_memory_bytes)} "
                 f"({gib(p.peak_memory_bytes - usable)} over: {parts})")
        mb = smallest.candidate.micro_batch
    else:
        need = min(state_lower_bound(info, d, "zero3" if d.dp > 1 else None) for d in factorisations(world))
        head += f"; even the parameters and gradients alone need {gib(need)} per rank on the best mesh"
        mb = None
    fixes = []
    batch = _batch_note(result, space)
    if batch:  # layouts never predicted: the memory verdict covers only the others
        fixes.append(f"{_batch_fix(result.global_batch, space.batch_dps)} ({batch.split(': ', 1)[1].split(';')[0]})")
    if devices > world:  # advising "at least N devices" with N <= the current count would be wrong
        fixes.append(f"more devices (parameters, gradients and Adam state alone need ~{gib(state)}: at least "
                     f"{devices} devices of this memory)")
    if hw.device_type != "cpu":
        fixes.append("CPU offload (fsdp cpu_offload; " + ("it is excluded: drop 'cpu_offload' from "
                     "search['exclude'])" if "cpu_offload" in options.exclude else "tried: not enough alone)"))
    if mb is None or mb > 1:
        pinned = options.fixed.get("micro_batch")
        fixes.append(f"a smaller micro-batch (search={{'fixed': {{'micro_batch': 1}}}}"
                     + (f" instead of the pinned {pinned})" if pinned else ")"))
    if "checkpoint" in options.exclude:
        fixes.append("activation checkpointing (drop 'checkpoint' from search['exclude'])")
    if not fixes:
        fixes.append("devices with more memory per rank")
    return head + ". What would make it fit: " + "; ".join(fixes) + "."


def _size(b: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (``1.50 GiB``, ``48.8 KiB``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"

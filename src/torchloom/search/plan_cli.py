"""What ``loom plan`` does: resolve the model and the cluster, analyse the model on the meta device, then either
search the strategy space or evaluate one given strategy with the cost model, and render the ranked result
(table, ``--explain`` breakdown, ``--json``). Nothing runs and the model is never allocated.

The command itself (options, exit codes) lives in :mod:`torchloom.cli`; see ``docs/plan.md``.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import StrategyError, TorchloomError
from .candidate import Candidate, Prediction
from ..cost.cluster import ClusterSpec, cluster_hardware, cluster_spec
from ..cost.hardware import Hardware
from ..cost.model_info import ExpertsInfo
from ..cost.presets import ModelSpec, resolve_model

GiB = 1024.0 ** 3
MEMORY_ORDER = ("params", "grads", "optimizer", "activations", "temporary", "headroom")
JSON_SCHEMA_VERSION = 1

#: sanity bounds on the sizes ``loom plan`` accepts (exit 2 above them, naming the bound): beyond them a plan
#: is a typo (``--gpus 1000000``) more often than a cluster, and the search would run for minutes
MAX_GPUS = 131_072
MAX_GPUS_PER_NODE = 1_024
MAX_LOCAL_PROCESSES = 256
MAX_SEQ_LEN = 2 ** 24
MAX_GLOBAL_BATCH = 2 ** 24
#: seconds before ``loom plan`` says on stderr what it is doing, and between such lines after
PROGRESS_AFTER_S = 3.0
PROGRESS_EVERY_S = 10.0


class NoFit(StrategyError):
    """No candidate fits the devices' memory (the message: how much the smallest overflows, what would fit)."""


class Progress:
    """Says on stderr what a long plan is doing: nothing for the first ``after_s`` seconds (a plan normally
    takes less), then ``loom plan: <phase> (<n> s so far)`` every ``every_s`` seconds, from :meth:`update`
    and from a background timer (one long phase, e.g. the analysis of a 405B model, updates nothing).

    Use as a context manager; :meth:`update` sets the current phase (cheap: the search calls it per batch of
    candidates).
    """

    def __init__(self, echo=None, after_s: float | None = None, every_s: float | None = None):
        import threading

        self.echo = echo or _echo_err
        self.after_s = PROGRESS_AFTER_S if after_s is None else after_s
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.phase = "starting"
        self._t0 = time.perf_counter()
        self._last: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="loom-plan-progress", daemon=True)

    def __enter__(self) -> "Progress":
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def update(self, phase: str) -> None:
        """Set the current phase; print it when a line is due."""
        self.phase = phase
        self._maybe_print()

    def _maybe_print(self) -> None:
        with self._lock:
            now = time.perf_counter()
            if now - self._t0 < self.after_s or (self._last is not None and now - self._last < self.every_s):
                return
            self._last = now
            self.echo(f"loom plan: {self.phase} ({now - self._t0:.0f} s so far)")

    def _tick(self) -> None:
        while not self._stop.wait(min(0.5, max(self.every_s, 0.01))):
            self._maybe_print()


def _echo_err(text: str) -> None:
    import click

    click.echo(text, err=True)


@dataclass
class PlanRow:
    """One evaluated candidate: its rank (1 = best), the candidate and the cost model's prediction."""

    rank: int
    candidate: Candidate
    prediction: Prediction

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "label": self.candidate.label(), "fits": self.prediction.fits,
                "candidate": self.candidate.to_dict(), "strategy": self.candidate.strategy().to_dict(),
                "prediction": self.prediction.to_dict()}


@dataclass
class PlanReport:
    """Everything ``loom plan`` prints.

    Attributes:
        model: the resolved model (name, source); ``n_params`` whole-model parameter elements.
        cluster: the cluster description; ``hardware`` its :class:`Hardware`.
        seq_len / global_batch: what the plan is for (tokens per sample, samples per optimizer step).
        rows: evaluated candidates, best first (every one that fits, or the one ``--strategy`` gave).
        evaluated: how many candidates the search predicted (after ``validate`` pruning), for the summary.
        skipped: candidates the search did not price because their throughput bound was below the ``keep``
            best (``plan(keep=...)``; ``loom plan`` keeps ``--top``): then ``rows`` are exact down to ``keep``
            and partial below.
        mode: ``"search"`` or ``"strategy"``.
        wall_s: seconds spent (analysis + search).
        notes: assumptions (guessed sequence length, default global batch, ...).
        experts: the model's routed experts (``ModelInfo.experts``), None for a dense model.
    """

    model: ModelSpec
    n_params: int
    cluster: ClusterSpec
    hardware: Hardware
    seq_len: int
    global_batch: int
    rows: list[PlanRow]
    evaluated: int
    mode: str
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    experts: ExpertsInfo | None = None
    skipped: int = 0

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        rows = self.rows if top is None else self.rows[:top]
        hw = self.hardware
        return {
            "schema": JSON_SCHEMA_VERSION,
            "model": {"name": self.model.name, "source": self.model.source, "n_params": self.n_params,
                      **({"experts": asdict(self.experts)} if self.experts is not None else {})},
            "cluster": {"gpu": self.cluster.gpu, "gpus": self.cluster.gpus, "gpus_per_node": self.cluster.gpus_per_node,
                        "local": self.cluster.local, "hardware": hw.name, "memory_bytes": hw.memory_bytes,
                        "peak_flops": dict(hw.peak_flops)},
            "seq_len": self.seq_len, "global_batch": self.global_batch, "mode": self.mode, "fits": self.fits,
            "evaluated": self.evaluated, **({"skipped": self.skipped} if self.skipped else {}),
            "wall_s": round(self.wall_s, 3), "notes": list(self.notes),
            "candidates": [r.to_dict() for r in rows],
        }

    @property
    def fits(self) -> bool:
        """Whether the best row (the ``--strategy`` one, or the search's first) fits device memory: exit code 0
        (else 1), in the table and in ``--json`` alike."""
        return bool(self.rows) and self.rows[0].prediction.fits


# ------------------------------------------------------------------------------------------ planning
def plan(model: str, *, gpu: str | None = None, gpus: int | None = None, gpus_per_node: int | None = None,
         local: bool = False, nproc: int | None = None, seq_len: int | None = None,
         global_batch: int | None = None, micro_batch: int | None = None, strategy: str | None = None,
         search_options: dict[str, Any] | None = None, hardware: Hardware | None = None,
         sample: str | None = None, input_format: str | None = None,
         progress: Progress | None = None, keep: int | None = None) -> PlanReport:
    """Plan ``model`` on a cluster (the arguments of :func:`~torchloom.cost.cluster.cluster_spec`).

    Args:
        model: a preset name, a ``config.json`` path or ``pkg.module:factory`` (:func:`resolve_model`).
        seq_len: tokens per sample (default: the preset's, else the config's, capped; noted).
        global_batch: samples per optimizer step (default: one sample per device, i.e.
            ``gpus``; noted).
        micro_batch: with ``strategy``: samples per rank per forward (default: the global batch split evenly
            over the data-parallel ranks, no accumulation).
        strategy: evaluate this strategy instead of searching (:func:`parse_strategy_option`).
        search_options: the search's pins/excludes (``{"exclude": [...], "fixed": {"tp": 8}}``).
        hardware: use this :class:`Hardware` instead of building it from the cluster options (tests).
        sample / input_format: for a factory model: ``pkg.module:fn`` returning one micro-batch-1 batch, and
            how it is passed (:func:`~torchloom.cost.presets.resolve_model`).
        progress: told each phase (:class:`Progress`: ``loom plan`` says on stderr what a long plan does).
        keep: only the best ``keep`` rows are needed: the search skips candidates that provably rank below
            them (``search(keep=...)``; ``report.skipped`` counts them). None: every candidate is priced.

    Raises:
        TorchloomError: a bad model, cluster or strategy (the message names it), a size above the sanity
            bounds (:data:`MAX_GPUS`, ...), or no candidate that fits (how much the smallest overflows and
            what would make it fit).
    """
    t0 = time.perf_counter()
    say = progress.update if progress is not None else (lambda phase: None)
    check_sizes(gpus=gpus, gpus_per_node=gpus_per_node, nproc=nproc, seq_len=seq_len, global_batch=global_batch,
                micro_batch=micro_batch)
    say(f"resolving the model {model}")
    spec = resolve_model(model, sample=sample, input_format=input_format)
    cl = cluster_spec(gpu=gpu, gpus=gpus, gpus_per_node=gpus_per_node, local=local, nproc=nproc)
    notes: list[str] = []
    seq = seq_len or spec.default_seq_len()
    if global_batch is None:
        global_batch = cl.gpus
        notes.append(f"global batch {global_batch} (one sample per device per step; pass --global-batch to choose)")
    say("calibrating this machine" if cl.local else f"building the {cl.gpu} cluster model")
    hw = hardware if hardware is not None else cluster_hardware(cl)
    say(f"analysing {spec.name} on the meta device at {seq:,} tokens per sample")
    # a GPU cluster runs attention as a flash kernel; this machine as it dispatches it
    info = spec.analyze(seq, attention="native" if hw.device_type == "cpu" else "flash")
    notes = [*spec.notes, *notes]
    if strategy is not None:
        say(f"evaluating the strategy on {cl.gpus:,} ranks")
        cand = strategy_candidate(strategy, info, cl.gpus, global_batch, seq, micro_batch)
        rows = [PlanRow(1, cand, _predict(cand, info, hw))]
        evaluated, mode, skipped = 1, "strategy", 0
    else:
        say(f"searching the plans for {cl.gpus:,} ranks")
        search_options = _compile_config(search_options or {}, info, notes)
        result = _search(info, hw, cl.gpus, global_batch, seq, micro_batch, search_options, progress=say,
                         keep=keep)
        rows = _rows(result)
        evaluated, search_notes, skipped = len(result.evaluated), list(result.notes), result.skipped
        notes += [n for n in search_notes if not n.startswith("search: ")]
        mode = "search"
    return PlanReport(spec, info.n_params, cl, hw, seq, global_batch, rows, evaluated, mode,
                      time.perf_counter() - t0, notes, experts=info.experts, skipped=skipped)


def _compile_config(options: dict[str, Any], info, notes: list[str]) -> dict[str, Any]:
    """An included ``compile`` without a config compiles the blocks and, when the model's loss is a Hugging
    Face ``loss_function`` the analysis could trace fused, the loss too (torchtitan's default components)."""
    from .options import canonical_choice

    included = {canonical_choice(n) for n in options.get("include") or ()}
    configured = {canonical_choice(n) for n in options.get("configs") or {}}
    if "compile" not in included or "compile" in configured:
        return options
    loss = info.rest is not None and bool(info.rest.peak_extra_fused)
    components = ["model", "loss"] if loss else ["model"]
    notes.append(f"compile: every candidate compiles {' and '.join(components)} (Inductor)")
    return {**options, "configs": {**(options.get("configs") or {}), "compile": {"components": components}}}


def check_sizes(*, gpus: int | None = None, gpus_per_node: int | None = None, nproc: int | None = None,
                seq_len: int | None = None, global_batch: int | None = None, micro_batch: int | None = None) -> None:
    """Each given size is >= 1 and at most its sanity bound (:data:`MAX_GPUS`, :data:`MAX_GPUS_PER_NODE`,
    :data:`MAX_LOCAL_PROCESSES`, :data:`MAX_SEQ_LEN`, :data:`MAX_GLOBAL_BATCH`; the micro-batch at most the
    global batch).

    Raises:
        StrategyError: the option, its value and the bound.
    """
    bounds = (("--gpus", gpus, MAX_GPUS, "devices", "MAX_GPUS"),
              ("--gpus-per-node", gpus_per_node, MAX_GPUS_PER_NODE, "devices per node", "MAX_GPUS_PER_NODE"),
              ("--nproc", nproc, MAX_LOCAL_PROCESSES, "processes on this machine", "MAX_LOCAL_PROCESSES"),
              ("--seq-len", seq_len, MAX_SEQ_LEN, "tokens per sample", "MAX_SEQ_LEN"),
              ("--global-batch", global_batch, MAX_GLOBAL_BATCH, "samples per step", "MAX_GLOBAL_BATCH"),
              ("--micro-batch", micro_batch, global_batch or MAX_GLOBAL_BATCH, "samples per rank per forward", None))
    for opt, v, hi, unit, name in bounds:
        if v is None:
            continue
        if v < 1:
            raise StrategyError(f"{opt} must be >= 1, got {v}.")
        if v > hi:
            if name is None:
                raise StrategyError(f"{opt} {v:,} is more than the global batch {hi:,}; a micro-batch is a part of "
                                    f"one data-parallel rank's share of the global batch.")
            raise StrategyError(f"{opt} {v:,} is above loom plan's bound of {hi:,} {unit} (torchloom.search."
                                f"plan_cli.{name}): a plan that large is more often a typo than a cluster, and its "
                                f"search would take minutes; check the number.")


def search_rows(info, hw: Hardware, world: int, global_batch: int, seq_len: int, micro_batch: int | None,
                options: dict[str, Any], progress=None) -> tuple[list[PlanRow], int, list[str]]:
    """Rank the search space's candidates by predicted throughput with :func:`torchloom.search.search.search`
    (predictions only: ``top_k=0``, no runner; nothing runs).

    Args:
        progress: ``progress(phase)`` is told what the search is doing (``search(progress=...)``).

    Returns:
        ``(rows that fit, best first; how many candidates were predicted; the search's notes)``.

    Raises:
        NoFit: no candidate fits (the search's message: how much the smallest overflows, what would fit).
        StrategyError: bad search options.
    """
    result = _search(info, hw, world, global_batch, seq_len, micro_batch, options, progress)
    return _rows(result), len(result.evaluated), list(result.notes)


def _search(info, hw: Hardware, world: int, global_batch: int, seq_len: int, micro_batch: int | None,
            options: dict[str, Any], progress=None, keep: int | None = None):
    """:func:`search_rows`'s search: the :class:`~torchloom.search.result.SearchResult` (``keep`` as in
    :func:`plan`)."""
    from .search import search

    opts = dict(options)
    opts["top_k"] = 0
    if micro_batch is not None:
        opts["fixed"] = {**opts.get("fixed", {}), "micro_batch": micro_batch}
    try:
        return search(world_size=world, global_batch=global_batch, hw=hw, info=info, seq_len=seq_len,
                      options=opts, progress=progress, keep=keep)
    except StrategyError as e:
        if "fits no candidate" in str(e):
            raise NoFit(str(e)) from e
        raise


def _rows(result) -> list[PlanRow]:
    return [PlanRow(i + 1, e.candidate, e.prediction) for i, e in enumerate(result.ranked)]


def _predict(cand: Candidate, info, hw: Hardware) -> Prediction:
    from .pricing import predict

    return predict(cand, info, hw)


# ------------------------------------------------------------------------------ --strategy evaluation
def parse_strategy_option(text: str):
    """The ``--strategy`` value as a :class:`~torchloom.strategy.strategy.Strategy`: a strategy file (``.json``
    / ``.yaml``), an inline JSON/YAML list (``'[fsdp, {checkpoint: {every_k: 2}}, amp]'``) or a comma-separated
    list of method names (``fsdp,amp,checkpoint``). Mesh degrees go in a ``parallel_mode`` item
    (``'[{parallel_mode: {tp: 8}}, fsdp]'``).

    Raises:
        StrategyError: an unreadable value or an invalid strategy (the strategy check's message).
    """
    import yaml

    from ..strategy.strategy import Strategy

    s = text.strip()
    if not s:
        raise StrategyError("--strategy is empty; give methods (fsdp,amp), a list or a strategy file.")
    if s[0] in "[{":
        try:
            data = yaml.safe_load(s)
        except yaml.YAMLError as e:
            raise StrategyError(f"--strategy {s!r} is not a valid JSON/YAML list: {e}") from e
        return Strategy.parse(data if isinstance(data, list) else [data] if "methods" not in data else data)
    if Path(s).suffix.lower() in (".json", ".yaml", ".yml") or Path(s).is_file():
        return Strategy.load(s)
    return Strategy([n.strip() for n in s.split(",") if n.strip()])


def strategy_candidate(text: str, info, world: int, global_batch: int, seq_len: int,
                       micro_batch: int | None) -> Candidate:
    """The :class:`Candidate` ``auto_accelerate`` would run for ``--strategy text`` on ``world`` ranks: its mesh
    degrees (``api.plan_dims``: data parallel takes the rest), the data-parallel method it adds when none is
    given (DDP, or replicating FSDP under TP), each method's ``validate`` on the model, and the batch split.

    Raises:
        StrategyError: an invalid strategy, degrees that do not fit ``world``, a check ``apply`` would fail, or
            a global batch the data-parallel ranks and micro-batch cannot split evenly.
    """
    from ..api import plan_dims
    from ..strategy.config import config_to_dict
    from .validate import validate_strategy

    given = parse_strategy_option(text)
    dims = plan_dims(given, world)
    strat = validate_strategy(given, info, dims)  # with the data-parallel method auto_accelerate adds
    methods = tuple((e.name, config_to_dict(e.config)) for e in strat.entries
                    if not e.implied and e.name != "parallel_mode")
    dp = dims.dp
    if global_batch % dp:
        raise StrategyError(f"global batch {global_batch} does not split over {dp} data-parallel ranks; use a "
                            f"multiple of {dp} (--global-batch).")
    local = global_batch // dp
    mb = local if micro_batch is None else micro_batch
    if mb < 1 or local % mb:
        raise StrategyError(f"micro-batch {mb} does not divide the {local} samples per data-parallel rank "
                            f"(global batch {global_batch} / dp {dp}); choose a divisor of {local}.")
    return Candidate(dims, methods, mb, local // mb, seq_len)


# -------------------------------------------------------------------------------------------- command
def run_command(model: str, *, gpu=None, gpus=None, gpus_per_node=None, local=False, nproc=None, seq_len=None,
                global_batch=None, micro_batch=None, strategy=None, exclude=None, include=None, fixed=(), top=10,
                explain=None, as_json=False, sample=None, input_format=None) -> int:
    """``loom plan``: plan, print (table, ``--explain``, or ``--json``) and return the exit code, the same in
    both forms: 0 when the best row fits (``fits`` in the JSON), 1 when nothing fits or the ``--strategy``
    given does not (the message / ``fits: false`` says by how much and what would fit), 2 for bad input
    (named on stderr; with ``--json`` also as ``{"fits": false, "error": ..., "exit_code": 2}`` on stdout). Every
    JSON object has ``exit_code``. A plan that takes more than :data:`PROGRESS_AFTER_S` seconds says on stderr
    what it is doing."""
    import click

    try:
        if top < 1:
            raise StrategyError(f"--top must be >= 1, got {top}.")
        if strategy is not None and (exclude or include or fixed):
            raise StrategyError("--exclude/--include/--fix steer the search; with --strategy nothing is searched (put "
                                "the methods and the degrees in the strategy).")
        options = search_options_from_cli(exclude, fixed, include)
        with Progress() as progress:
            report = plan(model, gpu=gpu, gpus=gpus, gpus_per_node=gpus_per_node, local=local, nproc=nproc,
                          seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch, strategy=strategy,
                          search_options=options, sample=sample, input_format=input_format, progress=progress,
                          keep=max(top, explain or 0, 1))  # rows beyond --top / --explain need not be exact
        if explain is not None:
            explain_row(report, explain)
    except NoFit as e:
        click.echo(f"no fit: {e}", err=True)
        if as_json:  # the same fields as a plan that ran: nothing ranked, fits false, and why
            click.echo(json.dumps({"schema": JSON_SCHEMA_VERSION, "mode": "search", "fits": False,
                                   "candidates": [], "no_fit": str(e), "exit_code": 1}, indent=1))
        return 1
    except TorchloomError as e:
        click.echo(f"error: {e}", err=True)
        if as_json:  # a script reading stdout gets an object too
            click.echo(json_error(str(e)))
        return 2
    code = 0 if report.fits else 1
    if as_json:
        d = report.to_dict(top=top)
        d["exit_code"] = code
        if explain is not None:
            d["explain"] = explain_row(report, explain).to_dict()
        click.echo(json.dumps(d, indent=1, default=str))
        return code
    click.echo(render_table(report, top=top))
    if explain is not None:
        click.echo("")
        click.echo(render_explain(report, explain))
    return code


def json_error(message: str) -> str:
    """The ``--json`` output of a run refused for bad input (exit 2): ``{"schema", "fits": false, "error",
    "exit_code": 2}``, so a script parsing stdout gets an object in every case (the ``error:`` line stays on
    stderr)."""
    return json.dumps({"schema": JSON_SCHEMA_VERSION, "fits": False, "error": message, "exit_code": 2}, indent=1)


def search_options_from_cli(exclude: str | None, fixed, include: str | None = None) -> dict[str, Any]:
    """``--exclude a,b``, ``--include a,b`` and ``--fix dim=n`` as the search's options dict (checked by the
    search).

    Raises:
        StrategyError: a ``--fix`` that is not ``DIM=N`` with an integer N.
    """
    out: dict[str, Any] = {}
    if exclude:
        out["exclude"] = [x.strip() for x in exclude.split(",") if x.strip()]
    if include:
        out["include"] = [x.strip() for x in include.split(",") if x.strip()]
    pins: dict[str, int] = {}
    for item in fixed or ():
        k, sep, v = item.partition("=")
        try:
            if not sep:
                raise ValueError
            pins[k.strip()] = int(v)
        except ValueError:
            raise StrategyError(f"--fix {item!r}: write DIM=N, e.g. --fix tp=8 (dims: pp, dp, dp_replicate, "
                                f"dp_shard, tp, ep, cp, micro_batch).") from None
    if pins:
        out["fixed"] = pins
    return out


# ------------------------------------------------------------------------------------------ rendering
def render_table(report: PlanReport, top: int = 10) -> str:
    """The ranked table: step time, tokens/s per device, MFU (and the peak it divides by), memory per device
    by category in GiB, and a summary header."""
    hw, cl = report.hardware, report.cluster
    lines = [
        f"model    {report.model.name} ({count(report.n_params)} parameters; {report.model.source})",
        f"cluster  {cl.describe()}; {hw.memory_bytes / GiB:.1f} GiB per device",
        f"batch    global {report.global_batch} x seq {report.seq_len} = "
        f"{report.global_batch * report.seq_len:,} tokens per step",
    ]
    ex = report.experts
    if ex is not None:
        lines.insert(1, f"experts  {ex.layers} MoE layers x {ex.num_experts} experts, top-{ex.top_k}; "
                        f"{count(ex.params)} expert parameters, {count(ex.active_params)} active per "
                        f"token" + (f"; ep (expert parallel) searched over divisors of dp and {ex.num_experts}"
                                    if report.mode == "search" else ""))
    if report.mode == "search":
        skipped = (f" ({report.skipped:,} more skipped: their throughput bound is below the best shown)"
                   if report.skipped else "")
        lines.append(f"searched {report.evaluated:,} candidates in {report.wall_s:.2f} s{skipped}; "
                     f"{len(report.rows):,} fit; best {min(top, len(report.rows))} shown (--top)")
    lines += [f"note     {n}" for n in report.notes]
    width = max([9, *(len(r.candidate.label()) for r in report.rows[:top])])
    width = min(width, 100)
    head = (f"{'#':>3}  {'candidate':<{width}} {'step s':>8} {'tok/s/dev':>10} {'MFU':>6} {'peak TF/s':>9}  "
            + " ".join(f"{c[:6]:>6}" for c in MEMORY_ORDER) + f" {'total':>7} {'limit':>6}  (GiB)")
    lines += ["", head, "-" * len(head)]
    for r in report.rows[:top]:
        p = r.prediction
        mem = " ".join(f"{p.memory.get(c, 0.0) / GiB:6.1f}" for c in MEMORY_ORDER)
        flag = "" if p.fits else "  DOES NOT FIT"
        lines.append(f"{r.rank:>3}  {_clip(r.candidate.label(), width):<{width}} {p.step_time_s:8.3f} "
                     f"{p.tokens_per_s_per_device:10,.0f} {p.mfu * 100:5.1f}% {p.peak_flops / 1e12:9.1f}  {mem} "
                     f"{p.peak_memory_bytes / GiB:7.1f} {p.memory_limit_bytes / GiB:6.1f}{flag}")
    extra = set().union(*(r.prediction.memory for r in report.rows[:top])) - set(MEMORY_ORDER) if report.rows else ()
    if extra:
        lines.append(f"(other memory categories in the total: {', '.join(sorted(extra))}; see --explain)")
    lines.append("MFU = model FLOPs per second per device (no recomputation) / the peak named (dtype of the matmuls).")
    return "\n".join(lines)


def render_explain(report: PlanReport, n: int) -> str:
    """Candidate ``n``'s (1-based rank) full breakdown: strategy, time parts, memory parts, collectives, notes.

    Raises:
        StrategyError: ``n`` outside the ranked rows.
    """
    row = explain_row(report, n)
    c, p = row.candidate, row.prediction
    out = [f"candidate #{row.rank}: {c.label()}",
           f"  strategy      {json.dumps(c.strategy().to_dict()['methods'])}",
           f"  mesh          {c.dims.as_dict()}",
           f"  batch         micro-batch {c.micro_batch} x {c.grad_accum} accumulation x dp {c.dims.dp} = "
           f"global {c.global_batch}; seq {c.seq_len}",
           f"  step time     {p.step_time_s:.4f} s  ({p.tokens_per_s_per_device:,.0f} tokens/s per device, "
           f"{p.tokens_per_s:,.0f} in all)",
           f"  MFU           {p.mfu * 100:.1f}% of {p.peak_flops / 1e12:.1f} TFLOP/s per device", "", "  time (s)"]
    total = p.step_time_s or 1.0
    for k, v in sorted(p.time.items(), key=lambda kv: -kv[1]):
        out.append(f"    {k:<46} {v:10.4f}  {100 * v / total:5.1f}%")
    out.append(f"    {'= step':<46} {sum(p.time.values()):10.4f}")
    a2a = [col for col in p.collectives if col.get("kind") == "all_to_all"]
    if a2a:
        exposed = sum(col.get("exposed_s", 0.0) for col in a2a)
        views = sorted({f"{col['view']}={col['group']}" + (" across nodes" if col.get("spans_nodes") else "")
                        for col in a2a})
        out.append(f"    all-to-all share {exposed:.4f} s = {100 * exposed / total:.1f}% of the step "
                   f"({', '.join(views)}; on the critical path)")
    out += ["", "  memory per device (GiB)"]
    for k in [*MEMORY_ORDER, *sorted(set(p.memory) - set(MEMORY_ORDER))]:
        if k in p.memory:
            out.append(f"    {k:<46} {p.memory[k] / GiB:10.3f}")
    out.append(f"    {'= peak':<46} {p.peak_memory_bytes / GiB:10.3f}   (limit {p.memory_limit_bytes / GiB:.1f}; "
               f"{'fits' if p.fits else 'DOES NOT FIT'})")
    if p.collectives:
        out += ["", "  collectives per step"]
        for col in p.collectives:
            out.append("    " + ", ".join(f"{k}={_fmt_value(v)}" for k, v in col.items()))
    if p.notes:
        out += ["", "  notes"] + [f"    - {x}" for x in p.notes]
    return "\n".join(out)


def explain_row(report: PlanReport, n: int) -> PlanRow:
    if not 1 <= n <= len(report.rows):
        raise StrategyError(f"--explain {n}: there {'is' if len(report.rows) == 1 else 'are'} "
                            f"{len(report.rows)} ranked candidate(s); give 1..{len(report.rows)}.")
    return report.rows[n - 1]


def count(n: float) -> str:
    """A parameter count at a readable scale: ``70.55 B``, ``4.46 M``, ``12.30 K``, ``512`` (powers of 10)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


__all__ = ["PlanReport", "PlanRow", "plan", "parse_strategy_option", "strategy_candidate", "search_rows",
           "render_table", "render_explain", "TorchloomError"]

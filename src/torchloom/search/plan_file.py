"""Plan files: a search result saved as a normal strategy file plus a ``plan`` section.

A plan file is a strategy file (``{"version": 1, "methods": [...]}``, the chosen strategy with its
``parallel_mode`` degrees, readable by :meth:`Strategy.load` and ``auto_accelerate(strategy=path)`` without
searching) with one more key, ``plan``: the chosen candidate (batch split included), the predictions and
measurements of the search, and what it was made for (model signature, world size, global batch, sequence
length, machine fingerprint, search options). ``auto_accelerate`` refuses a plan made for another model,
world size, global batch or machine, naming each difference, unless ``search={"on_mismatch": "research"}``.

The plan cache (``strategy="auto"``): one plan file per (model signature, world size, global batch,
sequence length, machine fingerprint, search options) under ``$TORCHLOOM_CACHE_DIR/plans`` (else
``$TORCHLOOM_CACHE/plans``, else ``~/.cache/torchloom/plans``).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import StrategyError
from ..strategy.strategy import FORMAT_VERSION, Strategy
from .candidate import Candidate
from .result import SearchResult

PLAN_VERSION = 1
#: what a plan is checked against when loaded, and how the message names it
CHECKED = {"model": "model", "world_size": "world size", "global_batch": "global batch", "machine": "machine"}


@dataclass
class Plan:
    """The ``plan`` section of a plan file.

    Attributes:
        candidate: the chosen plan (degrees, methods, micro-batch, accumulation, sequence length).
        model: the model's signature (:func:`torchloom.cost.analysis.signature` of its parameters and
            buffers: names, shapes, dtypes) and its name.
        world_size / global_batch / seq_len: what the plan was searched for.
        machine: the machine fingerprint (:func:`torchloom.cost.calibrate.fingerprint`).
        options: the search options that shaped it (:meth:`SearchOptions.cache_dict`).
        search: the :class:`SearchResult` as a dict (ranked predictions, trials' measurements).
        created: UNIX time the plan was written.
    """

    candidate: Candidate
    model: dict[str, Any]
    world_size: int
    global_batch: int
    seq_len: int
    machine: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)
    search: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"plan_version": PLAN_VERSION, "candidate": self.candidate.to_dict(), "model": dict(self.model),
                "world_size": self.world_size, "global_batch": self.global_batch, "seq_len": self.seq_len,
                "machine": dict(self.machine), "options": dict(self.options), "search": dict(self.search),
                "created": self.created}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "plan") -> "Plan":
        if not isinstance(d, dict):
            raise StrategyError(f"{source}: the 'plan' section must be a mapping, got {type(d).__name__}.")
        if d.get("plan_version") != PLAN_VERSION:
            raise StrategyError(f"{source}: plan_version {d.get('plan_version')!r} is not supported (this torchloom "
                                f"reads {PLAN_VERSION}); search again with strategy='auto'.")
        missing = [k for k in ("candidate", "model", "world_size", "global_batch", "seq_len", "machine") if k not in d]
        if missing:
            raise StrategyError(f"{source}: the plan section lacks {missing}; search again with strategy='auto'.")
        try:
            cand = Candidate.from_dict(d["candidate"])
        except (KeyError, TypeError, ValueError) as e:
            raise StrategyError(f"{source}: unreadable plan candidate ({e}); search again with strategy='auto'.") from e
        return cls(cand, dict(d["model"]), int(d["world_size"]), int(d["global_batch"]), int(d["seq_len"]),
                   dict(d["machine"]), dict(d.get("options") or {}), dict(d.get("search") or {}),
                   float(d.get("created", 0.0)))

    @property
    def result(self) -> SearchResult | None:
        """The saved search result (predictions of the ranked candidates, the trials), if any."""
        return SearchResult.from_dict(self.search) if self.search.get("chosen") else None

    def dataloader_args(self) -> dict[str, int]:
        """``batch_size`` (global) and ``micro_batch_size`` (per rank per ``train_step`` call: under pipeline
        parallelism the micro-batch times the pipeline's micro-batch count) for ``auto_accelerate``."""
        return batch_args(self.candidate)

    def differences(self, *, model: str | None = None, world_size: int | None = None,
                    global_batch: int | None = None, machine: dict[str, Any] | None = None) -> list[str]:
        """What differs between the plan and the job (``None`` = not checked), one phrase each."""
        out = []
        if model is not None and self.model.get("signature") != model:
            out.append(f"model: the plan is for {self.model.get('name', '?')} with signature "
                       f"{self.model.get('signature')}, this model's is {model} (other parameter names, shapes or "
                       f"dtypes)")
        if world_size is not None and self.world_size != world_size:
            out.append(f"world size: the plan is for {self.world_size} ranks, this job has {world_size}")
        if global_batch is not None and self.global_batch != global_batch:
            out.append(f"global batch: the plan is for {self.global_batch} samples per step, this job uses "
                       f"{global_batch}")
        if machine is not None:
            diff = [f"{k} {self.machine.get(k)!r} vs {machine.get(k)!r}" for k in sorted({*self.machine, *machine})
                    if self.machine.get(k) != machine.get(k)]
            if diff:
                out.append("machine: " + ", ".join(diff) + " (plan vs here)")
        return out


def batch_args(cand: Candidate) -> dict[str, int]:
    """The candidate's batch split as ``auto_accelerate``'s ``dataloader_args`` (the same rule as the trials'
    runner): global batch, and the per-rank batch of one ``train_step`` call."""
    per_call = cand.micro_batch
    if cand.dims.pp > 1:
        per_call *= (cand.config("pipeline_parallel") or {}).get("num_microbatches") or cand.grad_accum
    return {"batch_size": cand.global_batch, "micro_batch_size": per_call}


def save_plan(path: str | Path, result: SearchResult, *, model: dict[str, Any], machine: dict[str, Any],
              options: dict[str, Any] | None = None) -> Path:
    """Write ``result`` as a plan file (JSON; the directory is created). ``model`` holds ``signature`` and
    ``name``; ``machine`` the fingerprint. Returns the path.

    Raises:
        StrategyError: a path that does not end in ``.json``.
    """
    path = Path(path)
    if path.suffix.lower() != ".json":
        raise StrategyError(f"a plan file is JSON: use a .json name, got '{path}'.")
    plan = Plan(result.chosen, model, result.world_size, result.global_batch, result.seq_len, machine,
                options or {}, result.to_dict(), time.time())
    data = {**result.chosen.strategy().to_dict(), "plan": plan.to_dict()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    return path


def read_plan(path: str | Path) -> tuple[Strategy, Plan | None]:
    """The strategy of a strategy/plan file and its plan section (None for a plain strategy file).

    Raises:
        StrategyError: what :meth:`Strategy.load` raises, or an unreadable plan section.
    """
    strategy = Strategy.load(path)
    data = _read_json(Path(path))
    if not isinstance(data, dict) or "plan" not in data:
        return strategy, None
    return strategy, Plan.from_dict(data["plan"], source=f"plan file '{path}'")


def refusal(path: str | Path, differences: list[str]) -> StrategyError:
    """The error for a plan that does not match the job."""
    return StrategyError(
        f"plan file '{path}' was made for another setup: " + "; ".join(differences) + ". Search again with "
        "strategy='auto' (or pass search={'on_mismatch': 'research'} to re-search automatically when a plan does not "
        "match), or give the methods without the 'plan' section to apply them anyway.")


def is_path_like(strategy: Any) -> bool:
    """True for a ``str``/``Path`` strategy that names a file (Strategy.parse's rule)."""
    from ..strategy.strategy import _is_path_like

    return isinstance(strategy, Path) or (isinstance(strategy, str) and _is_path_like(strategy))


# -------------------------------------------------------------------------------------------- the cache
def cache_dir() -> Path:
    """Where ``strategy="auto"`` caches plans."""
    for env in ("TORCHLOOM_CACHE_DIR", "TORCHLOOM_CACHE"):
        if os.environ.get(env):
            return Path(os.environ[env]) / "plans"
    return Path.home() / ".cache" / "torchloom" / "plans"


def cache_key(*, model: str, world_size: int, global_batch: int, seq_len: int, machine: dict[str, Any],
              options: dict[str, Any]) -> str:
    """24 hex digits naming the cached plan of one (model, world size, batch, sequence, machine, options)."""
    blob = json.dumps({"model": model, "world_size": world_size, "global_batch": global_batch, "seq_len": seq_len,
                       "machine": machine, "options": options, "v": PLAN_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cached_plan(key: str) -> tuple[Path, Strategy, Plan] | None:
    """The cached plan of ``key``, or None (missing or unreadable: an unreadable one is ignored, it is
    replaced by the next search)."""
    path = cache_dir() / f"{key}.json"
    if not path.exists():
        return None
    try:
        strategy, plan = read_plan(path)
    except StrategyError:
        return None
    return (path, strategy, plan) if plan is not None else None


def _read_json(path: Path) -> Any:
    if path.suffix.lower() != ".json":  # YAML strategy files never carry a plan section
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StrategyError(f"cannot read plan file '{path}': {e}") from e

"""What a search returns: every evaluated candidate's prediction, the confirming trials' measurements, the
chosen plan, and the ranked table printed to the log."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .candidate import Candidate, Prediction


def _prediction_from_dict(d: dict[str, Any] | None) -> Prediction | None:
    return None if d is None else Prediction(**d)


def _precision(cand: Candidate) -> str:
    """The compute precision of a candidate: ``amp``'s dtype, else float32."""
    amp = cand.config("amp")
    return "float32" if amp is None else str(amp.get("dtype", "bfloat16"))


@dataclass
class Evaluated:
    """One predicted candidate: its prediction, whether it fits memory (with the search's headroom), and
    whether the model-structure checks ran on it (``validated``; only the best ranked get them, see
    :func:`torchloom.search.search.search`)."""

    candidate: Candidate
    prediction: Prediction
    fits: bool
    validated: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate.to_dict(), "prediction": self.prediction.to_dict(), "fits": self.fits,
                "validated": self.validated}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Evaluated":
        return cls(Candidate.from_dict(d["candidate"]), _prediction_from_dict(d["prediction"]), bool(d["fits"]),
                   bool(d.get("validated", True)))


@dataclass
class Trial:
    """A confirming run of one candidate: measured seconds per optimizer step and peak memory per rank
    (bytes; the most loaded rank), or the error that stopped it (out of memory, a failing method, the
    budget). ``wall_s``: how long the trial took, including setup and teardown; ``status``: the runner's
    (``ok``, ``timeout``, ``oom``, ``error``, ``skipped``)."""

    candidate: Candidate
    prediction: Prediction | None
    step_time_s: float | None = None
    peak_memory_bytes: float | None = None
    error: str | None = None
    wall_s: float = 0.0
    status: str = "ok"

    @property
    def ok(self) -> bool:
        return self.error is None and self.step_time_s is not None and self.step_time_s > 0

    def tokens_per_s(self) -> float:
        c = self.candidate
        return c.global_batch * c.seq_len / self.step_time_s if self.ok else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate.to_dict(),
                "prediction": None if self.prediction is None else self.prediction.to_dict(),
                "step_time_s": self.step_time_s, "peak_memory_bytes": self.peak_memory_bytes, "error": self.error,
                "wall_s": self.wall_s, "status": self.status}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trial":
        return cls(Candidate.from_dict(d["candidate"]), _prediction_from_dict(d.get("prediction")),
                   d.get("step_time_s"), d.get("peak_memory_bytes"), d.get("error"), float(d.get("wall_s", 0.0)), d.get("status", "ok"))


@dataclass
class SearchResult:
    """The outcome of :func:`torchloom.search.search`.

    Attributes:
        chosen: the plan to apply.
        chosen_by: ``"measured"`` (fastest confirmed trial), ``"predicted"`` (no trial finished, or
            ``top_k=0``), ``"cache"`` / ``"plan"`` (reused from the plan cache or a plan file).
        ranked: candidates that fit memory, best predicted throughput first (one checkpointing level each).
        evaluated: every predicted candidate, fitting or not, in evaluation order.
        trials: the confirming runs, in the order they ran.
        pruned_count: candidates left out before prediction (by reason: ``pruned_reasons``).
        world_size / global_batch / seq_len: what the search planned for.
        elapsed_s: wall time of the whole search (predictions and trials).
        notes: what the search decided and why (warnings included).
        pruned_examples: per ``pruned_reasons`` key, the first full message of that kind (e.g. a
            ``validate`` hook's), for the error raised when nothing valid is left (not serialised).
        pruned_layouts: per ``pruned_reasons`` key, the layouts (mesh degrees, ``pp1 dpr2 dps1 tp1``) it
            removed candidates from, to order the refusals by reach (not serialised).
        sequence: whether a sample is a sequence of ``seq_len`` tokens; False (``seq_len`` 1) for a model whose
            input has no sequence dimension (a CNN's images, an MLP's feature vectors): throughput is then in
            samples per second, and :meth:`table` says so.
    """

    chosen: Candidate
    chosen_by: str
    ranked: list[Evaluated] = field(default_factory=list)
    evaluated: list[Evaluated] = field(default_factory=list)
    trials: list[Trial] = field(default_factory=list)
    pruned_count: int = 0
    pruned_reasons: dict[str, int] = field(default_factory=dict)
    world_size: int = 1
    global_batch: int = 1
    seq_len: int = 0
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    pruned_examples: dict[str, str] = field(default_factory=dict)
    pruned_layouts: dict[str, set[str]] = field(default_factory=dict)
    sequence: bool = True

    @property
    def chosen_prediction(self) -> Prediction | None:
        key = self.chosen.key()
        return next((e.prediction for e in self.evaluated if e.candidate.key() == key), None)

    def trial_of(self, cand: Candidate) -> Trial | None:
        key = cand.key()
        return next((t for t in self.trials if t.candidate.key() == key), None)

    def table(self, n: int = 10) -> str:
        """The ranked candidates as a text table: predicted step time, tokens/s per device (samples/s when
        the model has no sequence: ``sequence`` False), MFU (and the peak it divides by, per precision), peak
        memory per rank, and the measured step time of those that ran (or their status: ``skipped``,
        ``timeout``, ``oom``, ``error``). The candidate column is as wide as the longest label shown (labels
        are never cut)."""
        shown = self.ranked[:n]
        for t in self.trials:  # measured candidates always appear
            if all(e.candidate.key() != t.candidate.key() for e in shown):
                shown += [e for e in self.ranked if e.candidate.key() == t.candidate.key()]
        width = max([len("candidate"), *(len(e.candidate.label()) for e in shown)])
        rate = "tok/s/dev" if self.sequence else "samples/s/dev"
        head = (f"{'#':>3}  {'candidate':<{width}} {'pred ms':>9} {rate:>13} {'MFU':>6} {'mem GiB':>8} "
                f"{'meas ms':>9}")
        lines = [head, "-" * len(head)]
        peaks: dict[str, float] = {}
        for e in shown:
            p, t = e.prediction, self.trial_of(e.candidate)
            meas = "" if t is None else (f"{t.step_time_s * 1e3:9.1f}" if t.ok else f"{t.status or 'failed':>9}")
            mark = "*" if e.candidate.key() == self.chosen.key() else " "
            rank = self.ranked.index(e) + 1
            lines.append(f"{rank:>3}{mark} {e.candidate.label():<{width}} {p.step_time_s * 1e3:9.1f} "
                         f"{self._per_device(e):13,.0f} {p.mfu * 100:5.1f}% {p.peak_memory_bytes / 2**30:8.3f} "
                         f"{meas}")
            peaks.setdefault(_precision(e.candidate), p.peak_flops)
        peak = ", ".join(f"{v / 1e12:.3g} TFLOP/s ({k} rows)" for k, v in sorted(peaks.items())) or "0 TFLOP/s"
        unit = "" if self.sequence else ("; no sequence dimension: throughput in samples (global batch / step "
                                         "time / devices)")
        lines.append(f"({len(self.ranked)} fit, {len(self.evaluated)} predicted, {self.pruned_count} pruned; MFU "
                     f"divides by {peak} per device; * = chosen, by {self.chosen_by}{unit})")
        return "\n".join(lines)

    def _per_device(self, e: Evaluated) -> float:
        """Predicted tokens/s per device, or samples/s per device for a model without a sequence (computed from
        the batch, whatever ``seq_len`` the candidate carries)."""
        p = e.prediction
        if self.sequence:
            return p.tokens_per_s_per_device
        c = e.candidate
        world = c.dims.world
        return c.global_batch / p.step_time_s / world if p.step_time_s > 0 else 0.0

    def to_dict(self, max_ranked: int = 50) -> dict[str, Any]:
        """JSON-ready; ``ranked`` is cut to ``max_ranked`` entries, ``evaluated`` is left out (it can hold
        thousands)."""
        return {"chosen": self.chosen.to_dict(), "chosen_by": self.chosen_by,
                "ranked": [e.to_dict() for e in self.ranked[:max_ranked]],
                "trials": [t.to_dict() for t in self.trials], "pruned_count": self.pruned_count,
                "pruned_reasons": dict(self.pruned_reasons), "evaluated_count": len(self.evaluated),
                "world_size": self.world_size, "global_batch": self.global_batch, "seq_len": self.seq_len,
                "elapsed_s": self.elapsed_s, "notes": list(self.notes), "sequence": self.sequence}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SearchResult":
        ranked = [Evaluated.from_dict(e) for e in d.get("ranked", [])]
        return cls(Candidate.from_dict(d["chosen"]), d.get("chosen_by", "plan"), ranked, list(ranked),
                   [Trial.from_dict(t) for t in d.get("trials", [])], int(d.get("pruned_count", 0)),
                   dict(d.get("pruned_reasons", {})), int(d.get("world_size", 1)), int(d.get("global_batch", 1)),
                   int(d.get("seq_len", 0)), float(d.get("elapsed_s", 0.0)), list(d.get("notes", [])),
                   sequence=bool(d.get("sequence", True)))

"""A cheap upper bound on a candidate's predicted throughput, so a search that only needs its best ``keep``
plans can skip candidates that provably cannot be among them without pricing them.

The bound is a lower bound on the predicted step time: every rank's share of the model FLOPs
(:meth:`~torchloom.cost.model_info.ModelInfo.flops_per_sample`, the same count MFU divides) at the fastest
rate the hardware's calibration gives for the candidate's dtypes (the largest calibrated GEMM rate of the
compute and block-GEMM dtypes, the attention kernel's rates), times the pipeline bubble the schedule adds at
least (GPipe / 1F1B ``(m + p - 1) / m``, interleaved 1F1B ``1 + (p - 1) / (v m)``; on CUDA only, where the
cost model has no oversubscription correction). Nothing else (communication, optimizer, recomputation,
per-op dispatch) is counted, and each of those is >= 0, so the cost model's step time can only be longer.

The bound holds as long as the cost model prices at least the model FLOPs at no more than the calibrated
rates; the search checks that on every candidate it does price (:meth:`StepBound.holds`) and stops skipping
(pricing what it skipped) the first time it does not, so a change in the cost model can cost speed, never a
wrong ranking.
"""
from __future__ import annotations

from ..cost.hardware import Hardware
from ..cost.model_info import ModelInfo
from ..cost.step import StepShape
from .candidate import Candidate

#: relative slack when comparing a priced step time with the bound (float rounding)
_EPS = 1e-9


class StepBound:
    """``seconds(cand)``: a lower bound on ``predict(cand, info, hw).step_time_s``;
    ``tokens_per_s(cand)``: the matching upper bound on its ``tokens_per_s``."""

    def __init__(self, info: ModelInfo, hw: Hardware):
        self.info, self.hw = info, hw
        self.flops = info.flops_per_sample()
        self.cuda = hw.device_type == "cuda"
        self._rates: dict[tuple, float] = {}

    def _rate(self, compute: str, gemm: str) -> float:
        k = (compute, gemm)
        r = self._rates.get(k)
        if r is None:
            hw, rates = self.hw, []
            for d in {compute, gemm}:
                pts = hw.matmul_flops.get(d) or hw.matmul_flops.get("float32") or []
                rates += [p[1] for p in pts]
            rates += list(hw.attention_flops.get(compute) or ())
            r = self._rates[k] = max(rates, default=0.0)
        return r

    def seconds(self, cand: Candidate) -> float:
        """Lower bound on the predicted seconds per optimizer step (0 when nothing can be bounded)."""
        info = self.info
        step = StepShape.of(cand, info.param_dtype)
        rate = self._rate(step.compute_dtype, step.block_gemm_dtype)
        if rate <= 0 or self.flops <= 0:
            return 0.0
        scale_tokens = cand.seq_len / info.seq_len if info.seq_len else 1.0
        t = self.flops * scale_tokens * cand.global_batch / (cand.dims.world * rate)
        return t * self._bubble(cand)

    def _bubble(self, cand: Candidate) -> float:
        if not self.cuda or cand.dims.pp <= 1:
            return 1.0
        cfg = cand.config("pipeline_parallel")
        if not cfg:
            return 1.0
        p, m = cand.dims.pp, cand.grad_accum
        schedule = cfg.get("schedule", "1f1b")
        if m < 1:
            return 1.0
        if schedule in ("gpipe", "1f1b"):
            return (m + p - 1) / m
        if schedule == "interleaved_1f1b":
            v = cfg.get("stages_per_rank") or 2
            return 1.0 + (p - 1) / (v * m)
        return 1.0

    def tokens_per_s(self, cand: Candidate) -> float:
        """Upper bound on the predicted tokens per second (inf when nothing can be bounded)."""
        t = self.seconds(cand)
        return cand.global_batch * cand.seq_len / t if t > 0 else float("inf")

    def holds(self, cand: Candidate, step_time_s: float) -> bool:
        """Whether a priced step time respects the bound (the search's guard)."""
        return step_time_s >= self.seconds(cand) * (1 - _EPS)


__all__ = ["StepBound"]

"""Global-batch arithmetic: global batch = dp_size x micro batch x gradient-accumulation steps."""
from __future__ import annotations

from dataclasses import dataclass

from torchloom.data.sampler import DataError, _positive_int


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's samples are split: ``global_batch_size = dp_size * micro_batch_size *
    grad_accum_steps`` (all in samples)."""

    micro_batch_size: int
    global_batch_size: int
    grad_accum_steps: int


def plan_batches(global_batch_size: int | None, micro_batch_size: int | None, dp_size: int) -> BatchPlan:
    """Derive the missing sizes. ``micro_batch_size`` defaults to ``global // dp_size`` (no accumulation);
    ``global_batch_size`` defaults to ``dp_size * micro_batch_size``.

    Raises:
        DataError: neither size given, a non-positive size, or a global batch not divisible by
            ``dp_size`` (resp. ``dp_size * micro_batch_size``); the message suggests valid sizes.
    """
    dp_size = _positive_int("dp_size", dp_size)
    if global_batch_size is None and micro_batch_size is None:
        raise DataError("give the global batch size (samples per optimizer step) or the micro batch size.")
    if micro_batch_size is None:
        gbs = _positive_int("global batch size", global_batch_size)
        if gbs % dp_size:
            raise DataError(
                f"global batch size {gbs} is not divisible by the data-parallel size {dp_size}; use a multiple of "
                f"{dp_size} (e.g. {_near(gbs, dp_size)}), or give a micro batch size too."
            )
        micro_batch_size = gbs // dp_size
    mb = _positive_int("micro batch size", micro_batch_size)
    gbs = dp_size * mb if global_batch_size is None else _positive_int("global batch size", global_batch_size)
    if gbs % dp_size:
        raise DataError(
            f"global batch size {gbs} is not divisible by the data-parallel size {dp_size}: no micro batch size can "
            f"split it evenly; use a multiple of {dp_size} (e.g. {_near(gbs, dp_size)})."
        )
    step = dp_size * mb
    if gbs % step:
        raise DataError(
            f"global batch size {gbs} is not divisible by data-parallel size x micro batch size = {dp_size} x {mb} "
            f"= {step}; use a multiple of {step} (e.g. {_near(gbs, step)}) or another micro batch size."
        )
    return BatchPlan(mb, gbs, gbs // step)


def _near(n: int, k: int) -> str:
    lo, hi = n // k * k, (n // k + 1) * k
    return f"{lo} or {hi}" if lo else f"{hi}"

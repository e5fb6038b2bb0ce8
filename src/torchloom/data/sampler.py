"""A distributed sampler whose position survives restarts and data-parallel resizes.

The global order of epoch ``e`` is a pure function of ``(seed, e)``; the sampler's state is the
*global* number of samples consumed in the current epoch.  Every micro-step the data-parallel
group consumes the next ``dp_size * micro_batch_size`` samples of that order and rank ``r`` takes
the ``r``-th contiguous slice of ``micro_batch_size``.  Because neither the order nor the epoch
length depends on ``dp_size``, a job saved on 4 ranks resumes on 2 or 8 ranks at exactly the same
point of the global sequence.
"""
from __future__ import annotations

import warnings
from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import Sampler

from torchloom.errors import TorchloomError

__all__ = ["DataError", "ElasticDistributedSampler", "PaddedEpochWarning"]

_STATE_KEYS = ("epoch", "consumed", "seed", "num_samples", "global_batch_size")


class DataError(TorchloomError, ValueError):
    """A sampler/loader is misconfigured, or a saved data position cannot be restored exactly
    (dataset changed, or the position does not fall on a micro-step of the new layout)."""


class PaddedEpochWarning(UserWarning):
    """``drop_last=False`` fills the last global batch of every epoch with repeated samples (said once per
    sampler, on data-parallel rank 0; ``warnings.filterwarnings("ignore", category=PaddedEpochWarning)``
    silences it)."""


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataError(f"{name} must be a positive int, got {value!r}.")
    return value


class _Cursor:
    """Position ``(epoch, consumed)`` plus the two flags that decide what the next pass does.

    * ``pinned``: ``set_epoch``/``load_state_dict`` chose the epoch explicitly since the last pass,
      so an exhausted epoch is *not* advanced automatically (the pass is empty instead).
    * ``restoring``: a position was loaded and no pass ran yet; ``set_epoch`` with the loaded
      epoch keeps the loaded ``consumed`` instead of resetting it.
    """

    def __init__(self) -> None:
        self.epoch, self.consumed = 0, 0
        self.pinned, self.restoring = False, False

    def set_epoch(self, epoch: int, length: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise DataError(f"epoch must be a non-negative int, got {epoch!r}.")
        if not (self.restoring and epoch == self.epoch):
            if self.restoring and 0 < self.consumed < length:
                warnings.warn(
                    f"set_epoch({epoch}) discards the restored position (epoch {self.epoch}, "
                    f"consumed={self.consumed}); call set_epoch({self.epoch}) to resume it.",
                    stacklevel=3,
                )
            self.consumed = 0
            self.restoring = False
        self.epoch, self.pinned = epoch, True

    def restore(self, epoch: int, consumed: int) -> None:
        self.epoch, self.consumed = epoch, consumed
        self.pinned, self.restoring = False, True

    def upcoming_epoch(self, exhausted: bool) -> int:
        """The epoch the next pass runs (``epoch + 1`` if it will roll over)."""
        return self.epoch + 1 if exhausted and not self.pinned else self.epoch

    def begin(self, exhausted: bool) -> None:
        """Start a pass: an exhausted epoch rolls over to the next one unless it was pinned."""
        if exhausted and not self.pinned:
            self.epoch, self.consumed = self.epoch + 1, 0
        self.pinned = self.restoring = False


class ElasticDistributedSampler(Sampler[int]):
    """Yields this data-parallel rank's dataset indices for the rest of the current epoch.

    Args:
        num_samples: dataset length (samples).
        dp_rank, dp_size: this rank and the data-parallel group size.
        micro_batch_size: samples per rank per forward pass.
        global_batch_size: samples per optimizer step over all ranks; defaults to
            ``dp_size * micro_batch_size``. Must be a multiple of ``dp_size * micro_batch_size``
            (the quotient is the number of gradient-accumulation micro-steps).
        seed: the order of epoch ``e`` is ``torch.randperm(num_samples)`` seeded with ``seed + e``.
        shuffle: ``False`` uses ``0..num_samples-1`` every epoch.
        drop_last: ``True`` drops the final ``num_samples % global_batch_size`` samples of the order;
            ``False`` pads the epoch to a multiple of ``global_batch_size`` by wrapping around (repeated
            samples: a :class:`PaddedEpochWarning` on ``dp_rank`` 0 at the first pass names how many).

    Epoch length (``epoch_length``, global samples) depends only on ``num_samples``,
    ``global_batch_size`` and ``drop_last``, never on ``dp_size``.  At micro-step ``k`` rank ``r``
    yields ``order[o + r*mb : o + (r+1)*mb]`` with ``o = k * dp_size * mb``.

    State (``state_dict``): ``{"epoch", "consumed", "seed", "num_samples", "global_batch_size"}``,
    plain ints; ``consumed`` counts global samples of the epoch handed out, advanced one micro-step
    (``dp_size * micro_batch_size``) when this rank's micro-batch is fetched from the iterator.
    Inside a prefetching ``DataLoader`` use ``StatefulDataLoader``, which counts only yielded batches.

    Epochs: ``set_epoch(e)`` starts epoch ``e`` from its beginning (after ``load_state_dict`` it
    keeps the restored position if ``e`` is the restored epoch).  Without ``set_epoch``, iterating
    an exhausted epoch rolls over to the next epoch automatically.

    Raises:
        DataError: bad arguments; a global batch not divisible by ``dp_size * micro_batch_size``;
            ``drop_last`` with fewer samples than one global batch; on ``load_state_dict``, a
            checkpoint of a different dataset (``num_samples``/``seed``) or a ``consumed`` count
            that is not a multiple of ``dp_size * micro_batch_size``.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        global_batch_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        super().__init__()
        self.num_samples = _positive_int("num_samples", num_samples)
        self.dp_size = _positive_int("dp_size", dp_size)
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank must be an int in [0, {dp_size}), got {dp_rank!r}.")
        self.dp_rank = dp_rank
        self.micro_batch_size = _positive_int("micro_batch_size", micro_batch_size)
        step = dp_size * micro_batch_size
        gbs = step if global_batch_size is None else _positive_int("global_batch_size", global_batch_size)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise DataError(f"seed must be an int, got {seed!r}.")
        self.seed, self.shuffle, self.drop_last = seed, bool(shuffle), bool(drop_last)
        self._check_global_batch(gbs)
        self.global_batch_size = gbs
        self._cursor = _Cursor()
        self._padding_said = 0  # the repeated-sample count last warned about (PaddedEpochWarning)

    def _check_global_batch(self, gbs: int) -> None:
        step = self.step_size
        if gbs % step:
            ok = _largest_mb(gbs, self.dp_size, self.micro_batch_size)
            hint = f"a micro_batch_size of {ok}, or " if ok else ""
            raise DataError(
                f"global_batch_size={gbs} is not divisible by dp_size*micro_batch_size="
                f"{self.dp_size}*{self.micro_batch_size}={step}; use {hint}a global_batch_size that is a "
                f"multiple of {step}."
            )
        if self.drop_last and self.num_samples < gbs:
            raise DataError(
                f"drop_last=True with num_samples={self.num_samples} < global_batch_size={gbs} leaves an "
                "empty epoch; use drop_last=False (pads by wrapping) or a smaller global batch."
            )

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """Change the samples per optimizer step (the accumulation follows: ``grad_accum_steps``), keeping the
        position. The epoch length becomes a multiple of the new global batch (``epoch_length``); the order is
        unchanged (``global_order`` of a longer epoch extends the shorter one). A pass in progress continues
        with the new length.

        Raises:
            DataError: ``global_batch_size`` is not a multiple of ``dp_size * micro_batch_size``, leaves an empty
                epoch with ``drop_last``, or the epoch is under way at a position (``consumed``) that is not a
                multiple of it: its optimizer steps would no longer end with the epoch. Change it at an epoch
                start or where ``consumed`` is a multiple of the new global batch.
        """
        gbs = _positive_int("global_batch_size", global_batch_size)
        self._check_global_batch(gbs)
        consumed = self._cursor.consumed
        if 0 < consumed < self.epoch_length and consumed % gbs:
            raise DataError(
                f"cannot change the global batch to {gbs} at this position: {consumed} samples of epoch "
                f"{self._cursor.epoch} are consumed, not a multiple of {gbs}, so the epoch's optimizer steps would "
                f"not end with it. Change it at an epoch start or after a multiple of {gbs} samples.")
        self.global_batch_size = gbs

    # -- geometry -----------------------------------------------------------------------------
    @property
    def step_size(self) -> int:
        """Global samples consumed per micro-step: ``dp_size * micro_batch_size``."""
        return self.dp_size * self.micro_batch_size

    @property
    def grad_accum_steps(self) -> int:
        """Micro-steps per optimizer step: ``global_batch_size // (dp_size * micro_batch_size)``."""
        return self.global_batch_size // self.step_size

    @property
    def epoch_length(self) -> int:
        """Global samples per epoch (a multiple of ``global_batch_size``), independent of dp_size."""
        full, rest = divmod(self.num_samples, self.global_batch_size)
        return (full + (0 if self.drop_last or rest == 0 else 1)) * self.global_batch_size

    @property
    def epoch(self) -> int:
        """The epoch being iterated, or at rest the one the next pass runs (after roll-over)."""
        return self._cursor.upcoming_epoch(self._cursor.consumed >= self.epoch_length)

    @property
    def consumed(self) -> int:
        """Global samples of the current epoch handed out so far."""
        return self._cursor.consumed

    def global_order(self, epoch: int) -> torch.Tensor:
        """The epoch's global index sequence, int64 of shape ``(epoch_length,)`` (padded/truncated)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        length = self.epoch_length
        if length <= self.num_samples:
            return order[:length]
        return order[torch.arange(length) % self.num_samples]

    # -- iteration ----------------------------------------------------------------------------
    def _start(self) -> int:
        """Begin a pass (rolling an exhausted epoch over unless pinned); returns the start offset."""
        self._cursor.begin(exhausted=self._cursor.consumed >= self.epoch_length)
        return self._cursor.consumed

    def _set_position(self, epoch: int, consumed: int) -> None:
        """Pin the next pass to ``(epoch, consumed)`` (used by StatefulDataLoader)."""
        self._cursor.epoch, self._cursor.consumed = epoch, consumed
        self._cursor.pinned, self._cursor.restoring = True, False

    def __iter__(self) -> Iterator[int]:
        start = self._start()
        self._warn_padding()
        return self._generate(self._cursor.epoch, start)

    def _warn_padding(self) -> None:
        """Say once (data-parallel rank 0, at the first pass; again only if a new global batch changes the
        count) that ``drop_last=False`` repeats samples: more than ``DistributedSampler``, which pads to a
        multiple of the ranks only, and wrong for a metric."""
        repeated = self.epoch_length - self.num_samples
        if repeated <= 0 or self.dp_rank != 0 or repeated == self._padding_said:
            return
        self._padding_said = repeated
        n, gbs = self.num_samples, self.global_batch_size
        fix = (f"use drop_last=True to drop the last {n % gbs} samples of each epoch instead" if n >= gbs else
               "drop_last=True would leave no batch at all: use a smaller global batch to repeat fewer")
        warnings.warn(
            f"drop_last=False: the last global batch of each epoch is padded with {repeated} repeated samples "
            f"({n} samples, global batch {gbs}: {self.epoch_length} per epoch); {fix}. For evaluation use "
            "torchloom.data.eval_loader, which counts every sample once.", PaddedEpochWarning, stacklevel=2)

    def _generate(self, epoch: int, start: int) -> Iterator[int]:
        order = self.global_order(epoch)
        step, mb = self.step_size, self.micro_batch_size
        offset = start
        while offset < self.epoch_length:  # read each time: set_global_batch_size may change it mid-pass
            if len(order) < self.epoch_length:
                order = self.global_order(epoch)  # a longer epoch: the same order, extended
            lo = offset + self.dp_rank * mb
            chunk = order[lo : lo + mb].tolist()
            offset += step
            self._cursor.consumed = offset
            yield from chunk

    def remaining(self) -> int:
        """Global samples the next pass covers (a full epoch if it will roll over)."""
        c = self._cursor
        if c.consumed >= self.epoch_length and not c.pinned:
            return self.epoch_length
        return max(self.epoch_length - c.consumed, 0)

    def __len__(self) -> int:
        """Indices this rank yields in the remaining epoch (the next pass)."""
        return self.remaining() // self.step_size * self.micro_batch_size

    # -- state --------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning; keeps a just-restored position of that epoch."""
        self._cursor.set_epoch(epoch, self.epoch_length)

    def state_dict(self) -> dict[str, int]:
        """Plain-int state: epoch, global samples consumed in it, and dataset identity."""
        c = self._cursor
        return {
            "epoch": c.epoch,
            "consumed": c.consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
        }

    def check_state_dict(self, state: Mapping[str, Any]) -> tuple[int, int]:
        """Validate a saved state against this sampler; returns ``(epoch, consumed)``.

        Raises:
            DataError: missing keys, a different dataset (num_samples or seed), or a ``consumed``
                count that is not a multiple of this layout's ``dp_size * micro_batch_size``.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise DataError(f"sampler state is missing {missing}; expected keys {list(_STATE_KEYS)}.")
        for key in ("num_samples", "seed"):
            if int(state[key]) != getattr(self, key):
                raise DataError(
                    f"the checkpoint's data position was saved with {key}={state[key]} but this "
                    f"sampler has {key}={getattr(self, key)}: the dataset or its order changed, so "
                    "the saved position is meaningless. Restore the original dataset/seed, or start "
                    "the data from scratch by not loading the data state."
                )
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if epoch < 0 or consumed < 0:
            raise DataError(f"invalid sampler state: epoch={epoch}, consumed={consumed}.")
        step = self.step_size
        if consumed % step:
            ok = _largest_mb(consumed, self.dp_size, self.micro_batch_size, self.global_batch_size)
            hint = f" (e.g. micro_batch_size={ok})" if ok else ""
            raise DataError(
                f"cannot resume exactly: the checkpoint consumed {consumed} samples of epoch "
                f"{epoch}, which is not a multiple of dp_size*micro_batch_size={self.dp_size}*"
                f"{self.micro_batch_size}={step}, so ranks would skip or repeat samples. Resume with "
                f"a micro_batch_size where dp_size*micro_batch_size divides {consumed}{hint}, or "
                "from a checkpoint taken at an optimizer-step boundary (a multiple of the global "
                f"batch, saved global_batch_size={state['global_batch_size']})."
            )
        return epoch, min(consumed, self.epoch_length)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position saved by ``state_dict`` (possibly with another dp_size/micro batch)."""
        self._cursor.restore(*self.check_state_dict(state))


def _largest_mb(total: int, dp_size: int, current: int, cap: int | None = None) -> int | None:
    """Largest micro batch ``m <= current`` with ``dp_size*m`` dividing ``total`` (and ``cap``)."""
    for m in range(current, 0, -1):
        if total % (dp_size * m) == 0 and (cap is None or cap % (dp_size * m) == 0):
            return m
    return None

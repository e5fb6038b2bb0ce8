"""A DataLoader whose position (epoch + samples consumed) is checkpointable and exact.

``StatefulDataLoader`` wraps ``torch.utils.data.DataLoader`` (any ``num_workers``) and counts only
the batches it has *handed to the caller*, never the ones prefetched by workers, so
``state_dict()`` taken inside the training loop is the exact position to resume from.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from torch.utils.data import DataLoader, Dataset, IterableDataset

from torchloom.data.batching import plan_batches
from torchloom.data.join import UNEVEN_POLICIES, group_size, join_batches
from torchloom.data.sampler import DataError, ElasticDistributedSampler, _Cursor, _positive_int

__all__ = ["StatefulDataLoader", "build_dataloader"]

_OWNED = ("sampler", "batch_sampler", "batch_size", "shuffle")
ITERABLE_RESUME = ("auto", "state", "replay")


class StatefulDataLoader:
    """One epoch per ``iter()``, resumable mid-epoch from ``state_dict()``.

    Two modes:

    * **Sampler mode** (``sampler`` is an ``ElasticDistributedSampler``; map-style datasets).
      Each yielded batch is this rank's micro-batch, shape ``(micro_batch_size, ...)`` after
      ``collate_fn``; all ranks step in lockstep, so each batch advances the *global* count by
      ``dp_size * micro_batch_size``. State: the sampler's keys (``epoch``, ``consumed`` = global
      samples of the epoch in batches already yielded, ``seed``, ``num_samples``,
      ``global_batch_size``) plus ``"kind": "map"``. Restorable with another ``dp_size``/micro
      batch as long as ``consumed`` is a multiple of the new ``dp_size * micro_batch_size``.
    * **Batch-count mode** (``sampler=None``, e.g. an ``IterableDataset``). State:
      ``{"kind": "iterable", "epoch", "batches_yielded", "dp_size", "micro_batch_size"}``. On
      resume the first ``batches_yielded`` batches of the epoch are re-read and discarded, which is
      exact only if the dataset yields the same sequence every time (deterministic iterable, its own
      per-rank sharding, and per-worker sharding when ``num_workers > 0``). If the dataset defines
      ``set_epoch(epoch)`` it is called before each pass. Resume needs the same dp_size/micro batch.
      A dataset with its own ``state_dict()``/``load_state_dict()`` (a Hugging Face
      ``datasets.IterableDataset``, torchdata's ``Stateful`` protocol: ``state_dict()`` is the position
      after the last example it yielded, ``load_state_dict(s)`` makes the next pass continue there) is
      resumed from that state instead, without re-reading (``iterable_resume``, below); the state then
      also holds ``"dataset_state"``: the dataset's state right after the last batch handed out
      (per rank: each rank's shard has its own).
      With more than one process in ``group`` the ranks agree when the data ends (one small
      all-gather per optimizer step, see :func:`torchloom.data.join.join_batches`): every rank
      yields the same number of batches, so none waits in a collective; ``uneven`` says what
      happens to the surplus ("drop": dropped with a warning; "error": ``DataError`` on every rank).

    Epochs: ``iter()`` runs the rest of the current epoch; once a pass ends the position moves to
    the start of the next epoch, so ``for epoch ...: for batch in loader`` needs no ``set_epoch``.
    ``set_epoch(e)`` is also accepted (starts epoch ``e``; right after ``load_state_dict`` the
    restored epoch keeps its restored position). Call it on the loader, not on its sampler.
    Only one live iterator per loader is supported.

    Args:
        dataset: map-style (with ``sampler``) or any dataset (without).
        sampler: the rank's ``ElasticDistributedSampler``; enables sampler mode.
        batch_size: batch-count mode only (sampler mode uses ``sampler.micro_batch_size``).
        global_batch_size, dp_size: batch-count mode bookkeeping for ``grad_accum_steps``.
        group: batch-count mode: the ranks that must agree when the data ends (None: the default
            group, i.e. every process; nothing is exchanged without an initialised process group).
        uneven: batch-count mode: "drop" (default) or "error", see above.
        iterable_resume: batch-count mode: "replay" re-reads ``batches_yielded`` batches; "state" restores
            the dataset's own ``state_dict()`` (``num_workers=0`` only: with worker processes each worker
            iterates its own copy of the dataset ahead of the batches handed out, so the main process's
            dataset state is not the position); "auto" (default) is "state" when the dataset has the
            methods, ``num_workers`` is 0 and it is not a Hugging Face dataset shuffled with a buffer
            (whose buffer the state does not hold, so its resume is not exact), else "replay".
        **dataloader_kwargs: forwarded to ``DataLoader`` (``num_workers``, ``collate_fn``,
            ``pin_memory``, ``persistent_workers``, ...).

    Raises:
        DataError: ``sampler``/``batch_sampler``/``shuffle`` in ``dataloader_kwargs`` (the order is
            owned by the sampler), ``batch_size`` that disagrees with the sampler, a dataset length
            that differs from ``sampler.num_samples``, an unrestorable ``load_state_dict``, or
            ``iterable_resume="state"`` that cannot be honoured (no methods, ``num_workers > 0``).
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        sampler: ElasticDistributedSampler | None = None,
        batch_size: int | None = None,
        global_batch_size: int | None = None,
        dp_size: int = 1,
        group: dist.ProcessGroup | None = None,
        uneven: str = "drop",
        iterable_resume: str = "auto",
        **dataloader_kwargs: Any,
    ) -> None:
        _reject_owned(dataloader_kwargs, allow_false_shuffle=sampler is None)
        if uneven not in UNEVEN_POLICIES:
            raise DataError(f"uneven={uneven!r} is not valid; use one of {list(UNEVEN_POLICIES)}.")
        self.dataset, self.sampler = dataset, sampler
        self.group, self.uneven = group, uneven
        self._cursor = _Cursor()
        # DataLoader draws its workers' base seed from `generator`, or from the global torch RNG at each
        # iter(): a resumed epoch would then draw it after the checkpoint's RNG was restored, shifting every
        # later dropout mask against the uninterrupted run. An own generator per epoch leaves the global RNG
        # alone and gives workers the same seeds on resume.
        self._own_generator = dataloader_kwargs.get("generator") is None
        # batch-count mode with the dataset's own state: its state after the last batch handed out, and a
        # loaded (epoch, batches, state) the next pass restores instead of re-reading
        if iterable_resume not in ITERABLE_RESUME:
            raise DataError(f"iterable_resume={iterable_resume!r} is not valid; use one of {list(ITERABLE_RESUME)}.")
        self.resumes_from_dataset_state = sampler is None and _resume_from_state(
            dataset, iterable_resume, int(dataloader_kwargs.get("num_workers", 0) or 0))
        self._dataset_state: Any = None
        self._pending_dataset_state: tuple[int, int, Any] | None = None
        if sampler is not None:
            if not isinstance(sampler, ElasticDistributedSampler):
                raise DataError(
                    f"sampler must be an ElasticDistributedSampler, got {type(sampler).__name__}; "
                    "other samplers cannot be resumed exactly (use sampler=None for batch counting)."
                )
            if batch_size is not None and batch_size != sampler.micro_batch_size:
                raise DataError(
                    f"batch_size={batch_size} differs from sampler.micro_batch_size="
                    f"{sampler.micro_batch_size}; omit batch_size."
                )
            if "drop_last" in dataloader_kwargs:
                raise DataError("drop_last is a sampler argument here; pass it to the sampler.")
            n = _maybe_len(dataset)
            if n is not None and n != sampler.num_samples:
                raise DataError(
                    f"len(dataset)={n} but sampler.num_samples={sampler.num_samples}; build the "
                    "sampler with num_samples=len(dataset)."
                )
            self.dp_size, self.micro_batch_size = sampler.dp_size, sampler.micro_batch_size
            self.global_batch_size = sampler.global_batch_size
            self.loader = DataLoader(
                dataset, batch_size=sampler.micro_batch_size, sampler=sampler, **dataloader_kwargs
            )
        else:
            if batch_size is None:
                raise DataError("batch_size is required when no sampler is given.")
            self.micro_batch_size = _positive_int("batch_size", batch_size)
            self.dp_size = _positive_int("dp_size", dp_size)
            step = self.dp_size * self.micro_batch_size
            self.global_batch_size = step if global_batch_size is None else global_batch_size
            if _positive_int("global_batch_size", self.global_batch_size) % step:
                raise DataError(
                    f"global_batch_size={self.global_batch_size} is not divisible by "
                    f"dp_size*batch_size={self.dp_size}*{self.micro_batch_size}={step}; use a "
                    f"global_batch_size that is a multiple of {step}."
                )
            self.loader = DataLoader(dataset, batch_size=self.micro_batch_size, **dataloader_kwargs)
        self.grad_accum_steps = self.global_batch_size // (self.dp_size * self.micro_batch_size)

    @property
    def epoch(self) -> int:
        """The epoch being iterated, or at rest the one the next pass runs (after roll-over)."""
        c = self._cursor
        return c.upcoming_epoch(self.sampler is not None and c.consumed >= self.sampler.epoch_length)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (keeps a just-restored position of that epoch)."""
        length = self.sampler.epoch_length if self.sampler is not None else float("inf")
        self._cursor.set_epoch(epoch, length)

    def __len__(self) -> int:
        """Batches the next pass yields (the remaining part of the current epoch)."""
        c = self._cursor
        if self.sampler is None:
            return max(len(self.loader) - c.consumed, 0)
        length = self.sampler.epoch_length
        left = length if c.consumed >= length and not c.pinned else length - c.consumed
        return max(left, 0) // self.sampler.step_size

    def __iter__(self) -> Iterator[Any]:
        return self._iter_sampler() if self.sampler is not None else self._iter_counted()

    def _iter_loader(self, epoch: int) -> Iterator[Any]:
        """``iter(self.loader)`` without touching the global torch RNG (see ``_own_generator``): the workers'
        base seed comes from a generator seeded by (sampler seed, epoch, dp rank)."""
        if self._own_generator:
            seed, rank = (self.sampler.seed, self.sampler.dp_rank) if self.sampler is not None else (0, 0)
            g = torch.Generator()
            g.manual_seed((seed * 1_000_003 + epoch) * 65_537 + rank)
            self.loader.generator = g
        return iter(self.loader)

    def _iter_sampler(self) -> Iterator[Any]:
        c, s = self._cursor, self.sampler
        c.begin(exhausted=c.consumed >= s.epoch_length)
        while c.consumed < s.epoch_length:
            # one DataLoader pass, again only if set_global_batch_size lengthened the epoch after the sampler
            # (read ahead by the workers) had already ended
            s._set_position(c.epoch, c.consumed)
            it = self._iter_loader(c.epoch)
            before = c.consumed
            try:
                for batch in it:
                    if c.consumed >= s.epoch_length:
                        break  # set_global_batch_size shortened the epoch: prefetched batches past its end
                    c.consumed += s.step_size  # count before handing out: a checkpoint now includes it
                    yield batch
            finally:
                del it  # drop prefetched batches / shut non-persistent workers down
            if c.consumed == before:
                break
        c.epoch, c.consumed = c.epoch + 1, 0

    def _iter_counted(self) -> Iterator[Any]:
        c = self._cursor
        c.begin(exhausted=False)
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(c.epoch)
        skip = c.consumed
        pending, self._pending_dataset_state = self._pending_dataset_state, None
        if pending is not None and pending[:2] == (c.epoch, c.consumed):
            self.dataset.load_state_dict(pending[2])  # continues after the last batch handed out: no replay
            self._dataset_state, skip = pending[2], 0
        elif c.consumed == 0:
            self._dataset_state = None
        it = self._iter_loader(c.epoch)
        if self.resumes_from_dataset_state:
            # read right after each batch is fetched: join_batches reads a step ahead of what is handed out
            it = ((batch, self.dataset.state_dict()) for batch in it)
        joined = group_size(self.group) > 1  # ranks may hold different numbers of batches: agree on the end
        try:
            skip_error = None
            for skipped in range(skip):
                try:
                    next(it)
                except StopIteration:
                    skip_error = DataError(
                        f"resuming epoch {c.epoch} needs to skip {c.consumed} batches but the dataset "
                        f"ended after {skipped}: the iterable is not deterministic or has changed, so "
                        "the position cannot be restored. Fix its order/sharding or restart the epoch."
                    )
                    if not joined:
                        raise skip_error from None
                    break
            source = join_batches(it, group=self.group, per_step=self.grad_accum_steps, uneven=self.uneven,
                                  epoch=c.epoch, skip_error=skip_error) if joined else it
            for batch in source:
                if self.resumes_from_dataset_state:
                    batch, self._dataset_state = batch
                c.consumed += 1
                yield batch
        finally:
            del it
        c.epoch, c.consumed = c.epoch + 1, 0
        self._dataset_state = None

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """Change the samples per optimizer step over all data-parallel ranks; ``grad_accum_steps`` becomes
        ``global_batch_size / (dp_size * micro_batch_size)``. Sampler mode: the sampler's epoch length follows
        (:meth:`ElasticDistributedSampler.set_global_batch_size`, which also says where it may change); a pass
        in progress continues with it. Batch-count mode: only the bookkeeping changes (the ranks agree on the
        end of the data in chunks of the accumulation a pass started with). Call it at an optimizer-step
        boundary: :meth:`torchloom.AccelerateResult.set_global_batch_size` changes ``train_step`` along.

        Raises:
            DataError: not a positive multiple of ``dp_size * micro_batch_size`` (naming the sizes that are),
                or (sampler mode) a position or ``drop_last`` the new size does not fit.
        """
        if self.sampler is not None:
            self.sampler.set_global_batch_size(global_batch_size)
            self.global_batch_size = self.sampler.global_batch_size
        else:
            self.global_batch_size = plan_batches(global_batch_size, self.micro_batch_size,
                                                  self.dp_size).global_batch_size
        self.grad_accum_steps = self.global_batch_size // (self.dp_size * self.micro_batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serializable ints/str) describing the position after the last yield."""
        c = self._cursor
        if self.sampler is None:
            state = {
                "kind": "iterable",
                "epoch": c.epoch,
                "batches_yielded": c.consumed,
                "dp_size": self.dp_size,
                "micro_batch_size": self.micro_batch_size,
            }
            if self.resumes_from_dataset_state:
                state["dataset_state"] = self._dataset_state if c.consumed else None
            return state
        state = self.sampler.state_dict()
        state.update(kind="map", epoch=c.epoch, consumed=c.consumed)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position from ``state_dict()``; the next ``iter()`` continues from it.

        Raises:
            DataError: the state is of the other mode, from a different dataset, or not aligned
                with this loader's layout (see ``ElasticDistributedSampler.check_state_dict``).
        """
        kind = state.get("kind", "map" if "consumed" in state else "iterable")
        mine = "iterable" if self.sampler is None else "map"
        if kind != mine:
            raise DataError(
                f"cannot load a {kind!r} data state into a {mine!r} loader: the checkpoint was "
                f"saved with a {'sampler' if kind == 'map' else 'batch-counting'} loader; build "
                "this loader the same way (map-style dataset vs iterable) to resume."
            )
        if self.sampler is not None:
            self._cursor.restore(*self.sampler.check_state_dict(state))
            return
        for key in ("dp_size", "micro_batch_size"):
            if int(state[key]) != getattr(self, key):
                raise DataError(
                    f"the data state was saved with {key}={state[key]} but this loader has "
                    f"{key}={getattr(self, key)}; batch-count resume of an iterable dataset needs "
                    "the same layout. Use a map-style dataset (ElasticDistributedSampler) to "
                    "resume on a different layout."
                )
        epoch, batches = int(state["epoch"]), int(state["batches_yielded"])
        if epoch < 0 or batches < 0:
            raise DataError(f"invalid data state: epoch={epoch}, batches_yielded={batches}.")
        self._cursor.restore(epoch, batches)
        # without a dataset state (replay mode when saved, or now) the batches are re-read: exact for a
        # deterministic dataset either way
        ds_state = state.get("dataset_state")
        self._pending_dataset_state = (epoch, batches, ds_state) if (
            ds_state is not None and batches and self.resumes_from_dataset_state) else None


def build_dataloader(
    dataset: Dataset,
    *,
    dp_rank: int,
    dp_size: int,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
    group: dist.ProcessGroup | None = None,
    uneven: str = "drop",
    **dataloader_kwargs: Any,
) -> StatefulDataLoader:
    """This rank's resumable loader.

    ``micro_batch_size`` defaults to ``global_batch_size // dp_size`` (no accumulation);
    ``global_batch_size`` defaults to ``dp_size * micro_batch_size``. The result exposes
    ``micro_batch_size``, ``global_batch_size`` and ``grad_accum_steps =
    global_batch_size // (dp_size * micro_batch_size)``.

    Map-style datasets get an ``ElasticDistributedSampler`` (``seed``, ``shuffle``, ``drop_last``).
    An ``IterableDataset`` is batched as is: it must yield only this rank's shard itself
    (``shuffle``/``seed`` are ignored; ``drop_last`` drops a short final batch). Its ranks may hold
    different numbers of batches: with more than one process in ``group`` (None: every process) they
    agree when the data ends, ``uneven="drop"`` (default: the surplus is dropped with a warning that
    names every rank's count) or ``"error"`` (``DataError`` on every rank); see ``docs/data.md``.
    Map-style data is even by construction and exchanges nothing. An iterable with its own
    ``state_dict()`` (a Hugging Face ``IterableDataset``) resumes from it without re-reading batches
    (``iterable_resume`` in ``dataloader_kwargs``: "auto", "state", "replay"; see :class:`StatefulDataLoader`).

    Raises:
        DataError: neither batch size given; ``global_batch_size`` not divisible by ``dp_size`` or
            by ``dp_size * micro_batch_size``; ``sampler``/``batch_sampler``/``batch_size`` in
            ``dataloader_kwargs``.
    """
    _reject_owned(dataloader_kwargs, allow_false_shuffle=False)
    plan = plan_batches(global_batch_size, micro_batch_size, dp_size)
    mb, gbs = plan.micro_batch_size, plan.global_batch_size
    if isinstance(dataset, IterableDataset):
        return StatefulDataLoader(
            dataset, batch_size=mb, global_batch_size=gbs, dp_size=dp_size, drop_last=drop_last,
            group=group, uneven=uneven, **dataloader_kwargs,
        )
    n = _maybe_len(dataset)
    if n is None:
        raise DataError(f"{type(dataset).__name__} has no __len__; a map-style dataset needs one.")
    sampler = ElasticDistributedSampler(
        n, dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=mb, global_batch_size=gbs,
        seed=seed, shuffle=shuffle, drop_last=drop_last,
    )
    return StatefulDataLoader(dataset, sampler=sampler, **dataloader_kwargs)


def _resume_from_state(dataset: Any, mode: str, num_workers: int) -> bool:
    """Whether a batch-count loader restores ``dataset``'s own state (``iterable_resume``, class docstring)."""
    stateful = callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))
    if mode == "state":
        if not stateful:
            raise DataError(f"iterable_resume='state' needs a dataset with state_dict()/load_state_dict(); "
                            f"{type(dataset).__name__} has none. Use 'replay' (re-reads the batches).")
        if num_workers:
            raise DataError(
                f"iterable_resume='state' needs num_workers=0 (got {num_workers}): each worker process iterates its "
                "own copy of the dataset, ahead of the batches handed out, so the dataset's state in this process "
                "is not the loader's position. Use num_workers=0, or 'replay' (re-reads the batches on resume), or "
                "torchdata's StatefulDataLoader, which collects the workers' states.")
        return True
    return mode == "auto" and stateful and not num_workers and not _hf_buffer_shuffled(dataset)


def _hf_buffer_shuffled(dataset: Any) -> bool:
    """A Hugging Face ``IterableDataset.shuffle(buffer_size=...)`` chain: its state_dict() does not hold the
    buffer ("examples from shuffle buffers are lost when resuming"), so only replay resumes it exactly."""
    todo, seen = [getattr(dataset, "_ex_iterable", None)], 0
    while todo and seen < 1000:
        ex = todo.pop()
        seen += 1
        if ex is None:
            continue
        if type(ex).__name__ == "BufferShuffledExamplesIterable":
            return True
        todo.append(getattr(ex, "ex_iterable", None))
        todo.extend(getattr(ex, "ex_iterables", None) or ())
    return False


def _reject_owned(kwargs: Mapping[str, Any], *, allow_false_shuffle: bool) -> None:
    for key in _OWNED:
        if key not in kwargs or (key == "shuffle" and allow_false_shuffle and not kwargs[key]):
            continue
        fix = {
            "sampler": "the order comes from ElasticDistributedSampler (seed/shuffle arguments)",
            "batch_sampler": "batches are formed from micro_batch_size by torchloom",
            "batch_size": "pass micro_batch_size/global_batch_size instead",
            "shuffle": "pass shuffle to build_dataloader/the sampler; an unseeded DataLoader "
            "shuffle cannot be resumed",
        }[key]
        raise DataError(f"{key}= is not accepted as a DataLoader argument here: {fix}.")


def _maybe_len(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None

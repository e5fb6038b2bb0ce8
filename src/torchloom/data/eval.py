"""Evaluation loading that counts every sample exactly once, and the metric reductions that go with it.

The training sampler pads an epoch to a multiple of the global batch by repeating samples (and
``drop_last`` drops the rest); both are fine for training and wrong for a metric. :func:`eval_loader`
splits the dataset over the data-parallel ranks without padding: full steps give every rank
``batch_size`` samples, the last step splits what is left as evenly as possible (sizes differ by at most
one; a rank may get none). Every rank still runs the same number of steps, because a DDP/FSDP/TP/PP
forward is a collective: a rank with no sample left in a step gets a *filler* batch (a copy of a real
sample) whose rows ``num_valid`` excludes. :meth:`EvalLoader.gather_for_metrics`,
:meth:`EvalLoader.valid` and :func:`reduce_metrics` drop the filler rows by construction (the loader knows
every rank's real row count of every step; for map-style data without any communication).

Only data-parallel ranks split the data: tensor- and pipeline-parallel peers (same dp rank) get the same
batches, and the reductions run over the data-parallel group, so nothing is counted ``tp x pp`` times. Without
``mesh=`` the current torchloom mesh (the one ``auto_accelerate`` built) gives that layout.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data._utils.collate import default_collate

from torchloom.data.join import dp_layout, group_size
from torchloom.data.sampler import DataError, _positive_int
from torchloom.parallel.mesh import current_mesh

__all__ = ["EvalLoader", "eval_loader", "reduce_metrics", "split_counts"]

_OWNED = ("sampler", "batch_sampler", "batch_size", "shuffle", "drop_last")


def split_counts(num_samples: int, batch_size: int, dp_size: int) -> list[list[int]]:
    """Real samples per rank of every evaluation step: ``counts[step][rank]``.

    Full steps give ``batch_size`` to every rank; the last step's ``m < dp_size * batch_size`` samples
    are split ``m // dp_size`` each, one more for the first ``m % dp_size`` ranks. Rank ``r`` of step ``k``
    reads the contiguous dataset positions ``k*dp_size*batch_size + sum(counts[k][:r])`` onwards, so the
    ranks' rows of a step concatenated in rank order, step after step, are the dataset in order.

    Raises:
        DataError: a negative ``num_samples`` or a non-positive ``batch_size``/``dp_size``.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
        raise DataError(f"num_samples must be a non-negative int, got {num_samples!r}.")
    step = _positive_int("dp_size", dp_size) * _positive_int("batch_size", batch_size)
    out = [[batch_size] * dp_size for _ in range(num_samples // step)]
    rest = num_samples % step
    if rest:
        q, extra = divmod(rest, dp_size)
        out.append([q + (r < extra) for r in range(dp_size)])
    return out


class _EvalBatches:
    """Batch sampler of one rank: the step's real indices, then filler copies of the step's first sample
    (a rank with none gets one; ``pad_to_multiple_of`` rounds the rows up)."""

    def __init__(self, counts: list[list[int]], batch_size: int, rank: int, multiple: int):
        self.counts, self.batch_size, self.rank, self.multiple = counts, batch_size, rank, multiple

    def rows(self, k: int) -> int:
        return _padded_rows(self.counts[k][self.rank], self.multiple)

    def __len__(self) -> int:
        return len(self.counts)

    def __iter__(self) -> Iterator[list[int]]:
        dp = len(self.counts[0]) if self.counts else 1
        for k, c in enumerate(self.counts):
            first = k * dp * self.batch_size
            lo = first + sum(c[: self.rank])
            real = list(range(lo, lo + c[self.rank]))
            yield real + [first] * (self.rows(k) - len(real))


def _padded_rows(valid: int, multiple: int) -> int:
    return max(1, math.ceil(valid / multiple)) * multiple


class EvalLoader:
    """This data-parallel rank's evaluation batches: each sample of the dataset exactly once over all ranks.

    Iterate it on every rank of the group (all get the same number of batches, so collective forwards
    match). After each yielded batch:

    * ``num_valid``: how many leading rows of the batch are real samples; the rest (only when this rank has
      no sample left in the step, or with ``pad_to_multiple_of``) are filler rows, copies of a real sample
      that exist so the forward runs with a valid shape. Never count them.
    * :meth:`valid` slices a per-row tensor to its real rows; :meth:`valid_mask` is the ``(rows,)`` bool mask.
    * :meth:`gather_for_metrics` all-gathers per-row tensors of the step over the group, filler dropped.

    Map-style datasets (``len``) are split by :func:`split_counts` (no communication; ``len(loader)`` is the
    same on every rank). An ``IterableDataset`` yields this rank's own shard (its own sharding, like
    training); ranks may hold different amounts: every step all-gathers one int per rank (the real rows it
    has) and the loop ends when every rank has run out; ranks that ran out earlier get filler batches until
    then (a rank whose shard is empty gets its filler sample from the first rank with data, once). Nothing
    is dropped. Tensor/pipeline peers of one dp rank must yield the same data (they run the same forwards).

    Args:
        dataset: map-style (with ``__len__``) or ``IterableDataset``.
        batch_size: samples per rank per step (``int >= 1``).
        dp_rank, dp_size, group: the data-parallel layout (see :func:`eval_loader`).
        pad_to_multiple_of: batch rows are rounded up to a multiple of it with filler rows (pipeline
            parallel: the schedule's ``num_microbatches``).
        collate_fn: builds a batch from a list of samples (default ``default_collate``).
        **dataloader_kwargs: forwarded to ``torch.utils.data.DataLoader`` (``num_workers``,
            ``pin_memory``, ...); ``sampler``/``batch_sampler``/``batch_size``/``shuffle``/``drop_last``
            are owned here.

    Raises:
        DataError: bad sizes, an owned DataLoader argument, or a map-style dataset without ``__len__``.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, dp_rank: int, dp_size: int,
                 group: dist.ProcessGroup | None = None, pad_to_multiple_of: int = 1,
                 collate_fn: Callable[[list[Any]], Any] | None = None, **dataloader_kwargs: Any) -> None:
        owned = [k for k in _OWNED if k in dataloader_kwargs]
        if owned:
            raise DataError(f"{owned} are not accepted by eval_loader: it owns the order and the batching (every "
                            "sample exactly once, no shuffling, no dropping).")
        self.dataset, self.group = dataset, group
        self.batch_size = _positive_int("batch_size", batch_size)
        self.multiple = _positive_int("pad_to_multiple_of", pad_to_multiple_of)
        self.dp_size = _positive_int("dp_size", dp_size)
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank must be an int in [0, {dp_size}), got {dp_rank!r}.")
        self.dp_rank = dp_rank
        self.collate_fn = collate_fn or default_collate
        self.iterable = isinstance(dataset, IterableDataset)
        self.num_valid, self.rows, self.step = 0, 0, -1
        self._counts: list[int] = []  # every rank's real rows of the current step
        if self.iterable:
            # one sample at a time from the workers; batches are formed here so a filler sample can be kept
            self.loader = DataLoader(dataset, batch_size=None, collate_fn=_identity, **dataloader_kwargs)
            self.plan = None
            return
        try:
            self.num_samples = len(dataset)
        except TypeError:
            raise DataError(f"{type(dataset).__name__} has neither __len__ nor is it an IterableDataset; give a "
                            "map-style dataset a __len__.") from None
        self.plan = split_counts(self.num_samples, self.batch_size, self.dp_size)
        self.loader = DataLoader(dataset, batch_sampler=_EvalBatches(self.plan, self.batch_size, dp_rank,
                                                                     self.multiple),
                                 collate_fn=self.collate_fn, **dataloader_kwargs)

    def __len__(self) -> int:
        """Steps of a pass (map-style; the same on every rank). Iterable datasets: ``TypeError``."""
        if self.plan is None:
            raise TypeError("the number of evaluation steps of an IterableDataset is known only at its end.")
        return len(self.plan)

    def __iter__(self) -> Iterator[Any]:
        return self._iter_iterable() if self.iterable else self._iter_map()

    def _iter_map(self) -> Iterator[Any]:
        try:
            for k, batch in enumerate(self.loader):
                self._set(k, self.plan[k], self.loader.batch_sampler.rows(k))
                yield batch
        finally:  # also a loop left early (break, an exception: the generator is closed)
            self._leave()

    def _iter_iterable(self) -> Iterator[Any]:
        it, filler, k = iter(self.loader), None, 0
        try:
            while True:
                samples = [s for _, s in zip(range(self.batch_size), it)]
                if samples and filler is None:
                    filler = samples[0]
                counts, has_filler = self._exchange(len(samples), filler is not None)
                if not any(counts):
                    break
                if not all(has_filler):  # a rank whose shard is empty needs a sample to run the forward with
                    filler = self._share_filler(counts, filler)
                rows = _padded_rows(len(samples), self.multiple)
                batch = self.collate_fn(samples + [samples[0] if samples else filler] * (rows - len(samples)))
                self._set(k, counts, rows)
                yield batch
                k += 1
        finally:  # also a loop left early (break, an exception: the generator is closed)
            del it
            self._leave()

    def _exchange(self, valid: int, has_filler: bool) -> tuple[list[int], list[bool]]:
        """All-gather ``(real rows, has a filler sample)`` of every rank (one small tensor per step)."""
        if self.dp_size == 1:
            return [valid], [has_filler]
        self._check_group()
        mine = torch.tensor([valid, int(has_filler)], dtype=torch.int64)
        allv = [torch.zeros_like(mine) for _ in range(self.dp_size)]
        dist.all_gather(allv, mine, group=self.group)
        return [int(v[0]) for v in allv], [bool(v[1]) for v in allv]

    def _share_filler(self, counts: list[int], filler: Any) -> Any:
        src = next(r for r, c in enumerate(counts) if c)
        box = [filler if self.dp_rank == src else None]
        dist.broadcast_object_list(box, src=_global_rank(self.group, src), group=self.group)
        return filler if filler is not None else box[0]

    def _set(self, k: int, counts: list[int], rows: int) -> None:
        self.step, self._counts, self.rows, self.num_valid = k, list(counts), rows, counts[self.dp_rank]
        _ACTIVE.add(self)  # torchloom.gather_for_metrics(values) without loader= finds it

    def _leave(self) -> None:
        """Out of the loop (finished or left early): no current batch, and no longer the implicit loader."""
        self.step, self.num_valid, self.rows, self._counts = -1, 0, 0, []
        _ACTIVE.discard(self)

    # -- metrics ---------------------------------------------------------------------------------------------
    @property
    def is_filler(self) -> bool:
        """The batch just yielded holds no real sample (run its forward, count nothing)."""
        return self.num_valid == 0

    @property
    def step_counts(self) -> list[int]:
        """Real rows of every dp rank in the current step (rank order)."""
        return list(self._counts)

    def valid_mask(self) -> torch.Tensor:
        """``(rows,)`` bool: True for the real rows of the batch just yielded."""
        return torch.arange(self.rows) < self.num_valid

    def valid(self, values: torch.Tensor) -> torch.Tensor:
        """``values[:num_valid]``: a per-row tensor of the batch just yielded (dim 0 = its rows) cut to the
        real samples. Raises DataError if dim 0 is not the batch's row count."""
        self._check_rows(values)
        return values[: self.num_valid]

    def gather_for_metrics(self, values: Any, pad_value: float | int | bool | None = None) -> Any:
        """All-gather per-row tensors of the current step over the data-parallel group, filler dropped.

        Collective: every rank of the group calls it once for the same step. ``values`` is a tensor or a
        nested dict / list / tuple of tensors (the same structure on every rank); each tensor has the batch's
        rows (or exactly its ``num_valid`` real rows) in dim 0, any trailing shape and dtype, on the device the
        group's backend uses. Returns the same structure, each tensor ``(sum(step_counts), ...)``: the step's
        real rows of rank 0, 1, ... in order, which for map-style data is the dataset order. Same result on
        every rank.

        Every call first all-gathers each rank's structure, shapes and dtypes (one small object). Ranks whose
        trailing dims (dim 1..) differ, e.g. logits of batches padded each to its own length, are an error by
        default; ``pad_value=`` pads every tensor's dims 1.. at the end to the largest size over the ranks
        with that value (Accelerate's ``pad_across_processes`` + ``gather_for_metrics`` in one call; e.g.
        ``-100`` for labels, the pad token id for predictions).

        Raises:
            DataError (on every rank: a rank's own problem is exchanged first, so no peer is left waiting):
            called outside the loop, a non-tensor leaf,
            a tensor without the batch's rows in dim 0, a structure, dtype or number of dims that differs
            between ranks, or trailing shapes that differ without ``pad_value``.
        """
        if self.step < 0:
            raise DataError("gather_for_metrics needs the batch the loader just yielded: call it inside the loop (a "
                            "loop left by break, or an iterator no longer referenced, is over).")
        if self.dp_size > 1:
            self._check_group()

        def mine() -> tuple[list[torch.Tensor], Any, int, None]:
            leaves, spec = _flatten(values)
            return [v if v.dim() > 0 and v.shape[0] == self.num_valid else self.valid(v) for v in leaves], spec, \
                self.num_valid, None

        spec, metas, parts = gather_rows(mine, self.dp_size, self.group, pad_value)
        counts = [m[2] for m in metas]  # == self._counts
        return _unflatten(spec, [torch.cat([p[:c] for p, c in zip(ps, counts)]) for ps in parts])

    def reduce_metrics(self, total: torch.Tensor | float, count: torch.Tensor | float) -> torch.Tensor:
        """:func:`reduce_metrics` over this loader's data-parallel group."""
        if self.dp_size > 1:
            self._check_group()
        return _reduce(total, count, self.group if self.dp_size > 1 else _NO_GROUP)

    def _check_group(self) -> None:
        size = group_size(self.group)
        if size != self.dp_size:
            raise DataError(f"this evaluation step needs a collective over the {self.dp_size} data-parallel ranks, but "
                            f"the {'given' if self.group is not None else 'default'} process group has {size} "
                            "rank(s); build the loader with mesh=res.mesh or group=<the data-parallel group>.")

    def _check_rows(self, values: torch.Tensor) -> None:
        if values.dim() == 0 or values.shape[0] != self.rows:
            raise DataError(f"expected a per-row tensor with {self.rows} rows in dim 0 (the batch just yielded, "
                            f"{self.num_valid} of them real), got shape {tuple(values.shape)}.")


_ACTIVE: weakref.WeakSet[EvalLoader] = weakref.WeakSet()  # the EvalLoaders inside their loop on this process


def last_eval_loader() -> EvalLoader | None:
    """The :class:`EvalLoader` this process is iterating now (inside its loop), or None.

    Raises:
        DataError: several are being iterated (nested loops, or an iterator kept alive after ``next``): which
            one a value belongs to is ambiguous, so ``gather_for_metrics`` needs ``loader=``.
    """
    active = [ld for ld in _ACTIVE if ld.step >= 0]
    if len(active) > 1:
        raise DataError(f"gather_for_metrics(values) without loader=: {len(active)} EvalLoaders are being iterated on "
                        "this process (nested loops, or an iterator still alive), so which one the values come from is "
                        "ambiguous; pass loader=<the loader that yielded the batch>.")
    return active[0] if active else None


def gather_rows(prepare: Callable[[], tuple[list[torch.Tensor], Any, int, Any]], size: int,
                group: dist.ProcessGroup | None, pad_value: float | int | bool | None,
                check: Callable[[list[Any]], None] | None = None) -> tuple[Any, list[Any], list[list[torch.Tensor]]]:
    """The collective core of both ``gather_for_metrics``: every rank's rows of a structure of tensors.

    ``prepare()`` runs on this rank and returns ``(leaves, spec, rows, extra)``: the tensors (dim 0 = ``rows``, this
    rank's real rows), ``_flatten``'s spec and a picklable ``extra`` for ``check``. One ``all_gather_object`` then
    exchanges every rank's ``(spec, [(trailing shape, dtype)], rows, extra)``, or None where ``prepare`` raised a
    DataError; so that error, a failing ``check(metas)`` or a disagreement (:func:`_agree`) raises on *every* rank
    and none waits in the tensor all-gathers. ``size`` 1: no communication (``group`` is not used).

    Returns:
        ``(spec, metas, parts)``: ``parts[leaf][rank]`` is that rank's tensor padded to the largest ``rows`` in dim 0
        (its first ``metas[rank][2]`` rows are real) and to the agreed trailing shape (``pad_value``, else 0).
    """
    try:
        leaves, spec, rows, extra = prepare()
    except DataError as e:
        if size == 1:
            raise
        local, meta = e, None  # still join the exchange, so the other ranks raise too instead of waiting
    else:
        local, meta = None, (spec, [(tuple(v.shape[1:]), str(v.dtype)) for v in leaves], rows, extra)
    metas: list[Any] = [meta]
    if size > 1:
        metas = [None] * size
        dist.all_gather_object(metas, meta, group=group)
    if local is not None:
        raise local
    failed = [r for r, m in enumerate(metas) if m is None]
    if failed:
        raise DataError(f"gather_for_metrics: rank(s) {failed} passed values they cannot gather (see their "
                        "DataError); every rank stops so none waits in the collective.")
    if check is not None:
        check(metas)  # the same metas everywhere: every rank raises alike
    trailing = _agree([(m[0], m[1]) for m in metas], pad_value)
    most = max(m[2] for m in metas)
    parts = []
    for v, shape in zip(leaves, trailing):
        padded = v.new_full((most, *shape), 0 if pad_value is None else pad_value)
        padded[tuple(slice(0, d) for d in v.shape)] = v
        if size == 1:
            parts.append([padded])
            continue
        got = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(got, padded, group=group)
        parts.append(got)
    return spec, metas, parts


def _flatten(values: Any) -> tuple[list[torch.Tensor], Any]:
    """Tensor leaves of a nested dict / list / tuple (dicts in key order) and a picklable structure spec."""
    if torch.is_tensor(values):
        return [values], "T"
    if isinstance(values, dict):
        leaves, specs = [], []
        for k, v in values.items():
            sub, spec = _flatten(v)
            leaves += sub
            specs.append((k, spec))
        return leaves, ("dict", type(values), tuple(specs))
    if isinstance(values, (list, tuple)):
        leaves, specs = [], []
        for v in values:
            sub, spec = _flatten(v)
            leaves += sub
            specs.append(spec)
        return leaves, ("seq", type(values), tuple(specs))
    raise DataError(f"gather_for_metrics gathers tensors and dicts / lists / tuples of them, got a "
                    f"{type(values).__name__}; make it a per-row tensor (e.g. torch.as_tensor).")


def _unflatten(spec: Any, leaves: list[torch.Tensor]) -> Any:
    it = iter(leaves)

    def build(sp: Any) -> Any:
        if sp == "T":
            return next(it)
        kind, typ, subs = sp
        if kind == "dict":
            return typ((k, build(s)) for k, s in subs)
        items = [build(s) for s in subs]
        return typ(*items) if hasattr(typ, "_fields") else typ(items)  # namedtuple

    return build(spec)


def _agree(metas: list[Any], pad_value: Any) -> list[tuple[int, ...]]:
    """Check every rank's ``(structure, [(trailing shape, dtype)])`` and return each leaf's trailing shape to
    gather (the largest per dim when padding). Every rank sees the same ``metas``, so all raise together."""
    spec0, leaves0 = metas[0]
    bad = [r for r, (sp, lv) in enumerate(metas) if sp != spec0 or len(lv) != len(leaves0)]
    if bad:
        raise DataError(f"gather_for_metrics: ranks {bad} passed another structure than rank 0 (dict keys, list "
                        f"lengths or tensor positions differ): every rank must gather the same structure. Per "
                        f"rank: {[_describe(sp) for sp, _ in metas]}.")
    out = []
    for i, (shape0, dtype0) in enumerate(leaves0):
        per_rank = [lv[i] for _, lv in metas]
        where = f" (tensor {i} of the structure)" if len(leaves0) > 1 else ""
        shapes = {r: ("rows",) + s for r, (s, _) in enumerate(per_rank)}
        if any(d != dtype0 for _, d in per_rank):
            raise DataError(f"gather_for_metrics{where}: dtypes differ between ranks: "
                            f"{ {r: d for r, (_, d) in enumerate(per_rank)} }; cast to one dtype first.")
        if any(len(s) != len(shape0) for s, _ in per_rank):
            raise DataError(f"gather_for_metrics{where}: the number of dims differs between ranks: {shapes}.")
        if any(s != shape0 for s, _ in per_rank):
            if pad_value is None:
                raise DataError(f"gather_for_metrics{where}: trailing shapes differ between ranks: {shapes} (e.g. "
                                "batches padded each to its own length); pass pad_value=... (e.g. -100 for labels, "
                                "the pad token id for predictions) to pad dims 1.. to the largest size, or pad "
                                "to a fixed length in collate_fn.")
            shape0 = tuple(max(s[d] for s, _ in per_rank) for d in range(len(shape0)))
        out.append(shape0)
    return out


def _describe(spec: Any) -> str:
    if spec == "T":
        return "Tensor"
    kind, typ, subs = spec
    if kind == "dict":
        return "{" + ", ".join(f"{k!r}: {_describe(s)}" for k, s in subs) + "}"
    inner = ", ".join(_describe(s) for s in subs)
    return f"[{inner}]" if typ is list else f"{typ.__name__}({inner})"


_NO_GROUP = object()


def reduce_metrics(total: torch.Tensor | float, count: torch.Tensor | float,
                   group: dist.ProcessGroup | None | object = None) -> torch.Tensor:
    """``sum(total) / sum(count)`` over the data-parallel group, in float64: the mean of a metric over exactly
    the samples the ranks counted.

    Args:
        total: this rank's summed metric over its *real* rows (a number, or a tensor of several metrics).
        count: what ``total`` sums over (samples, tokens, ...): a number or a tensor of ``total``'s shape.
        group: the data-parallel group. None: the current torchloom mesh's data-parallel group when
            ``auto_accelerate`` built one (``torchloom.parallel.mesh.current_mesh()``), else the default group
            when a process group is initialised. Reduce over data-parallel ranks only: tensor/pipeline peers
            hold copies of the same numbers.

    Returns:
        float64 CPU tensor of ``total``'s shape; the same on every rank. Collective when distributed.

    Raises:
        DataError: a global count of zero (nothing was counted), mismatched shapes, or a ``group`` that is
            not the current mesh's data-parallel group when that mesh has tensor/pipeline/expert degrees > 1.
    """
    if group is not _NO_GROUP and dist.is_available() and dist.is_initialized():
        group = _metric_group(group)
    return _reduce(total, count, group)


def _reduce(total: torch.Tensor | float, count: torch.Tensor | float, group: Any) -> torch.Tensor:
    """``reduce_metrics`` over exactly ``group`` (``_NO_GROUP``: this process only)."""
    t = torch.as_tensor(total, dtype=torch.float64).detach().cpu()
    c = torch.as_tensor(count, dtype=torch.float64).detach().cpu()
    try:
        c = c.expand_as(t) if c.dim() == 0 else c
        both = torch.stack([t.reshape(-1), c.reshape(-1)])
    except RuntimeError:
        raise DataError(f"count of shape {tuple(c.shape)} does not fit total of shape {tuple(t.shape)}.") from None
    if group is not _NO_GROUP and dist.is_available() and dist.is_initialized():
        dist.all_reduce(both, group=group)
    if (both[1] == 0).any():
        raise DataError("reduce_metrics: the global count is 0 (no sample was counted on any rank); check that "
                        "the metric's count covers the real rows (EvalLoader.num_valid), not filler batches.")
    return (both[0] / both[1]).reshape(t.shape)


def _metric_group(group: dist.ProcessGroup | None) -> Any:
    """The group ``reduce_metrics`` reduces over: the given one (checked against the current mesh), else the
    current mesh's dp group (``_NO_GROUP`` when dp is 1), else the default group."""
    cur = current_mesh()
    if cur is None:
        return group
    if group is not None:
        _check_against_mesh(cur, group, "reduce_metrics: group")
        return group
    return cur.group("dp") if cur.dp_size > 1 else _NO_GROUP


def eval_loader(dataset: Dataset, batch_size: int, *, mesh: Any = None, group: dist.ProcessGroup | None = None,
                dp_rank: int | None = None, dp_size: int | None = None, pad_to_multiple_of: int = 1,
                **kwargs: Any) -> EvalLoader:
    """This rank's :class:`EvalLoader` (every sample once over the data-parallel ranks; no padding).

    The data-parallel layout comes from the first given of: ``mesh`` (a :class:`ParallelMesh`, e.g.
    ``res.mesh``: its ``dp`` rank, size and group, so tensor/pipeline peers read the same samples),
    ``group`` (a process group whose ranks split the data), ``dp_rank``/``dp_size`` (explicit; collectives
    then use the default group, which must be exactly the data-parallel ranks), else the current torchloom
    mesh (the one the last ``auto_accelerate`` built, ``torchloom.parallel.mesh.current_mesh()``), else the
    default process group (or one process). With a current mesh whose tp/pp/ep degrees are not all 1, a
    ``group`` other than its dp group, or ``dp_rank``/``dp_size`` other than its own, is a ``DataError``
    (tensor/pipeline peers would read different samples and their forwards mix them); with matching
    ``dp_rank``/``dp_size`` the mesh's dp group is used.

    Args:
        batch_size: samples per rank per step. ``pad_to_multiple_of``, ``collate_fn`` and DataLoader
            arguments: see :class:`EvalLoader`.

    Raises:
        DataError: an invalid layout or batch size (see :class:`EvalLoader`), or a layout that contradicts
            the current torchloom mesh (see above).
    """
    rank, size, grp = _layout(mesh, group, dp_rank, dp_size)
    return EvalLoader(dataset, batch_size, dp_rank=rank, dp_size=size, group=grp,
                      pad_to_multiple_of=pad_to_multiple_of, **kwargs)


def _layout(mesh: Any, group: dist.ProcessGroup | None, dp_rank: int | None,
            dp_size: int | None) -> tuple[int, int, dist.ProcessGroup | None]:
    """``dp_layout`` with the current torchloom mesh (``auto_accelerate``'s) as the default, and a check that an
    explicit group / dp rank agrees with it."""
    cur = None if mesh is not None else current_mesh()
    if cur is None:
        return dp_layout(mesh=mesh, group=group, dp_rank=dp_rank, dp_size=dp_size)
    if group is not None:
        _check_against_mesh(cur, group, "group")
        return dp_layout(group=group)
    if dp_rank is not None or dp_size is not None:
        rank, size, _ = dp_layout(dp_rank=dp_rank, dp_size=dp_size)
        if cur.dp_size == dist.get_world_size():  # no tensor/pipeline/expert peers: explicit numbers win
            return rank, size, None
        if (rank, size) != (cur.dp_rank, cur.dp_size):
            raise DataError(f"dp_rank={rank}/dp_size={size} contradict the current torchloom mesh {cur!r} (built by "
                            f"auto_accelerate), whose data-parallel rank/size here is {cur.dp_rank}/{cur.dp_size}: "
                            "tensor/pipeline peers must read the same samples. Pass mesh=res.mesh or nothing.")
    return dp_layout(mesh=cur)


def _check_against_mesh(mesh: Any, group: dist.ProcessGroup, what: str) -> None:
    """Raise if ``group`` is not this rank's data-parallel group of ``mesh`` (matters only with tp/pp/ep > 1;
    without them every group of the world's ranks splits the data the same way)."""
    if mesh.dp_size == dist.get_world_size():
        return
    want = dist.get_process_group_ranks(mesh.group("dp")) if mesh.dp_size > 1 else [dist.get_rank()]
    have = dist.get_process_group_ranks(group)
    if sorted(have) != sorted(want):
        raise DataError(f"{what} with global ranks {sorted(have)} is not the data-parallel group {sorted(want)} of the "
                        f"current torchloom mesh {mesh!r} (built by auto_accelerate): tensor/pipeline peers hold "
                        "copies of the same samples, so splitting, gathering or reducing over other ranks mixes or "
                        "double-counts them. Pass mesh=res.mesh (or group=res.mesh.group('dp')), or nothing.")


def _global_rank(group: dist.ProcessGroup | None, rank_in_group: int) -> int:
    return rank_in_group if group is None else dist.get_global_rank(group, rank_in_group)


def _identity(x: Any) -> Any:
    return x


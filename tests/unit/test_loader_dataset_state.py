"""``StatefulDataLoader`` (batch-count mode) resuming a Hugging Face ``datasets.IterableDataset`` from its own
``state_dict()`` instead of re-reading batches; when it falls back to replay. 2 ranks with the checkpoint:
tests/distributed/test_hf_loss_data.py."""
from __future__ import annotations

import pytest

datasets = pytest.importorskip("datasets")

from torchloom.data.loader import StatefulDataLoader  # noqa: E402
from torchloom.data.sampler import DataError  # noqa: E402

ROWS, BATCH, STOP = 40, 4, 3


def _dataset(reads: list[int], shuffle_buffer: int | None = None):
    """40 rows in 4 Arrow shards; ``reads[0]`` counts the rows produced (``map`` runs once per row read)."""
    def count(row):
        reads[0] += 1
        return row

    ds = datasets.Dataset.from_dict({"x": list(range(ROWS))}).to_iterable_dataset(num_shards=4)
    if shuffle_buffer:
        ds = ds.shuffle(seed=0, buffer_size=shuffle_buffer)
    return ds.map(count)


def _run(loader, stop=None):
    out = []
    for b in loader:
        out.append(b["x"].tolist())
        if len(out) == stop:
            break
    return out


def _resume(state, reads, **kw):
    loader = StatefulDataLoader(_dataset(reads, kw.pop("shuffle_buffer", None)), batch_size=BATCH, **kw)
    loader.load_state_dict(state)
    reads[0] = 0
    return loader, _run(loader)


def test_resume_from_dataset_state_equals_uninterrupted_without_replay():
    reads = [0]
    full = _run(StatefulDataLoader(_dataset(reads), batch_size=BATCH))
    loader = StatefulDataLoader(_dataset(reads), batch_size=BATCH)
    assert loader.resumes_from_dataset_state
    first = _run(loader, STOP)
    state = loader.state_dict()
    assert state["batches_yielded"] == STOP and state["dataset_state"]["epoch"] == 0
    resumed, rest = _resume(state, reads)
    assert first + rest == full
    assert reads[0] == ROWS - STOP * BATCH  # only the rows after the position were read
    assert resumed.state_dict()["dataset_state"] is None and resumed.epoch == 1  # the pass ended: next epoch
    assert _run(resumed) == full  # epoch 1 starts from the beginning, not from the restored state

    # a replay loader (or an older checkpoint without dataset_state) still resumes exactly, reading everything
    _, rest = _resume(state, reads, iterable_resume="replay")
    assert first + rest == full and reads[0] == ROWS
    old = {k: v for k, v in state.items() if k != "dataset_state"}
    _, rest = _resume(old, reads)
    assert first + rest == full and reads[0] == ROWS


def test_falls_back_to_replay_where_the_state_is_not_the_position():
    reads = [0]
    # worker processes iterate their own copies ahead of the batches handed out
    assert not StatefulDataLoader(_dataset(reads), batch_size=BATCH, num_workers=2).resumes_from_dataset_state
    with pytest.raises(DataError, match="num_workers=0"):
        StatefulDataLoader(_dataset(reads), batch_size=BATCH, num_workers=2, iterable_resume="state")
    # a shuffle buffer is not in HF's state (its resume loses the buffered rows): replay keeps it exact
    loader = StatefulDataLoader(_dataset(reads, shuffle_buffer=8), batch_size=BATCH)
    assert not loader.resumes_from_dataset_state and "dataset_state" not in loader.state_dict()
    full = _run(StatefulDataLoader(_dataset(reads, shuffle_buffer=8), batch_size=BATCH))
    first = _run(loader, STOP)
    _, rest = _resume(loader.state_dict(), reads, shuffle_buffer=8)
    assert first + rest == full
    with pytest.raises(DataError, match="state_dict"):
        StatefulDataLoader(list(range(8)), batch_size=2, iterable_resume="state")
    with pytest.raises(DataError, match="iterable_resume"):
        StatefulDataLoader(_dataset(reads), batch_size=BATCH, iterable_resume="fast")

"""``torchloom.data.eval_loader`` in one process (ranks simulated by dp_rank/dp_size): every sample exactly once,
uneven last step, filler rows only where shapes need them, and the errors. Multi-rank runs:
tests/distributed/test_uneven_data.py."""
from __future__ import annotations

import pytest
import torch

from torchloom.data import DataError, build_dataloader, eval_loader, reduce_metrics, split_counts


def _passes(n, bs, dp, **kw):
    """Per rank: the list of (batch ids, num_valid) of one pass."""
    out = []
    for r in range(dp):
        loader = eval_loader(list(range(n)), bs, dp_rank=r, dp_size=dp, **kw)
        out.append([(b.tolist(), loader.num_valid) for b in loader])
    return out


@pytest.mark.parametrize("n,bs,dp", [(13, 2, 4), (13, 2, 2), (5, 1, 4), (3, 4, 4), (16, 2, 4), (1, 3, 2)])
def test_every_sample_exactly_once_and_same_steps(n, bs, dp):
    passes = _passes(n, bs, dp)
    assert len({len(p) for p in passes}) == 1, "ranks run different numbers of steps (a collective forward hangs)"
    seen = [i for k in range(len(passes[0])) for p in passes for i in p[k][0][: p[k][1]]]
    assert seen == list(range(n)), "real rows, rank after rank, step after step, are not the dataset in order"
    for p in passes:
        for ids, valid in p:
            assert len(ids) == max(valid, 1) and valid <= bs  # no padding, a 1-row filler only when empty


def test_last_step_is_split_evenly():
    assert split_counts(13, 2, 4) == [[2, 2, 2, 2], [2, 1, 1, 1]]
    assert split_counts(13, 2, 2) == [[2, 2]] * 3 + [[1, 0]]
    assert split_counts(0, 2, 2) == []


def test_training_loader_pads_by_repeating_samples():
    """Why evaluation needs its own loader: drop_last=False pads the epoch by repeating samples (13 -> 16)."""
    ids = [i for r in range(4) for b in build_dataloader(list(range(13)), dp_rank=r, dp_size=4, micro_batch_size=2,
                                                         shuffle=False, drop_last=False) for i in b.tolist()]
    assert len(ids) == 16 and len(set(ids)) == 13


def test_pad_to_multiple_of_and_masks():
    passes = _passes(13, 3, 2, pad_to_multiple_of=2)
    assert passes[1][-1] == ([12, 12], 0)  # rank 1 has nothing in the last step: a filler of 2 rows
    assert passes[0][0] == ([0, 1, 2, 0], 3)
    loader = eval_loader(list(range(5)), 3, dp_rank=0, dp_size=1, pad_to_multiple_of=2)
    batches = list(iter(loader))
    assert [b.tolist() for b in batches] == [[0, 1, 2, 0], [3, 4]]
    it = iter(loader)
    first = next(it)
    assert loader.valid_mask().tolist() == [True, True, True, False]
    assert loader.valid(first * 10).tolist() == [0, 10, 20]
    assert loader.gather_for_metrics(first).tolist() == [0, 1, 2]
    with pytest.raises(DataError, match="4 rows in dim 0"):
        loader.valid(torch.zeros(3))


def test_reduce_metrics_single_process_and_errors():
    assert float(reduce_metrics(torch.tensor(3.0), 4)) == 0.75
    torch.testing.assert_close(reduce_metrics(torch.tensor([1.0, 6.0]), torch.tensor([2.0, 3.0])),
                               torch.tensor([0.5, 2.0], dtype=torch.float64))
    with pytest.raises(DataError, match="global count is 0"):
        reduce_metrics(0.0, 0)
    with pytest.raises(DataError, match="does not fit"):
        reduce_metrics(torch.zeros(2), torch.ones(3))


def test_bad_arguments():
    with pytest.raises(DataError, match="owns the order"):
        eval_loader(list(range(4)), 2, dp_rank=0, dp_size=1, shuffle=True)
    with pytest.raises(DataError, match="both dp_rank and dp_size"):
        eval_loader(list(range(4)), 2, dp_rank=0)
    with pytest.raises(DataError, match=r"dp_rank must be an int in \[0, 2\)"):
        eval_loader(list(range(4)), 2, dp_rank=2, dp_size=2)
    with pytest.raises(DataError, match="batch_size must be a positive int"):
        eval_loader(list(range(4)), 0)
    loader = eval_loader(list(range(4)), 1, dp_rank=0, dp_size=2)  # simulated rank: gathering needs a group
    it = iter(loader)  # kept: a dropped iterator has left the loop
    next(it)
    with pytest.raises(DataError, match="default process group has 1 rank"):
        loader.gather_for_metrics(torch.zeros(1))


def test_gather_for_metrics_nested_structures_one_process():
    loader = eval_loader(list(range(5)), 3, dp_rank=0, dp_size=1, pad_to_multiple_of=2)
    it = iter(loader)  # kept: a dropped iterator has left the loop
    first = next(it)  # rows [0, 1, 2, 0(filler)]
    g = loader.gather_for_metrics({"a": first, "b": [first * 2, (first.double(),)]})
    assert g["a"].tolist() == [0, 1, 2] and g["b"][0].tolist() == [0, 2, 4]
    assert isinstance(g["b"][1], tuple) and g["b"][1][0].dtype == torch.float64
    with pytest.raises(DataError, match="gathers tensors and dicts"):
        loader.gather_for_metrics({"a": [0, 1, 2, 3]})
    with pytest.raises(DataError, match="4 rows in dim 0"):
        loader.gather_for_metrics([first, torch.zeros(2)])


def test_gather_agreement_checks_every_rank_alike():
    """What every rank concludes from the all-gathered (structure, [(trailing shape, dtype)]) of all ranks."""
    from torchloom.data.eval import _agree, _flatten

    _, spec = _flatten({"x": torch.zeros(1)})
    _, other = _flatten({"y": torch.zeros(1)})
    f32 = str(torch.float32)
    assert _agree([(spec, [((2, 5), f32)]), (spec, [((2, 5), f32)])], None) == [(2, 5)]
    with pytest.raises(DataError, match=r"trailing shapes differ.*0: \('rows', 2, 5\), 1: \('rows', 2, 7\).*pad_value"):
        _agree([(spec, [((2, 5), f32)]), (spec, [((2, 7), f32)])], None)
    assert _agree([(spec, [((2, 5), f32)]), (spec, [((3, 4), f32)])], 0) == [(3, 5)]
    with pytest.raises(DataError, match=r"ranks \[1\] passed another structure.*\{'y': Tensor\}"):
        _agree([(spec, [((), f32)]), (other, [((), f32)])], None)
    with pytest.raises(DataError, match="dtypes differ"):
        _agree([(spec, [((), f32)]), (spec, [((), str(torch.int64))])], 0)
    with pytest.raises(DataError, match="number of dims differs"):
        _agree([(spec, [((2,), f32)]), (spec, [((2, 1), f32)])], 0)


def test_no_current_mesh_without_a_process_group():
    from torchloom.parallel.mesh import current_mesh, set_current_mesh

    set_current_mesh(object())  # a recorded mesh is ignored when no process group is initialised
    try:
        assert current_mesh() is None
        assert eval_loader(list(range(4)), 2).dp_size == 1
    finally:
        set_current_mesh(None)

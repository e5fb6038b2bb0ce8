"""The search's account of what it refused, in-process: batch arithmetic first (the global batch a layout
cannot split is the usual cause and the easiest fix), then the refusals by how many layouts each removed; the
headline names the main cause and its fix, also when memory or a successful search hides it. And the table's
unit for a model without a sequence (a CNN): samples/s, not image channels counted as tokens."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

from torchloom.errors import StrategyError
from torchloom.cost.analysis import analyze_model, sample_seq_len
from torchloom.search.search import refusals, search
from tests.unit.test_search_space import toy_hw, toy_info


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.l2(torch.relu(self.l1(x)))


class _Net(nn.Module):
    """No Hugging Face family, no stage runner: tensor and pipeline parallelism refuse it (structure checks)."""

    def __init__(self, d=32, n=2):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).mean()


def test_a_global_batch_no_dp_divides_is_named_first_with_its_fix():
    """The issue's case: global batch 31 on 2 ranks. The dp=2 layouts are pruned for the batch, the pp2/tp2
    ones fail the model-structure checks with more candidates each; the batch must lead, and the headline
    must not blame the structure checks."""
    with torch.device("meta"):
        model = _Net()
    info = analyze_model(model, seq_len=8, sample_input=torch.zeros(1, 8, 32))
    with pytest.raises(StrategyError) as e:
        search(info=info, world_size=2, global_batch=31, hw=toy_hw(ranks=2), options={"top_k": 0})
    msg = str(e.value)
    assert "failed the model-structure checks" not in msg
    main, _, listed = msg.partition("Refusals")
    assert "Main cause: global batch 31 is not divisible by dp=2, which rules out 2 of the 4 layouts" in main
    assert "use a global batch divisible by 2 (e.g. 30 or 32)" in main
    assert "tensor_parallel" not in main and "pipeline_parallel" not in main
    order = [listed.index(w) for w in ("global batch 31", "tensor_parallel", "pipeline_parallel")]
    assert order == sorted(order), listed
    assert "2 layouts: global batch 31" in listed and "1 layout (8 candidates): tensor_parallel" in listed


def test_refusals_order_batch_first_then_by_layouts_removed():
    info = toy_info(blocks=1, heads=3)  # tp=2 cannot split 3 heads, pp=2 > 1 block
    info = dataclasses.replace(info, signature=info.signature + "-refusals")
    with pytest.raises(StrategyError) as e:
        search(info=info, world_size=4, global_batch=6, hw=toy_hw(ranks=4), options={"top_k": 0})
    msg = str(e.value)
    assert "Main cause: global batch 6 is not divisible by dp=4" in msg, msg
    assert "a global batch divisible by 4 (e.g. 4 or 8)" in msg
    listed = msg.partition("Refusals")[2]
    # the batch first though the pipeline's refusal removed more layouts; then by layouts removed
    order = [re.search(w, listed).start() for w in (r"3 layouts: global batch 6", r"4 layouts: pp=2 > 1 blocks",
                                                    r"3 layouts \(\d+ candidates\): tensor_parallel")]
    assert order == sorted(order), listed


def test_a_successful_search_says_which_layouts_the_batch_ruled_out():
    r = search(info=toy_info(), world_size=4, global_batch=6, hw=toy_hw(ranks=4), options={"top_k": 0})
    note = next(n for n in r.notes if n.startswith("global batch 6"))
    assert "is not divisible by dp=4" in note and "a global batch divisible by 4 (e.g. 4 or 8)" in note, note
    rows = refusals(r)
    assert rows[0][0].startswith("global batch ") and rows[0][1] == 3  # dpr4, dps4, dpr2 x dps2


def test_when_nothing_fits_the_batch_is_among_the_fixes():
    """Memory is the headline, but the layouts the batch ruled out were never predicted: say so."""
    with pytest.raises(StrategyError) as e:
        search(info=toy_info(act=50e6), world_size=2, global_batch=3, hw=toy_hw(memory=2**20, ranks=2, device="cpu"),
               options={"top_k": 0, "exclude": ["checkpoint"]})
    msg = str(e.value)
    assert "fits no candidate on 2 ranks" in msg
    assert "a global batch divisible by 2 (e.g. 2 or 4)" in msg and "were not considered" in msg, msg


# ------------------------------------------------------------------------------ samples/s without a sequence
@pytest.mark.parametrize("batch, want", [
    (torch.zeros(1, 3, 32, 32), None),  # images: channels are not tokens
    (torch.zeros(1, 784), None),  # feature vectors
    (torch.zeros(1, 28, 28, dtype=torch.uint8), None),  # a uint8 image
    (torch.zeros(1, 128, dtype=torch.long), 128),  # token ids
    ({"input_ids": torch.zeros(1, 64, dtype=torch.long), "labels": torch.zeros(1, 64, dtype=torch.long)}, 64),
    ((torch.zeros(1, 16, 8), torch.zeros(1)), 16),  # (B, S, H) embeddings
])
def test_the_sequence_length_of_a_sample(batch, want):
    from torchloom.search.auto import _seq_len

    assert sample_seq_len(batch) == want
    assert _seq_len(batch) == want


def test_the_table_counts_samples_for_a_model_without_a_sequence():
    info = dataclasses.replace(toy_info(), seq_len=1, sequence=False)
    r = search(info=info, world_size=2, global_batch=8, hw=toy_hw(ranks=2), options={"top_k": 0})
    assert r.sequence is False
    table = r.table()
    assert "samples/s/dev" in table and "tok/s/dev" not in table and "throughput in samples" in table
    best = r.ranked[0]
    row = table.splitlines()[2]
    want = 8 / best.prediction.step_time_s / 2
    assert f"{want:,.0f}" in row, (want, row)
    from torchloom.search.result import SearchResult

    assert SearchResult.from_dict(r.to_dict()).sequence is False  # a cached plan keeps the unit
    assert "tok/s/dev" in search(info=toy_info(), world_size=2, global_batch=8, hw=toy_hw(ranks=2),
                                 options={"top_k": 0}).table()

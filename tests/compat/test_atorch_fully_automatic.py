"""ATorch's fully automatic mode (``auto_accelerate(..., load_strategy=None)``) on torchloom's search, in one
process (the 2-rank run is the toy example in test_atorch_examples.py): ``excluded``/``included`` mapped to
the search's names, every chosen plan expressible as an ATorch strategy that compat applies as the same
native methods, and the search result returned."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.compat.test_compat_strategy_forms import Toy, ToyData, loss_func, run_train
from tests.models import tiny_llama
from torchloom.compat.atorch.auto.accelerate import auto_accelerate
from torchloom.compat.atorch.auto.automatic import search_options, to_atorch
from torchloom.compat.atorch.auto.strategy import Strategy
from torchloom.compat.atorch.strategy_map import translate
from torchloom.errors import StrategyError
from torchloom.parallel.mesh import ParallelDims
from torchloom.search.candidate import Candidate


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path))  # calibration cache: not the machine's


def test_excluded_included_time_limit_as_search_options():
    opts, notes = search_options(["amp_native", "fsdp", "half"], ["checkpoint"], 30)
    assert opts == {"exclude": ["sequence_parallel", "pipeline_parallel", "amp", "fsdp"], "include": ["checkpoint"],
                    "time_limit_s": 30.0}
    assert any("'half'" in n for n in notes)
    with pytest.raises(StrategyError, match="'amp_nativ' is not an ATorch method name"):
        search_options(["amp_nativ"], None, None)
    with pytest.raises(StrategyError, match="included method 'half' is not chosen"):
        search_options(None, ["half"], None)
    with pytest.raises(StrategyError, match="pipeline"):
        search_options(None, ["pipeline_parallel"], None)


def cand(dims, methods, mb=2):
    return Candidate(dims, tuple(methods), mb, 1, 16)


@pytest.mark.parametrize("world, dims, methods, expected", [
    (2, ParallelDims(dp_replicate=2), [("ddp", {})], [("parallel_mode", ([("data", 2)], None), False)]),
    (2, ParallelDims(dp_shard=2), [("fsdp", {})],
     [("parallel_mode", ([("data", 2)], None), False), ("fsdp", None, False)]),
    (2, ParallelDims(dp_shard=2), [("fsdp", {"reshard_after_forward": False}), ("amp", {"dtype": "bfloat16"})],
     [("parallel_mode", ([("data", 2)], None), False), ("zero2", None, False),
      ("amp_native", {"dtype": torch.bfloat16}, False)]),
    (4, ParallelDims(dp_replicate=2, dp_shard=2), [("fsdp", {}), ("checkpoint", {})],
     [("parallel_mode", ([("replicate", 2), ("zero", 2)], None), False), ("fsdp", None, False),
      ("checkpoint", None, False)]),
    (2, ParallelDims(tp=2), [("tensor_parallel", {})],
     [("parallel_mode", ([("tensor", 2)], None), False), ("tensor_parallel", None, False)]),
])
def test_candidates_as_atorch_strategies(world, dims, methods, expected):
    c = cand(dims, methods)
    got = to_atorch(c, world)
    assert got == Strategy(expected), got
    native = [m for m in translate(got, world).methods if (m if isinstance(m, str) else m[0]) != "parallel_mode"]
    assert [(m, {}) if isinstance(m, str) else m for m in native] == [m for m in methods if m != ("ddp", {})]


@pytest.mark.parametrize("dims, methods", [
    (ParallelDims(pp=2), [("pipeline_parallel", {"schedule": "1f1b", "num_microbatches": 2})]),
    (ParallelDims(tp=2), [("tensor_parallel", {}), ("sequence_parallel", {})]),
    (ParallelDims(dp_replicate=2), [("ddp", {}), ("checkpoint", {"every_k": 2})]),
    (ParallelDims(dp_replicate=2), [("ddp", {"bucket_cap_mb": 1})]),
])
def test_candidates_without_atorch_form(dims, methods):
    assert to_atorch(cand(dims, methods), 2) is None


def test_space_keeps_atorch_expressible_candidates_of_every_kind():
    """On 4 ranks the restricted space still holds DDP, ZeRO-1/2/3, HSDP and TP plans."""
    from torchloom.cost.analysis import analyze_model
    from torchloom.search.options import SearchOptions
    from torchloom.search.space import enumerate_space

    info = analyze_model(tiny_llama(), seq_len=16)
    space = enumerate_space(info, 4, 8, SearchOptions.parse(search_options(None, None, None)[0]))
    kinds = set()
    for c in space.bases:
        s = to_atorch(c, 4)
        if s is None or c.grad_accum != 1:
            continue
        names = [n for n in s.opt_names() if n != "parallel_mode"]
        kinds.update(names or (["ddp"] if c.dims.dp > 1 else []))  # parallel_mode alone: DDP
    assert {"ddp", "zero1", "zero2", "fsdp", "tensor_parallel"} <= kinds, kinds


def test_fully_automatic_one_process(caplog):
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="torchloom"):
        status, res, best = auto_accelerate(Toy(), torch.optim.SGD, ToyData(), loss_func=loss_func,
                                            optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4},
                                            excluded=["amp_native"], time_limit=60)
    assert status is True
    assert "amp_native" not in best.opt_names() and best.opt_names()[0] == "parallel_mode"
    search = res.args["search"]
    measured = [t for t in search.trials if t.ok]
    assert measured and search.chosen_by == "measured"
    assert search.chosen.key() in {t.candidate.key() for t in measured}
    assert all("amp" not in t.candidate.names for t in search.trials)
    assert any(r.getMessage().startswith("trial 1/") for r in caplog.records)  # the progress lines
    assert run_train(res) == 16 // 4


def test_sample_batch_without_dataset():
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    status, res, best = auto_accelerate(Toy(), torch.optim.SGD, None, loss_func=loss_func, optim_args={"lr": 0.1},
                                        sample_batch=(x, y), batch_size=8, time_limit=60)
    assert status is True and res.dataloader is None
    assert [t.candidate.micro_batch for t in res.args["search"].trials] == [8] * len(res.args["search"].trials)
    out = res.model(res.prepare_input((x, y), "cpu"))
    assert out.shape == (8, 4)


def test_needs_optimizer_and_data(caplog):
    with caplog.at_level(logging.ERROR, logger="torchloom.compat.atorch"):
        assert auto_accelerate(Toy(), None, ToyData(), loss_func=loss_func) == (False, None, None)
        assert auto_accelerate(Toy(), torch.optim.SGD, None, loss_func=loss_func) == (False, None, None)
    msgs = [r.getMessage() for r in caplog.records]
    assert "needs optim_func" in msgs[0] and "needs a dataset or sample_batch" in msgs[1], msgs

"""torchloom.compat.atorch with experts: ATorch's ``("expert", N)`` parallel_mode degree is expert parallelism
carved out of the data-parallel ranks (ATorch's ``set_experts_process_group`` / ``[("expert", ep),
("expert_fsdp", edp)]`` groups), not a factor of the world. One process: the strategy forms; the 2-rank run
is in tests/distributed/test_annotations_moe.py."""
from __future__ import annotations

import pytest

from torchloom.api import plan_dims
from torchloom.compat.atorch.auto.accelerate import DeviceContext, adjust_strategy
from torchloom.compat.atorch.auto.automatic import to_atorch
from torchloom.compat.atorch.auto.strategy import Strategy
from torchloom.compat.atorch.strategy_map import translate
from torchloom.errors import StrategyError
from torchloom.parallel.mesh import ParallelDims
from torchloom.search.candidate import Candidate


def _mode(*dims):
    return Strategy([("parallel_mode", (list(dims), None), False)])


def test_expert_degree_is_not_a_world_factor():
    # 4 ranks: data 4 covers the world, expert 2 is carved out of it (before: data was "fitted" down to 2)
    ok, s = adjust_strategy(_mode(("data", 4), ("expert", 2)), DeviceContext(1, 4))
    assert ok and s[0][1] == ([("data", 4), ("expert", 2)], None)
    ok, s = adjust_strategy(_mode(("data", 1), ("expert", 2), ("expert_fsdp", 2)), DeviceContext(1, 4))
    assert ok and s[0][1] == ([("data", 4), ("expert", 2), ("expert_fsdp", 2)], None)
    ok, s = adjust_strategy(_mode(("tensor", 2), ("data", 1), ("expert", 2)), DeviceContext(1, 8))
    assert ok and s[0][1] == ([("tensor", 2), ("data", 4), ("expert", 2)], None)


def test_expert_degree_translates_to_ep_and_expert_parallel():
    t = translate(_mode(("data", 4), ("expert", 2)), 4)
    assert t.methods == [("parallel_mode", {"data": 4, "expert": 2}), "expert_parallel"]
    assert any("('expert', 2) is expert parallelism over 2 of the 4 data-parallel ranks" in n for n in t.notes)
    dims = plan_dims(t.methods, 4)
    assert (dims.dp, dims.ep, dims.edp, dims.tp) == (4, 2, 2, 1)
    t = translate(_mode(("data", 4), ("expert", 2), ("expert_fsdp", 2)), 4)  # ATorch's second group, checked
    assert t.methods == [("parallel_mode", {"data": 4, "expert": 2}), "expert_parallel"]
    tp_ep = Strategy([("parallel_mode", ([("tensor", 2), ("data", 2), ("expert", 2)], None), False),
                      ("tensor_parallel", None, False)])
    dims = plan_dims(translate(tp_ep, 4).methods, 4)
    assert (dims.tp, dims.dp, dims.ep) == (2, 2, 2)
    assert translate(_mode(("data", 2), ("expert", 1)), 2).methods == [("parallel_mode", {"data": 2, "expert": 1})]


def test_expert_degree_errors():
    with pytest.raises(StrategyError, match=r"ep must divide the data degree 4; choose ep among \[2, 4\]"):
        translate(_mode(("data", 4), ("expert", 3)), 4)
    with pytest.raises(StrategyError, match=r"\('expert_fsdp', 4\) does not match.*data / expert = 2"):
        translate(_mode(("data", 4), ("expert", 2), ("expert_fsdp", 4)), 4)
    with pytest.raises(StrategyError, match=r"expert_fsdp', 2\) needs an \('expert', n\)"):
        translate(_mode(("data", 4), ("expert_fsdp", 2)), 4)


def test_search_candidates_with_ep_have_an_atorch_form():
    for dims, methods, mode in (
        (ParallelDims(dp_replicate=4, ep=2), [("expert_parallel", {})], [("data", 4), ("expert", 2)]),
        (ParallelDims(dp_shard=4, ep=4), [("expert_parallel", {}), ("fsdp", {})], [("data", 4), ("expert", 4)]),
    ):
        got = to_atorch(Candidate(dims, tuple(methods), 2, 1, 16), 4)
        assert got is not None and got[0] == ("parallel_mode", (mode, None), False), got

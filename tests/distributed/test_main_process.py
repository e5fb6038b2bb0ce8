"""Main-process helpers and ``res.log`` on 2 gloo ranks, one launch (issue [10] item 4)."""
from __future__ import annotations

import pytest

from tests.distributed import _main_process_workers as W
from torchloom.testing import run_ranks
from torchloom.tracking import read_metrics


@pytest.mark.distributed
def test_main_process_helpers_and_log_on_two_ranks(tmp_path):
    r0, r1 = run_ranks(W.main_process_checks, 2, str(tmp_path), timeout=180)
    assert (r0["main"], r1["main"]) == (True, False)
    assert (r0["local_main"], r1["local_main"]) == (True, False)
    assert (r0["printed"], r1["printed"]) == ("hello from 0\n", "")
    assert r0["saw_cache"] and r1["saw_cache"]
    assert r0["second_error"] == "map failed" and r1["second_body_ran"] and "second_error" not in r1

    # 7 samples on 2 ranks: exactly 7 back, in dataset order, on both ranks, through both loader kinds
    for key in ("gather_7_b2", "gather_7_b3"):
        for got in (r0[key], r1[key]):
            assert got["eval_loader"] == got["eval_implicit"] == list(range(7)), key
            assert got["sampler_x"] == got["sampler_again"] == got["sampler_epoch"] == list(range(7)), key
            assert got["sampler_y"] == [10.0 * i for i in range(7)], key
            assert got["bad_rows_error"].startswith("gather_for_metrics"), key

    # res.log wrote on rank 0 only: one default run, one project run with rank 0's values
    assert (r0["default_warned"], r1["default_warned"]) == (1, 0)
    assert (r0["has_tracker"], r1["has_tracker"]) == (True, False)
    runs = list((tmp_path / "torchloom_logs").glob("run-*"))
    assert len(runs) == 1 and read_metrics(runs[0] / "metrics.jsonl") == [{"step": 0, "loss": 1.0}]
    recs = read_metrics(tmp_path / "logs" / "proj" / "metrics.jsonl")
    assert [(x["step"], x["rank"]) for x in recs] == [(0, 0), (1, 0), (2, 0)]
    assert all(isinstance(x["loss"], float) for x in recs)
    assert r0["custom"] == ({"lr": 0.1}, [({"loss": x["loss"], "rank": 0}, x["step"]) for x in recs], True)
    assert r1["custom"] == (None, [], False)

    # gather mistakes: a DataError on both ranks (none hangs, none gets wrong rows)
    for r in (r0, r1):
        g = r["gather_errors"]
        assert g["after_break"].startswith("DataError: gather_for_metrics(values) without loader= needs"), g
        assert g["nested"].startswith("DataError: gather_for_metrics(values) without loader=: 2 EvalLoaders"), g
        assert "rank per process (in group order) is [0, 0]" in g["sampler_rank"], g
    # tracker construction fails on one rank: that rank raises its own error, the other a RuntimeError naming it
    e0, e1 = r0["tracker_errors"], r1["tracker_errors"]
    assert e0["bad_kwargs"].startswith("TypeError") and "bogus" in e0["bad_kwargs"], e0
    assert e1["bad_kwargs"].startswith("RuntimeError: init_trackers failed on 1 rank(s): rank 0: TypeError"), e1
    assert e1["missing_on_1"].startswith("ImportError") and "no-such-tracker-pkg" in e1["missing_on_1"], e1
    assert e0["missing_on_1"].startswith("RuntimeError: init_trackers failed on 1 rank(s): rank 1: ImportError"), e0

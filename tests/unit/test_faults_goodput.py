"""Fault-plan parsing, restart-cause wording and the goodput summary (no processes)."""
import pytest

from torchloom.elastic.faults import FaultInjector, FaultPlanError, Kill, parse_plan
from torchloom.elastic.launcher import describe_exit
from torchloom.train.goodput import lost_work, summarize


def test_parse_plan():
    assert parse_plan(None) == [] and parse_plan(" ; ") == []
    assert parse_plan("kill:rank=1,step=3,attempt=0; kill:step=7,rank=0") == [Kill(1, 3, 0), Kill(0, 7, 0)]
    for bad, words in (("boom:rank=1,step=2", "unknown fault"), ("kill:rank=1", "needs rank= and step="),
                       ("kill:rank=x,step=2", "not an integer"), ("kill:rank=1,step=2,when=3", "bad field")):
        with pytest.raises(FaultPlanError, match=words):
            parse_plan(bad)


def test_injector_matches_rank_and_attempt():
    inj = FaultInjector(1, plan="kill:rank=1,step=3,attempt=1;kill:rank=0,step=2", attempt=1)
    assert inj.kill_steps == {3}
    inj.after_step(2)  # not this rank's step: returns
    assert not FaultInjector(1, plan="kill:rank=1,step=3", attempt=1).active


def test_describe_exit():
    assert describe_exit(-9) == "killed by SIGKILL (signal 9)"
    assert describe_exit(3) == "exit code 3" and describe_exit(None) == "unknown exit status"


def test_lost_work_and_summary(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text('{"type": "train", "step": 4, "step_time_s": 1.0, "t": 100.0}\n'
                 '{"type": "train", "step": 5, "step_time_s": 1.5, "t": 101.5}\n{"type": "tr')  # torn last line
    assert lost_work(m, 4) == {"steps": 1, "time_s": 1.5, "last_t": 101.5}
    events = [
        {"event": "start", "attempt": 0, "t_process": 0.0, "train_time_s": 0.0},  # an earlier invocation
        {"event": "start", "attempt": 0, "t_process": 90.0, "train_time_s": 2.0},
        {"event": "first_step", "attempt": 0, "t": 95.0},
        {"event": "save", "attempt": 0, "stall_s": 0.5},
        {"event": "start", "attempt": 1, "t_process": 103.5, "last_t": 101.5, "lost_steps": 1, "lost_time_s": 1.5,
         "train_time_s": 6.0},
        {"event": "first_step", "attempt": 1, "t": 107.0},
    ]
    g = summarize(events, t_end=120.0, train_time_end=14.0)
    assert g["wall_time_s"] == 30.0 and g["productive_s"] == 12.0 and g["effective_training_time"] == 0.4
    assert g["restarts"] == 1 and g["recomputed_steps"] == 1 and g["recovery_s"] == [5.5]
    lost = g["lost_s"]
    assert lost["startup_s"] == 5.0 + 3.5 and lost["restart_gap_s"] == 2.0 and lost["recompute_s"] == 1.5
    assert lost["checkpoint_stall_s"] == 0.5 and lost["other_s"] == pytest.approx(30 - 12 - 8.5 - 2 - 1.5 - 0.5)

"""torchloom.notebook_launcher from a script whose functions live in ``__main__`` (as a notebook cell's do), and
auto_accelerate(strategy=None) reading a config file on 2 ranks. One subprocess runs every check
(_notebook_script.py); forked launches then cost well under a second each."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("_notebook_script.py")


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ, OMP_NUM_THREADS="2", TORCHLOOM_CONFIG_FILE="none")  # 2 threads: the fork hazard is live
    p = subprocess.run([sys.executable, str(SCRIPT)], env=env, text=True, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=240)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT ")), p.stdout


def test_runs_main_functions_and_returns_rank0(result):
    out, _ = result
    value, env, threads = out["rank0"]
    assert value == [7.0, 7.0]  # all_reduce of 1 + 2, then * 2.0 + offset 1: args and kwargs reached fn
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"].isdigit()
    assert threads == 1  # forked ranks: one OpenMP thread (more would deadlock after the parent used the pool)
    assert out["all"] == ["0", "1"]


def test_first_failure_with_rank_and_traceback(result):
    err = result[0]["error"]
    assert err["rank"] == 1 and err["failed"] == [0, 1]
    assert err["message"].startswith("notebook_launcher: the first failure: rank 1: ValueError: boom on rank 1")
    assert "_notebook_script.py" in err["traceback"] and "in fail_on_rank1" in err["traceback"]
    assert "rank 0:" in err["message"].split("the other failed ranks", 1)[1]


def test_timeout_stops_the_ranks(result):
    t = result[0]["timeout"]
    assert t["message"] == "notebook_launcher: rank(s) 0, 1 still running at the timeout of 2 s; stopped"
    assert t["seconds"] < 20


def test_refuses_what_fork_or_spawn_cannot_do(result):
    r = result[0]["refusals"]
    assert "defined in a notebook" in r["spawn"] and "start_method='fork'" in r["spawn"]
    assert "CUDA is initialised" in r["cuda"] and "Restart the kernel" in r["cuda"]
    assert "process group is initialised" in r["group"] and "destroy_process_group" in r["group"]


def test_config_file_strategy_agrees_across_ranks(result):
    p = result[0]["pickup"]
    for strategy, note in p["same"]:
        assert strategy == "Strategy[fsdp]" and note.startswith("strategy from ") and "good.yaml" in note
    for name, expected in (("one_rank_without", "rank 1: no strategy (no config file)"),
                           ("different", "rank 1: Strategy[ddp] from")):
        msgs = {tuple(x) for x in p[name]}
        assert len(msgs) == 1, msgs  # the same error on every rank, not a hang
        kind, msg = msgs.pop()
        assert kind == "ConfigFileError" and "rank 0: Strategy[fsdp] from" in msg and expected in msg, msg
    kinds = {x[0] for x in p["one_rank_invalid"]}
    assert kinds == {"ConfigFileError"} and all(x[1].startswith("rank 1: config file") and "fsdpp" in x[1]
                                                for x in p["one_rank_invalid"])


def test_auto_accelerate_strategy_none_uses_the_file(result):
    out, stdout = result
    from_file, explicit = out["from_file"], out["explicit"]
    for (strategy, notes, loss, params), (e_strategy, e_notes, e_loss, e_params) in zip(from_file, explicit):
        assert strategy == e_strategy == "Strategy[fsdp]"
        assert len(notes) == 1 and "good.yaml" in notes[0] and e_notes == []
        assert loss == e_loss and params == e_params  # bitwise: the same job as strategy=["fsdp"]
    logged = [ln for ln in stdout.splitlines() if ln.startswith("strategy from ")]
    assert len(logged) == 2  # once per launch that read the file ("same" and this one): rank 0 only

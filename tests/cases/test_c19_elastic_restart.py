"""C19 elastic restart [pytorch/pytorch 123678].

`loom run` (here through `loom train`, which is `loom run -m torchloom.train.job`) with 2 processes and a
restart budget of 2; rank 1 is SIGKILLed at step 3 of the first attempt. The workers restart, resume from
the last complete checkpoint (step 2) and finish with bitwise the same final parameters (and losses and
sample ids) as an uninterrupted run; the restart and its cause are logged and counted. The budget is
bounded: a rank killed on every attempt makes the job fail after 2 restarts with the worker's exit code.
"""
import json

import pytest

from tests.e2e._elastic_util import assert_same_training, train

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

STEPS = 6


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus_cache")


def test_c19_restart_resumes_to_the_same_parameters(tmp_path, cache):
    ref = tmp_path / "ref"
    proc = train(ref, cache, STEPS)
    assert proc.returncode == 0, proc.stdout[-4000:]

    out = tmp_path / "killed"
    proc = train(out, cache, STEPS, "--nproc", "2", "--max-restarts", "2", fault_plan="kill:rank=1,step=3,attempt=0")
    log = proc.stdout
    assert proc.returncode == 0, log[-6000:]
    assert "rank 1 SIGKILLs itself after step 3 (attempt 0)" in log
    assert "[loom] restart 1/2: worker group failed:" in log and "global rank 1" in log
    assert "killed by SIGKILL (signal 9)" in log
    assert "restart attempt 1" in log and "resumed from step 2" in log
    assert "[loom] restarts: 1 (worker-group failures: 1)" in log
    assert_same_training(ref, out, STEPS)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["goodput"]["restarts"] == 1


def test_c19_restart_budget_is_bounded(tmp_path, cache):
    out = tmp_path / "always_killed"
    plan = ";".join(f"kill:rank=1,step=1,attempt={a}" for a in range(4))
    proc = train(out, cache, STEPS, "--nproc", "2", "--max-restarts", "2", fault_plan=plan)
    log = proc.stdout
    # the first failed worker's code: 137 (128 + SIGKILL) or 1 (its peer, which saw the connection reset;
    # torchrun orders failures by whole-second timestamps)
    assert proc.returncode in (1, 137), log[-6000:]
    assert "restart budget (2) is spent" in log and "killed by SIGKILL (signal 9)" in log
    assert "restart 1/2" in log and "restart 2/2" in log and "restart 3/" not in log
    assert "restart budget (2) is spent" in log
    assert "[loom] restarts: 2 (worker-group failures: 3)" in log
    assert log.count("SIGKILLs itself") == 3
    assert not (out / "summary.json").exists()

"""`loom train --set strategy=auto` end to end on 2 gloo processes: the search's trials and ranked table in the
log, the chosen strategy printed and saved as a plan file in the output dir, and a resumed run that reuses it
(no new search) and continues from the checkpoint. ``TORCHLOOM_CACHE_DIR`` is a temporary directory, so the
machine's calibration and plan caches are neither read nor written."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
# a short smoke job: 6 steps, a checkpoint every 3, no periodic eval/sample (the search is what is tested)
ARGS = ["--set", "strategy=auto", "--set", "train.steps=6", "--set", "checkpoint.interval=3", "--set",
        "eval.interval=0", "--set", "sample.max_new_tokens=0", "--set", "search={time_limit_s: 120, top_k: 2}"]


def loom(out: Path, cache: Path, tl_cache: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHLOOM_CACHE_DIR=str(tl_cache))
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run([sys.executable, "-m", "torchloom.cli", "train", "smoke", "--output-dir", str(out),
                           "--set", f"data.cache_dir={cache}", *ARGS, *extra], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    out, tl = tmp_path_factory.mktemp("auto"), tmp_path_factory.mktemp("tl_cache")
    first = loom(out, cache, tl, "--max-steps-this-run", "4")
    second = loom(out, cache, tl) if first.returncode == 0 else None
    return out, first, second


def test_search_logged_chosen_and_saved(runs):
    out, first, _ = runs
    assert first.returncode == 0, first.stdout[-4000:]
    log = first.stdout
    assert "strategy: auto -> searching" in log, log[-3000:]
    assert "trial 1/2" in log and "trial 2/2" in log, log[-3000:]  # the trials' progress
    assert "meas ms" in log, log[-3000:]  # the final ranked table
    chosen = [ln for ln in log.splitlines() if "strategy: auto chose" in ln]
    assert len(chosen) == 1, log[-3000:]
    plan = json.loads((out / "strategy.json").read_text())
    assert plan["methods"] and plan["plan"]["world_size"] == 2 and plan["plan"]["global_batch"] == 8
    trials = plan["plan"]["search"]["trials"]
    measured = [t["candidate"] for t in trials if t["error"] is None and t["step_time_s"]]
    assert plan["plan"]["candidate"] in measured, (plan["plan"]["candidate"], trials)  # chosen by measurement
    assert all("zero1" not in [m[0] for m in t["candidate"]["methods"]] for t in trials)


def test_resume_reuses_the_plan(runs):
    out, first, second = runs
    assert first.returncode == 0 and second is not None
    assert second.returncode == 0, second.stdout[-4000:]
    log = second.stdout
    assert "no new search" in log and "trial 1/" not in log, log[-3000:]
    assert "resumed from step 4" in log, log[-3000:]  # --max-steps-this-run 4 saved step 4
    summary = json.loads((out / "summary.json").read_text())
    plan = json.loads((out / "strategy.json").read_text())
    assert summary["steps"] == 6 and summary["strategy"] == plan["methods"], (summary["strategy"], plan["methods"])


def test_checkpoints_without_plan_refused(runs, cache, tmp_path):
    out, first, second = runs
    assert second is not None and second.returncode == 0
    (out / "strategy.json").rename(tmp_path / "strategy.json")
    try:
        proc = loom(out, cache, tmp_path)
    finally:
        (tmp_path / "strategy.json").rename(out / "strategy.json")
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "no searched plan" in proc.stdout and "--set strategy=[...]" in proc.stdout, proc.stdout[-3000:]


def test_search_summary_logged_once(runs):
    _, first, _ = runs
    summary = [ln for ln in first.stdout.splitlines() if "predicted candidates fit" in ln]
    assert len(summary) == 1, summary


def test_plan_for_another_nproc_is_one_clean_error(runs, cache, tmp_path):
    out, first, second = runs
    assert second is not None and second.returncode == 0
    proc = loom(out, cache, tmp_path, "--nproc", "1")  # the plan and the checkpoints are for 2 ranks
    assert proc.returncode == 2, proc.stdout[-3000:]
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("[loom] error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert "the plan is for 2 ranks, this job has 1" in errors[0] and "same --nproc" in errors[0], errors[0]
    assert "docs/reshard.md" in errors[0] and "on_mismatch=research" in errors[0], errors[0]

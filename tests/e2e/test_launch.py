"""`loom run` end to end: arguments and environment reach the workers, exit codes propagate, and a gloo
FSDP job exits 0 every time (the reliable shutdown)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def loom_run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e.pop("OMP_NUM_THREADS", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "torchloom.cli", "run", *args], cwd=REPO, env=e, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)


# prefixes of torchrun's options (--d, --n, --sig, --shutdown, --max-r) and torchrun's own flags: all the script's
SCRIPT_ARGS = ["--lr", "1e-3", "-m", "x", "--d", "48", "--n", "3", "--sig", "y", "--shutdown", "--max-r", "2",
               "--nnodes", "5", "--standalone", "--", "-h"]


def test_args_and_env_reach_every_worker(tmp_path):
    p = loom_run("--nproc", "2", str(HERE / "_echo.py"), str(tmp_path), *SCRIPT_ARGS)
    assert p.returncode == 0, p.stdout
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    cores = len(os.sched_getaffinity(0))
    for r, s in enumerate(seen):
        assert s["argv"] == SCRIPT_ARGS
        assert s["env"]["RANK"] == str(r) and s["env"]["WORLD_SIZE"] == "2"
        assert s["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        assert s["env"]["OMP_NUM_THREADS"] == str(max(1, cores // 2))


def test_user_omp_threads_win(tmp_path):
    p = loom_run("--nproc", "2", str(HERE / "_echo.py"), str(tmp_path), env={"OMP_NUM_THREADS": "3"})
    assert p.returncode == 0, p.stdout
    assert json.loads((tmp_path / "rank1.json").read_text())["env"]["OMP_NUM_THREADS"] == "3"


def test_worker_exit_code_propagates(tmp_path):
    p = loom_run("--nproc", "2", str(HERE / "_echo.py"), str(tmp_path), "exit1=3")
    assert p.returncode == 3, p.stdout
    assert "exit code 3" in p.stdout


def test_module_target(tmp_path):
    p = loom_run("--nproc", "1", "-m", "tests.e2e._echo", str(tmp_path), "--d", "48", "exit0=4")
    assert p.returncode == 4, p.stdout
    assert json.loads((tmp_path / "rank0.json").read_text())["argv"] == ["--d", "48", "exit0=4"]


def test_fsdp_job_exits_0_every_time():
    """gloo processes that used FSDP can abort (SIGABRT) at interpreter exit after a correct run; workers
    that end through clean_exit must exit 0, run after run."""
    durations = []
    for i in range(5):
        t = time.perf_counter()
        p = loom_run("--nproc", "2", str(HERE / "_fsdp_job.py"))
        durations.append(time.perf_counter() - t)
        assert p.returncode == 0, f"run {i}: exit code {p.returncode}\n{p.stdout[-3000:]}"
        assert "fsdp probe: 8 steps" in p.stdout
    print("run times (s):", [round(d, 1) for d in durations])

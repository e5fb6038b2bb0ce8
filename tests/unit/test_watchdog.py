"""The hang watchdog: beats keep it quiet; a missing beat dumps the stuck frame and the last collective and
ends the process with exit code 124."""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from torchloom.elastic import watchdog
from torchloom.testing.dist import free_port

REPO = Path(__file__).resolve().parents[2]
HANG_JOB = REPO / "tests" / "e2e" / "_hang_job.py"


def _wait(event: threading.Event, limit_s: float = 30.0) -> bool:
    return event.wait(limit_s)  # bounded: a broken watchdog fails the test instead of hanging it


def test_beats_keep_it_quiet_then_a_missing_beat_fires(tmp_path):
    fired, texts = threading.Event(), []
    beating = threading.Event()

    def on_hang(text):
        texts.append(text)
        fired.set()

    wd = watchdog.Watchdog(1.0, 5.0, dump_dir=tmp_path, rank=3, on_hang=on_hang, poll_s=0.02).start()
    # beat from a helper until told to stop: while beats arrive, nothing fires
    stop = threading.Event()

    def beater():
        i = 0
        while not stop.is_set():
            i += 1
            wd.beat(i)
            beating.set()
            stop.wait(0.02)

    t = threading.Thread(target=beater)
    t.start()
    assert _wait(beating)
    assert not fired.wait(1.5), "fired although beats kept arriving"
    stop.set()
    t.join()
    assert _wait(fired), "no beat for > timeout, but the watchdog did not fire"
    wd.stop()
    assert wd.beats > 0 and wd.fired
    text = texts[0]
    assert "rank 3" in text and "no step completed" in text and f"last completed step {wd.last_step}" in text
    assert (tmp_path / "watchdog_rank3.txt").read_text().strip() == text.strip()
    assert "Thread MainThread" in text


def test_first_step_timeout_applies_before_the_first_beat(tmp_path):
    fired, texts = threading.Event(), []
    wd = watchdog.Watchdog(60.0, 0.2, on_hang=lambda s: (texts.append(s), fired.set()), poll_s=0.02).start()
    assert _wait(fired)
    wd.stop()
    assert "the first step did not complete" in texts[0]


def test_bad_timeouts_are_rejected():
    with pytest.raises(ValueError, match="timeout"):
        watchdog.Watchdog(0)
    with pytest.raises(ValueError, match="first_step_timeout_s"):
        watchdog.Watchdog(1.0, -1)


def test_hung_rank_exits_124_with_stuck_frame_and_last_collective(tmp_path):
    """Two real gloo processes: rank 1 blocks in ``stuck_in_step`` at step 3 while rank 0 waits in that
    step's all_reduce. Both watchdogs fire (rank 0 first: the hung rank has a longer timeout, so its exit
    cannot break rank 0's all_reduce first, a load-dependent race): exit code 124, and the dumps name the stuck frame (rank 1) and
    the all_reduce rank 0 is stuck in (its stack and the flight recorder's last collective)."""
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("TORCHELASTIC_RESTART_COUNT", None)
        procs.append(subprocess.Popen([sys.executable, str(HANG_JOB), str(tmp_path), "--hang-rank", "1",
                                       "--hang-step", "3", "--timeout", "2", "--hung-rank-timeout", "6"], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.returncode for p in procs]
    assert codes == [watchdog.EXIT_CODE] * 2, (codes, outs)
    d0 = (tmp_path / "attempt0" / "watchdog_rank0.txt").read_text()
    d1 = (tmp_path / "attempt0" / "watchdog_rank1.txt").read_text()
    # rank 1: the stuck frame, in the main thread's stack
    assert "in stuck_in_step" in d1 and "threading.Event().wait()" in d1
    assert "last completed step 2" in d1
    # rank 0: stuck in the step-3 all_reduce; the flight recorder's last collective is that all_reduce
    assert "dist.all_reduce(t)" in d0
    last0 = [ln for ln in d0.splitlines() if ln.startswith("[loom watchdog] last collective:")][0]
    assert "gloo:all_reduce" in last0 and "default_pg" in last0
    # sequence numbers: broadcast_object_list (2 collectives) + one all_reduce per step -> step 3 is seq 5
    assert "seq=5" in last0, last0
    assert "watchdog_rank0.txt" in outs[0]  # the dump also went to stderr
    assert not (tmp_path / "result.json").exists()

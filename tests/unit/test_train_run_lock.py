"""One `loom train` run per output dir (issue [11], fresh-user pass): a second launcher, or a new run while
orphaned workers of a killed launcher still train, is refused before anything is written, naming the pids; a
lock file of a dead process never blocks; the workers' restarts under their own launcher and the launchers of one
multi-node job are not refused; a worker of loom's launcher dies with it (PR_SET_PDEATHSIG).

The other holders are forked children (no interpreter start-up, no torch import: milliseconds)."""
import os
import select
import signal
import socket
import time

import pytest
from click.testing import CliRunner

from torchloom import cli
from torchloom.elastic import launcher
from torchloom.elastic.launcher import AGENT_PID_ENV, die_with_agent
from torchloom.train import run_lock
from torchloom.train.config import ConfigError
from torchloom.train.run_lock import OutputDirBusy, claim, hold_worker, holders, lock_paths

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")


class Child:
    """A forked process that runs ``fn()`` (keeping what it returns: the locks) until :meth:`stop`."""

    def __init__(self, fn):
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: only os/fcntl calls, then os._exit
            code = 0
            try:
                os.close(r1)
                os.close(w2)
                held = fn()  # noqa: F841 - held until the parent says stop
                os.write(w1, b"ok")
                os.read(r2, 1)
            except BaseException as e:  # noqa: BLE001
                os.write(w1, f"error: {e}".encode())
                code = 1
            finally:
                os._exit(code)
        os.close(w1)
        os.close(r2)
        self._stop_w = w2
        said = os.read(r1, 65536).decode()
        os.close(r1)
        if said != "ok":
            self.stop()
            raise AssertionError(f"child failed: {said}")

    def stop(self) -> None:
        if self.pid:
            try:
                os.write(self._stop_w, b"x")
            except BrokenPipeError:  # it has exited already
                pass
            os.close(self._stop_w)
            os.waitpid(self.pid, 0)
            self.pid = 0


def test_a_second_launcher_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    first = Child(lambda: claim(out))
    try:
        with pytest.raises(OutputDirBusy) as e:
            claim(out)
        msg = str(e.value)
        assert isinstance(e.value, ConfigError)  # `loom train` exits 2 on it
        assert f"output dir {out} is in use by another run: pid {first.pid} (launcher on host " \
               f"{socket.gethostname()}" in msg
        assert f"kill {first.pid}" in msg and "Wait for it to finish" in msg and "--output-dir" in msg
    finally:
        first.stop()
    claim(out).release()  # its holder is gone: the kernel released the lock, the stale record does not block


def test_orphaned_workers_keep_the_dir_in_use(tmp_path, monkeypatch):
    """A killed launcher's workers still training: the new launcher finds workers.lock held."""
    monkeypatch.setattr(run_lock, "DYING_S", 0.1)
    out = tmp_path / "run"
    orphans = [Child(lambda r=r: hold_worker(out, rank=r)) for r in (0, 1)]
    try:
        with pytest.raises(OutputDirBusy) as e:
            claim(out)
        msg = str(e.value)
        assert "in use by training processes whose launcher is gone" in msg
        assert all(f"pid {c.pid} (worker rank {r} on host" in msg for r, c in enumerate(orphans))
        assert f"kill {orphans[0].pid} {orphans[1].pid}" in msg and "re-run to resume" in msg
        orphans[0].stop()
        with pytest.raises(OutputDirBusy, match=f"pid {orphans[1].pid} ") as e:  # one left is enough
            claim(out)
        assert f"pid {orphans[0].pid} " not in str(e.value)  # a dead holder is not named
    finally:
        for c in orphans:
            c.stop()
    lock = claim(out)
    assert holders(lock.workers_path) == []  # the dead workers' records are dropped by the new claim
    lock.release()


def test_restarted_workers_under_their_launcher_are_not_refused(tmp_path):
    out = tmp_path / "run"
    lock = claim(out)  # this process: the launcher, holding it for the job's life
    try:
        for _attempt in range(2):  # the worker group and an elastic restart of it
            workers = [Child(lambda r=r: hold_worker(out, rank=r)) for r in (0, 1)]
            for c in workers:
                c.stop()
        with pytest.raises(OutputDirBusy):
            claim(out)  # another launcher still is
    finally:
        lock.release()


def test_a_stale_lock_file_never_blocks(tmp_path):
    out = tmp_path / "run"
    dead = Child(lambda: (claim(out), hold_worker(out, rank=0)))
    pid = dead.pid
    dead.stop()  # exited holding both: the files keep its records
    launcher_path, workers_path = lock_paths(out)
    assert f'"pid": {pid}' in launcher_path.read_text() and f'"pid": {pid}' in workers_path.read_text()
    assert holders(launcher_path) == [] == holders(workers_path)  # dead: not a holder
    workers_path.write_text("not json\n")
    claim(out).release()


def test_multinode_launchers_of_one_job_share_the_dir(tmp_path):
    out = tmp_path / "run"
    a = Child(lambda: claim(out, job="127.0.0.1:29400/job1"))
    try:
        b = claim(out, job="127.0.0.1:29400/job1")  # the job's second launcher on this machine
        with pytest.raises(OutputDirBusy, match="another multi-node job on this machine"):
            claim(out, job="127.0.0.1:29400/job2")
        with pytest.raises(OutputDirBusy, match=f"pid {a.pid} "):
            claim(out)  # a single-node run
        b.release()
    finally:
        a.stop()


def test_loom_train_refuses_a_dir_in_use_before_launching(tmp_path, monkeypatch):
    """The CLI: exit 2 and the message, no process launched, nothing written."""
    out = tmp_path / "run"
    launched = []
    monkeypatch.setattr(launcher, "run", lambda *a, **k: launched.append(a) or 0)
    monkeypatch.setattr(cli, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setenv(run_lock.CLAIMED_ENV, "")
    holder = Child(lambda: claim(out))
    try:
        before = sorted(p.name for p in out.rglob("*"))
        r = CliRunner().invoke(cli.main, ["train", "smoke", "--output-dir", str(out)])
        assert r.exit_code == 2 and not launched, r.output
        assert f"error: output dir {out} is in use by another run: pid {holder.pid} " in r.output
        assert sorted(p.name for p in out.rglob("*")) == before
        assert os.environ[run_lock.CLAIMED_ENV] == ""
    finally:
        holder.stop()
    r = CliRunner().invoke(cli.main, ["train", "smoke", "--output-dir", str(out)])
    assert r.exit_code == 0 and len(launched) == 1, r.output
    assert os.environ[run_lock.CLAIMED_ENV] == str(out.resolve())  # its workers only hold the workers' lock


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    from torchloom.testing.dist import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _job(out):
    from torchloom.train.job import Job

    job = Job.__new__(Job)
    job.rank, job.world, job.out = 0, 1, out
    return job


def test_a_run_without_launcher_takes_both_locks(tmp_path, monkeypatch, one_rank_group):
    """`loom train --no-launch` / `python -m torchloom.train.job`: the job claims the dir itself."""
    monkeypatch.delenv(run_lock.CLAIMED_ENV, raising=False)
    out = tmp_path / "run"
    locks = _job(out).lock_output_dir()
    try:
        with pytest.raises(OutputDirBusy, match=f"pid {os.getpid()} \\(run on host"):
            claim(out)
    finally:
        for lock in locks:
            lock.release()
    other = Child(lambda: claim(out))
    try:
        with pytest.raises(OutputDirBusy, match=f"pid {other.pid} "):
            _job(out).lock_output_dir()
    finally:
        other.stop()


def test_workers_of_loom_train_hold_only_the_workers_lock(tmp_path, monkeypatch, one_rank_group):
    """Under `loom train`'s launcher (it claimed the dir and is the parent), a worker, also a restarted one, is
    not refused by its own launcher's claim."""
    out = (tmp_path / "run").resolve()
    own_launcher = claim(out)
    monkeypatch.setenv(run_lock.CLAIMED_ENV, str(out))
    monkeypatch.setenv(AGENT_PID_ENV, str(os.getppid()))
    try:
        locks = _job(out).lock_output_dir()
        assert [h["role"] for h in holders(lock_paths(out)[1])] == ["worker"]
        for lock in locks:
            lock.release()
    finally:
        own_launcher.release()


# ------------------------------------------------------------------------------------- die with the agent
def _read_until_eof(fd: int, seconds: float) -> tuple[str, bool]:
    """What the other ends write to ``fd`` until all are closed (their processes died); ``(text, eof)``."""
    data, end = b"", time.monotonic() + seconds
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            return data.decode(), True
        data += chunk
    return data.decode(), False


def _agent_with_worker(worker_body) -> tuple[int, int]:
    """Fork an "agent" that forks one worker running ``worker_body(agent_pid, w)`` (``w``: the pipe end the test
    reads; the worker holds it until it dies), waits until the worker reports, then exits. Returns (read end,
    agent pid); the agent is reaped here."""
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    agent = os.fork()
    if agent == 0:
        try:
            worker = os.fork()
            if worker == 0:
                try:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a fresh worker interpreter
                    os.close(ready_r)
                    worker_body(os.getppid(), w, ready_w)
                finally:
                    os._exit(0)
            os.close(ready_w)
            os.read(ready_r, 1)  # the worker is set up
        finally:
            os._exit(0)  # the agent dies (as if SIGKILLed: no clean-up of its workers)
    os.close(w)
    os.close(ready_w)
    os.close(ready_r)
    os.waitpid(agent, 0)
    return r, agent


def test_a_worker_dies_with_its_agent():
    def body(agent, w, ready_w):
        os.environ[AGENT_PID_ENV] = str(agent)
        os.write(w, f"{os.getpid()} {die_with_agent()}\n".encode())
        os.write(ready_w, b"x")
        time.sleep(30)  # without the death signal it would train on alone
        os.write(w, b"outlived its agent\n")

    r, _agent = _agent_with_worker(body)
    text, eof = _read_until_eof(r, 10)
    os.close(r)
    pid = int(text.split()[0])
    if not eof:
        os.kill(pid, signal.SIGKILL)
    assert text.split()[1] == "True" and eof and "outlived" not in text, text


def test_a_worker_whose_agent_died_before_it_started_exits():
    def body(agent, w, ready_w):
        os.environ[AGENT_PID_ENV] = str(agent)
        os.write(ready_w, b"x")  # the agent exits now
        end = time.monotonic() + 10
        while os.getppid() == agent and time.monotonic() < end:
            time.sleep(0.01)
        os.write(w, b"re-parented\n")
        die_with_agent()  # must not return
        os.write(w, b"kept running\n")

    r, _agent = _agent_with_worker(body)
    text, eof = _read_until_eof(r, 15)
    os.close(r)
    assert eof and text == "re-parented\n", text


def test_die_with_agent_leaves_other_processes_alone(monkeypatch):
    monkeypatch.delenv(AGENT_PID_ENV, raising=False)
    assert die_with_agent() is False
    monkeypatch.setenv(AGENT_PID_ENV, "1")  # alive, but not this process's parent: a process further down
    if os.getppid() != 1:
        assert die_with_agent() is False

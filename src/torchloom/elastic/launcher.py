"""`loom run`: start N worker processes per node through ``torch.distributed.run`` (torchrun).

The launcher builds a torchrun argument list from :class:`LaunchOptions` (:func:`build_run_args`) and runs
torchrun's elastic agent in this process (:func:`launch`), returning the job's exit code: 0 when every
worker exited 0, else the first failed worker's code (128 + N for a worker killed by signal N).

Defaults: one node with a standalone c10d rendezvous on a free local port; ``OMP_NUM_THREADS`` = usable
cores / processes per node when unset (torchrun would use 1); ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so
workers keep their own TCP store rather than the agent's (elastic restarts re-create it);
``TORCHLOOM_AGENT_PID`` = this process's pid, so a worker can ask to die with it (:func:`die_with_agent`).
Workers should end through :func:`torchloom.elastic.shutdown.clean_exit`, which makes a correct gloo run
exit 0 reliably.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
AGENT_PID_ENV = "TORCHLOOM_AGENT_PID"  # the launcher (torchrun's agent) of this worker; set by run()
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass
class LaunchOptions:
    """What ``loom run`` passes to torchrun (None = torchrun's default).

    nproc: processes per node (int, or ``auto``/``cpu``/``gpu``/``xpu`` as torchrun accepts).
    nnodes: ``N`` or ``MIN:MAX`` (elastic).
    rdzv_backend / rdzv_endpoint / rdzv_id / rdzv_conf: rendezvous (``c10d`` is used when an endpoint is
        given without a backend). Without any of them, and without ``master_addr``/``master_port``, a
        one-node job uses torchrun's ``--standalone`` rendezvous.
    node_rank, master_addr, master_port: the static rendezvous (torchrun's ``--rdzv-backend static``).
    max_restarts: worker-group restarts on failure. monitor_interval: seconds between health checks.
    log_dir / redirects / tee / local_ranks_filter: torchrun's worker log handling.
    extra: further torchrun arguments, verbatim (before the script).
    """

    nproc: int | str = 1
    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    max_restarts: int | None = None
    monitor_interval: float | None = None
    master_addr: str | None = None
    master_port: int | None = None
    log_dir: str | None = None
    redirects: str | None = None
    tee: str | None = None
    local_ranks_filter: str | None = None
    extra: list[str] = field(default_factory=list)

    def single_node(self) -> bool:
        parts = str(self.nnodes).split(":")
        return all(p.strip() == "1" for p in parts)

    def standalone(self) -> bool:
        return (self.single_node() and self.rdzv_backend is None and self.rdzv_endpoint is None
                and self.master_addr is None and self.master_port is None)


def _check_nproc(nproc: int | str) -> str:
    s = str(nproc).strip()
    if s in NPROC_WORDS:
        return s
    try:
        n = int(s)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--nproc must be a positive integer or one of {', '.join(NPROC_WORDS)}; got {nproc!r}")
    return str(n)


def build_run_args(opts: LaunchOptions, target: str, args: list[str] | tuple[str, ...] = (), *,
                   module: bool = False) -> list[str]:
    """The ``torch.distributed.run`` argument list that starts ``target`` (a script path, or a module name
    with ``module=True``) with ``args`` under ``opts`` (what ``torchrun`` would be given on a command line;
    :func:`run` does not pass ``args`` through torchrun's parser, see :func:`parse_run_args`)."""
    return _launcher_args(opts, target, module) + list(args)


def _launcher_args(opts: LaunchOptions, target: str, module: bool) -> list[str]:
    """torchrun's own options, then ``-m`` and ``target``: everything up to the script, none of its args."""
    if not target:
        raise ValueError("nothing to run: give a script path or -m MODULE.")
    out = ["--nproc-per-node", _check_nproc(opts.nproc), "--nnodes", str(opts.nnodes)]
    if opts.standalone():
        out.append("--standalone")
    else:
        backend = opts.rdzv_backend
        if backend is None and opts.rdzv_endpoint is not None:
            backend = "c10d"
        if backend is not None:
            out += ["--rdzv-backend", backend]
        for flag, value in (("--rdzv-endpoint", opts.rdzv_endpoint), ("--rdzv-id", opts.rdzv_id),
                            ("--master-addr", opts.master_addr), ("--master-port", opts.master_port)):
            if value is not None:
                out += [flag, str(value)]
    for flag, value in (("--rdzv-conf", opts.rdzv_conf), ("--node-rank", opts.node_rank),
                        ("--max-restarts", opts.max_restarts), ("--monitor-interval", opts.monitor_interval),
                        ("--log-dir", opts.log_dir), ("--redirects", opts.redirects), ("--tee", opts.tee),
                        ("--local-ranks-filter", opts.local_ranks_filter)):
        if value is not None:
            out += [flag, str(value)]
    out += list(opts.extra)
    if module:
        out.append("-m")
    out.append(target)
    return out


def parse_run_args(opts: LaunchOptions, target: str, args: list[str] | tuple[str, ...] = (), *,
                   module: bool = False):
    """torchrun's parsed arguments (an ``argparse.Namespace`` for ``torch.distributed.run.run``) for
    ``target`` with ``args``.

    Only the launcher's part (up to and including ``target``) goes through torchrun's parser; ``args``
    become ``training_script_args`` verbatim. Parsing the whole list would let argparse read the script's
    options as its own: it expands unambiguous prefixes of torchrun's options and exits on ambiguous ones
    (``--d``, ``--n``, ``--sig``, ``--shutdown``), so ``train.py --d 48`` never reached the script.

    Raises:
        ValueError: a bad ``opts.nproc`` or no ``target``.
        SystemExit: torchrun's parser rejected the launcher's part (e.g. a bad ``opts.extra``).
    """
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    parser.allow_abbrev = False  # the launcher's part is built from full option names; never guess
    ns = parser.parse_args(_launcher_args(opts, target, module))
    ns.training_script_args = list(args)
    return ns


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def worker_env(opts: LaunchOptions, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables the launcher sets (only those not already set)."""
    environ = os.environ if environ is None else environ
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if "OMP_NUM_THREADS" not in environ:
        try:
            n = int(opts.nproc)
        except (TypeError, ValueError):
            n = 1  # auto/gpu: torchrun decides; one thread per process on CPU is never oversubscribed
        env["OMP_NUM_THREADS"] = str(max(1, usable_cores() // max(n, 1)))
    return {k: v for k, v in env.items() if k not in environ}


def failure_exit_code(exitcode: int | None) -> int:
    """A shell-style exit code for a worker's exit status (negative = killed by that signal)."""
    if exitcode is None:
        return 1
    if exitcode < 0:
        return 128 + (-exitcode)
    return exitcode if exitcode > 0 else 1


def describe_exit(exitcode: int | None) -> str:
    """``exit code 3`` / ``killed by SIGKILL (signal 9)`` for a worker's exit status."""
    import signal as _signal

    if exitcode is None:
        return "unknown exit status"
    if exitcode < 0:
        try:
            name = _signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name} (signal {-exitcode})"
    return f"exit code {exitcode}"


class RestartLog:
    """Logs each failed worker group (which ranks, exit code or signal) and counts the restarts.

    Installed around torchrun's elastic agent by :func:`launch` (it wraps the agent's
    ``_monitor_workers``); lines start with ``[loom] restart``/``[loom] failure``.
    """

    def __init__(self) -> None:
        self.failures = 0  # failed worker groups seen by this agent
        self.restarts = 0  # of which were restarted

    def observe(self, agent, result) -> None:
        from torch.distributed.elastic.agent.server.api import WorkerState

        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return
        self.failures += 1
        causes = "; ".join(f"global rank {r} (pid {f.pid}) {describe_exit(f.exitcode)}"
                           for r, f in sorted(result.failures.items())) or result.state.name.lower()
        spec = agent._worker_group.spec
        left = agent._remaining_restarts
        if left > 0:
            self.restarts += 1
            print(f"[loom] restart {spec.max_restarts - left + 1}/{spec.max_restarts}: worker group failed: "
                  f"{causes}", file=sys.stderr, flush=True)
        else:
            print(f"[loom] failure: worker group failed and the restart budget ({spec.max_restarts}) is "
                  f"spent: {causes}", file=sys.stderr, flush=True)

    def install(self):
        """Patch the agent class; returns a function that undoes it."""
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        original = LocalElasticAgent._monitor_workers
        log = self

        def _monitor_workers(agent, worker_group):
            result = original(agent, worker_group)
            try:
                log.observe(agent, result)
            except Exception as e:  # noqa: BLE001 - logging must never break the agent
                print(f"[loom] warning: could not log a worker failure: {e}", file=sys.stderr, flush=True)
            return result

        LocalElasticAgent._monitor_workers = _monitor_workers

        def undo() -> None:
            LocalElasticAgent._monitor_workers = original

        return undo


def launch(run_args) -> int:
    """Run ``torch.distributed.run`` in this process; return the job's exit code.

    ``run_args``: the namespace of :func:`parse_run_args` (script arguments never parsed), or a torchrun
    argument list (parsed whole by torchrun's parser, as the ``torchrun`` command does).

    Every failed worker group is logged with its cause (rank, exit code or signal); a job that restarted
    ends with ``[loom] restarts: N`` (N = worker-group restarts done by this node's agent)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    restarts = RestartLog()
    undo = restarts.install()
    try:
        return _launch(torchrun, run_args, SignalException, ChildFailedError)
    finally:
        undo()
        if restarts.failures:
            print(f"[loom] restarts: {restarts.restarts} (worker-group failures: {restarts.failures})",
                  file=sys.stderr, flush=True)


def _launch(torchrun, run_args, SignalException, ChildFailedError) -> int:  # noqa: N803
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        if isinstance(run_args, (list, tuple)):
            torchrun.main(list(run_args))
        else:  # what torchrun.main does after parsing: run under the elastic error recorder
            record(torchrun.run)(run_args)
        return 0
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure_exit_code(failure.exitcode)
        print(f"[loom] worker (global rank {rank}) failed with exit code {failure.exitcode}; "
              f"job exit code {code}", file=sys.stderr, flush=True)
        return code
    except SignalException as e:
        print(f"[loom] launcher received signal {e.sigval}; workers stopped", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except SystemExit as e:  # torchrun's argument parser
        return e.code if isinstance(e.code, int) else 2
    except KeyboardInterrupt:
        return 130


def run(opts: LaunchOptions, target: str, args: list[str] | tuple[str, ...] = (), *, module: bool = False) -> int:
    """Set the worker environment and launch ``target``; returns the job's exit code. ``args`` reach the
    script verbatim (:func:`parse_run_args`).

    Raises:
        ValueError: a bad ``opts.nproc`` or no ``target``.
    """
    try:
        run_args = parse_run_args(opts, target, args, module=module)
    except SystemExit as e:  # torchrun's parser printed why
        return e.code if isinstance(e.code, int) else 2
    os.environ.update(worker_env(opts))
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the agent runs in this process: the workers' parent
    if not opts.single_node():
        # torchrun's rendezvous waits silently for the other nodes: say what it waits for
        where = opts.rdzv_endpoint or (f"{opts.master_addr}:{opts.master_port}" if opts.master_addr else "this host")
        print(f"[loom] waiting for nodes: --nnodes {opts.nnodes}, rendezvous at {where} (id "
              f"{opts.rdzv_id or 'none'}); start the other nodes with the same --nnodes, --rdzv-endpoint and "
              "--rdzv-id, or use --nnodes 1 for one machine", file=sys.stderr, flush=True)
    return launch(run_args)


def die_with_agent(sig: int | None = None) -> bool:
    """In a worker started by :func:`run` (``TORCHLOOM_AGENT_PID`` names its agent, which must be this process's
    parent): on Linux, have the kernel send ``sig`` (default SIGTERM) to this process when the agent dies, so a
    SIGKILLed launcher leaves no worker training on its own (torchrun starts each worker in a session of its
    own, ``start_new_session=True``: a kill of the launcher's process group does not reach it). Call it first
    thing in the worker. Processes this one starts do not inherit it (the setting is cleared on fork).

    PR_SET_PDEATHSIG fires when the parent *thread* that forked this process exits. Verified in torch 2.13's
    elastic code: ``torch.distributed.run.run`` -> ``elastic_launch.__call__`` -> ``launch_agent`` ->
    ``LocalElasticAgent.run`` -> ``_invoke_run`` -> ``_initialize_workers``/``_restart_workers`` ->
    ``_start_workers`` -> ``start_processes`` -> ``SubprocessContext._start`` -> ``SubprocessHandler._popen``
    (``subprocess.Popen``) all run synchronously in the caller's thread (no thread or executor on the way;
    ``PContext.start`` even warns when it is not the main thread), and :func:`launch` calls it from the thread
    ``loom`` runs in, the main one, which lives until the launcher exits.

    The agent may have died before the setting took effect (this process was then re-parented): then this
    process ends at once with ``128 + sig``, as the signal would have ended it. Returns True when set; False
    when not started by loom's agent (no ``TORCHLOOM_AGENT_PID``, or the process it names is alive but not this
    one's parent: a process further down that inherited the variable), or not on Linux.
    """
    import signal as _signal

    want = os.environ.get(AGENT_PID_ENV, "")
    if not want.isdigit() or not sys.platform.startswith("linux"):
        return False
    agent, sig = int(want), int(_signal.SIGTERM if sig is None else sig)
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        print(f"[loom] warning: prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}): this worker keeps "
              "running if its launcher is killed", file=sys.stderr, flush=True)
        return False
    if os.getppid() == agent:  # checked after setting it: a death from now on is signalled
        return True
    from torchloom.utils import process_running

    if not process_running(agent):  # the agent died before prctl: nobody will signal this orphan
        print(f"[loom] the launcher (pid {agent}) of this worker is gone; exiting", file=sys.stderr, flush=True)
        os._exit(128 + sig)
    libc.prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)  # not the agent's child: leave this process as it was
    return False

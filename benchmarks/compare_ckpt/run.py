"""Checkpoint stall benchmark: torchloom flash vs DCP async (thread, process) vs sync DCP vs DLRover.

    python benchmarks/compare_ckpt/run.py [--gb 1.0] [--rounds 5] [--smoke] [--out benchmarks/results]
    python -m benchmarks compare-ckpt [same options]     (through the benchmarks dispatcher)

On 2 gloo ranks (DDP, every rank holds the full ~``--gb`` GB of fp32 params + AdamW moments) it measures,
side by side in one run: the seconds each ``save()`` blocks the training loop (max over ranks), the step
time of the training steps while the checkpoint is written in the background, the seconds until the
checkpoint is durable, and, per contender, the time to restore after a SIGKILL of the job (restart +
load of the newest complete checkpoint). Writes ``compare_ckpt.{json,md,png}`` under ``--out``.
``--smoke``: ~20 MB state, 1 round, torchloom flash and sync DCP (unless ``--contenders``), restore of
the first only, to a temporary directory unless ``--out`` is given (< 60 s on a quiet machine).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.compare_ckpt import launch, report  # noqa: E402
from benchmarks.compare_ckpt.contenders import NAMES  # noqa: E402


def _common(a) -> list[str]:
    return ["--gb", str(a.gb), "--width", str(a.width)] + (["--dlrover-early-saver"] if a.dlrover_early_saver else [])


def run_stall(a, work: Path, logs: Path) -> dict:
    out = work / "stall.json"
    if a.reuse_work and out.exists():
        res = json.loads(out.read_text())
        if not res.get("partial"):
            res.setdefault("exit_codes", None)
            res.setdefault("wall_s", 0.0)
            res["reused_from"] = str(out)
            return res
    args = ["--phase", "stall", "--contenders", ",".join(a.contenders), *_common(a),
            "--rounds", str(a.rounds), "--post-steps", str(a.post_steps), "--root", str(work / "stall"),
            "--out", str(out)]
    t = time.time()
    codes = launch.wait(launch.start(args, a.nproc, logs, "stall", a.threads), a.timeout)
    res = json.loads(out.read_text()) if out.exists() else {"saves": [], "errors": {}}
    res["exit_codes"], res["wall_s"] = codes, time.time() - t
    if codes != [0] * a.nproc:
        res["launch_error"] = f"exit codes {codes}\n" + launch.tail(logs, "stall", a.nproc)
    return res


def run_restore(a, name: str, rnd: int, work: Path, logs: Path, attempts: int = 2) -> dict:
    """Victim run (killed right after its save of step 2 returned), then a restart that loads. A victim
    run that fails before its kill is retried up to ``attempts`` times in all; every failed attempt's
    error is kept in ``failed_attempts``."""
    failed = []
    for i in range(attempts):
        r = _restore_once(a, name, rnd, work, logs, i)
        if "victim_failed" not in r:
            r["failed_attempts"] = failed
            return r
        failed.append(r["error"])
    r["failed_attempts"] = failed[:-1]
    return r


def _restore_once(a, name: str, rnd: int, work: Path, logs: Path, attempt: int) -> dict:
    tag = f"{name.replace(' ', '_')}.r{rnd}.a{attempt}"
    root, vout, rout = work / f"restore_{tag}", work / f"victim_{tag}.json", work / f"restore_{tag}.json"
    if a.reuse_work and rout.exists() and vout.exists():
        res = {"contender": name, "round": rnd, "victim": json.loads(vout.read_text()), "reused_from": str(rout)}
        res.update(json.loads(rout.read_text()))
        logtxt = "".join((logs / f"restore.{tag}.rank{r}.log").read_text() for r in range(a.nproc))
        res["log_says_memory"] = "from memory" in logtxt or "from the CPU memory" in logtxt
        res["log_says_disk"] = "_load_from_storage] Load the state dict from" in logtxt
        return res
    base = ["--contenders", name, *_common(a), "--root", str(root)]
    launch.remove(launch.leftovers([]))               # a fresh machine: no DLRover memory of earlier runs
    procs = launch.start(["--phase", "victim", *base, "--out", str(vout)], a.nproc, logs, f"victim.{tag}",
                         a.threads, run_id=f"bench-job-{tag}")   # the restart below is the same job
    end = time.time() + a.timeout
    ready = [Path(f"{vout}.ready{r}") for r in range(a.nproc)]
    while not all(p.exists() for p in ready) and time.time() < end and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    ok = all(p.exists() for p in ready)
    t_kill = time.time()
    launch.kill(procs)
    if not ok:
        launch.remove(launch.leftovers([p.pid for p in procs]))
        return {"contender": name, "round": rnd, "victim_failed": True,
                "error": "victim run failed before its second save returned\n" +
                launch.tail(logs, f"victim.{tag}", a.nproc)}
    victim = json.loads(vout.read_text())
    left = launch.leftovers([p.pid for p in procs])   # what the kill left in /dev/shm (kept for the restart)
    time.sleep(a.restart_delay)
    codes = launch.wait(launch.start(["--phase", "restore", *base, "--out", str(rout)], a.nproc, logs,
                                     f"restore.{tag}", a.threads, run_id=f"bench-job-{tag}"), a.timeout)
    res = {"contender": name, "round": rnd, "killed_at": t_kill, "victim": victim,
           "exit_codes": codes, "left_after_kill": left}
    launch.remove(launch.leftovers([p.pid for p in procs]))
    if rout.exists():
        res.update(json.loads(rout.read_text()))
    if codes != [0] * a.nproc or not rout.exists():
        res["error"] = f"restore run failed: exit codes {codes}\n" + launch.tail(logs, f"restore.{tag}", a.nproc)
    logtxt = "".join((logs / f"restore.{tag}.rank{r}.log").read_text() for r in range(a.nproc))
    res["log_says_memory"] = "from memory" in logtxt or "from the CPU memory" in logtxt   # DLRover's words
    res["log_says_disk"] = "_load_from_storage] Load the state dict from" in logtxt
    shutil.rmtree(root, ignore_errors=True)
    return res


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="compare-ckpt", description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="state per rank, GB (1e9 bytes)")
    ap.add_argument("--width", type=int, default=4096, help="layer width (square Linear layers)")
    ap.add_argument("--rounds", type=int, default=5, help="recorded saves per contender (plus one first)")
    ap.add_argument("--restore-rounds", type=int, default=2, help="kill + restore runs per contender")
    ap.add_argument("--post-steps", type=int, default=2, help="training steps timed after each save")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--contenders", default=",".join(NAMES), help="comma-separated, from: " + ", ".join(NAMES))
    ap.add_argument("--restore-contenders", default=None,
                    help="comma-separated contenders for the kill+restore runs (default: all; --smoke: the first)")
    ap.add_argument("--dlrover-early-saver", action="store_true",
                    help="fork DLRover's saver before building the model (works around its hang, see worker.py)")
    ap.add_argument("--reuse-work", action="store_true",
                    help="reuse the finished stall phase and restore runs found in --work (an interrupted run)")
    ap.add_argument("--restart-delay", type=float, default=0.0, help="seconds between kill and restart")
    ap.add_argument("--timeout", type=float, default=900.0, help="per launch, seconds")
    ap.add_argument("--work", default=None, help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--out", default=None, help="where compare_ckpt.{json,md,png} go "
                    "(default: benchmarks/results; --smoke: a temporary directory)")
    ap.add_argument("--smoke", action="store_true", help="~20 MB state, 1 round, 1 restore round")
    a = ap.parse_args(argv)
    a.argv = list(argv if argv is not None else sys.argv[1:])
    if a.smoke:
        a.gb, a.width, a.rounds, a.restore_rounds, a.post_steps = 0.02, 512, 1, 1, 1
        if a.contenders == ",".join(NAMES):
            a.contenders = "torchloom flash,dcp sync"
        a.timeout = min(a.timeout, 120.0)
    a.contenders = [c.strip() for c in a.contenders.split(",") if c.strip()]
    rc = a.restore_contenders
    a.restore_contenders = ([c.strip() for c in rc.split(",") if c.strip()] if rc else
                            a.contenders[:1] if a.smoke else list(a.contenders))
    bad = [c for c in a.contenders + a.restore_contenders if c not in NAMES]
    if bad:
        ap.error(f"unknown contenders {bad}; choose from {list(NAMES)}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out = Path(a.out) if a.out else (Path(tempfile.mkdtemp(prefix="compare_ckpt_smoke_")) if a.smoke
                                     else Path(__file__).resolve().parents[1] / "results")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work or tempfile.mkdtemp(prefix="compare_ckpt_work_"))
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0, load0 = time.time(), os.getloadavg()
    stall = run_stall(a, work, logs)
    launch.remove(launch.leftovers([]))
    print(f"stall phase: {len(stall['saves'])} saves in {stall['wall_s']:.0f} s; errors: "
          f"{sorted(stall['errors'])}", flush=True)
    restores = []
    for rnd in range(a.restore_rounds):
        order = a.restore_contenders if rnd % 2 == 0 else a.restore_contenders[::-1]
        for name in order:
            r = run_restore(a, name, rnd, work, logs)
            print(f"restore {name} round {rnd}: " + ("ERROR" if "error" in r else "ok"), flush=True)
            restores.append(r)
    if "dlrover flash" in a.contenders and not a.smoke:
        from benchmarks.compare_ckpt.dlrover_probe import probe

        stall["dlrover_agent_probe"] = probe()
        print(f"dlrover-run probe: {'ok' if stall['dlrover_agent_probe']['ok'] else stall['dlrover_agent_probe']['error']}")
    result = report.assemble(a, stall, restores, time.time() - t0, work)
    result["machine"]["load_avg_at_start"] = load0
    paths = report.write(result, out)
    print(report.markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths))
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

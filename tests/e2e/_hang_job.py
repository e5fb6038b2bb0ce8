"""A tiny resumable 'training' job for the watchdog tests (run under `loom run`, or with RANK/WORLD_SIZE/
MASTER_* set by hand).

Every step all-reduces a value; rank 0 records progress in OUT/progress.json after every step (atomic
replace) and the job resumes from it after a restart. With --hang-rank R --hang-step S, rank R blocks
forever inside ``stuck_in_step`` at step S (on restart attempt --hang-attempt only, default 0) while the
other ranks enter the step's all-reduce: the watchdog must end every rank with exit code 124.

--hung-rank-timeout gives the hanging rank a longer watchdog timeout than the others (default: the same), so
that in a test without torchrun the ranks waiting in the collective fire first: if the hung rank fired
first, its exit would break their all-reduce (exit 1 instead of 124) — a race that depends on machine load.

Usage: _hang_job.py OUT [--steps N] [--hang-rank R] [--hang-step S] [--hang-attempt A] [--timeout T]
                        [--hung-rank-timeout T2]
"""
import argparse
import json
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from torchloom.elastic import watchdog
from torchloom.elastic.shutdown import clean_exit


def stuck_in_step():
    threading.Event().wait()  # an injected hang (never set)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=3)
    p.add_argument("--hang-attempt", type=int, default=0)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--hung-rank-timeout", type=float, default=None)
    a = p.parse_args()
    out = Path(a.out)
    watchdog.enable_flight_recorder()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    progress = out / "progress.json"
    state = [json.loads(progress.read_text()) if rank == 0 and progress.exists() else {"step": 0, "value": 0.0}]
    dist.broadcast_object_list(state, src=0)
    step, value = state[0]["step"], state[0]["value"]
    timeout = a.hung_rank_timeout if rank == a.hang_rank and a.hung_rank_timeout else a.timeout
    wd = watchdog.Watchdog(timeout, timeout * 4, dump_dir=out / f"attempt{attempt}").start()
    while step < a.steps:
        step += 1
        if rank == a.hang_rank and step == a.hang_step and attempt == a.hang_attempt:
            stuck_in_step()
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        value += float(t.item()) * step
        if rank == 0:
            tmp = out / "progress.json.tmp"
            tmp.write_text(json.dumps({"step": step, "value": value}))
            os.replace(tmp, progress)
        wd.beat(step)
    wd.stop()
    if rank == 0:
        (out / "result.json").write_text(json.dumps({"step": step, "value": value, "attempt": attempt,
                                                     "world": world}))
    clean_exit(0)


if __name__ == "__main__":
    main()

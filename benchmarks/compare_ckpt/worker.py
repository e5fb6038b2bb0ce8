"""One rank of a checkpoint benchmark run (started by ``run.py`` with RANK/WORLD_SIZE/MASTER_* set).

Phases (``--phase``):
  ``stall``   every contender saves ``--rounds`` + 1 times, interleaved (A B C, then C B A, ...); the
              first save of each is recorded apart (it starts savers / allocates buffers). Per save:
              the seconds ``save()`` blocked this rank, the step times of ``--post-steps`` training steps
              right after it (the background write competes with them), and the seconds from the call
              until the checkpoint was durable.
  ``victim``  one contender: save step 1, wait until durable, train, save step 2, then write
              ``<out>.ready`` and sleep until ``run.py`` SIGKILLs the process group (the save of step 2
              is still being written in the background for the async contenders).
  ``restore`` a fresh process: build the state, create the contender, ``load()`` the newest complete
              checkpoint; records the seconds from the restart (``BENCH_T_SPAWN``) and of ``load()``, the
              step restored and whether its fingerprint matches the one recorded before the kill.
Rank 0 writes ``--out`` (JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.compare_ckpt import contenders as C  # noqa: E402
from benchmarks.compare_ckpt.state import build, fingerprint, train_step  # noqa: E402


def slug(name: str) -> str:
    return name.replace(" ", "_")


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()[:2000]


def timed_step(st, step: int) -> float:
    t = time.perf_counter()
    train_step(st, step)
    return time.perf_counter() - t


def phase_stall(a, st, root: Path, dump) -> dict:
    names = a.contenders.split(",")
    live, errors = {}, {}
    for n in names:
        try:
            live[n] = C.make(n, root / slug(n), st)
            ok = None
        except Exception as e:  # noqa: BLE001 - every failure is reported with its error
            ok = err(e) + "\n" + traceback.format_exc()[-1500:]
        oks = gather(ok)
        if any(oks):
            errors[n] = {"phase": "construct", "errors": [o for o in oks if o]}
            live.pop(n, None)
            dump({"saves": [], "errors": errors, "partial": True})
    recs: list[dict] = []
    step = 1
    for _ in range(a.warmup_steps):
        timed_step(st, step)
        step += 1
    for r in range(a.rounds + 1):
        order = [n for n in names if n in live]
        order = order if r % 2 == 0 else order[::-1]
        for n in order:
            if n not in live:
                continue
            rec = {"contender": n, "round": r, "first": r == 0, "step": step}
            pre = [timed_step(st, step)]
            step += 1
            rec["step"] = step
            try:
                dist.barrier()
                t0 = time.perf_counter()
                live[n].save(step)
                rec["block_s"] = time.perf_counter() - t0
                rec["post_step_s"] = [timed_step(st, step + 1 + i) for i in range(a.post_steps)]
                live[n].wait()
                rec["persist_s"] = time.perf_counter() - t0
                rec["pre_step_s"] = pre
                e = None
            except Exception as ex:  # noqa: BLE001
                e = err(ex) + "\n" + traceback.format_exc()[-1500:]
            step += 1 + a.post_steps
            es = gather(e)
            allr = gather(rec)
            if any(es):
                errors[n] = {"phase": f"save round {r}", "errors": [x for x in es if x]}
                live.pop(n, None)
                dump({"saves": recs, "errors": errors, "partial": True})
                continue
            recs.append({"contender": n, "round": r, "first": r == 0, "step": rec["step"],
                         "block_s": [x["block_s"] for x in allr],
                         "persist_s": [x["persist_s"] for x in allr],
                         "pre_step_s": [x["pre_step_s"] for x in allr],
                         "post_step_s": [x["post_step_s"] for x in allr],
                         "disk_bytes": du_step(root / slug(n), rec["step"]) if dist.get_rank() == 0 else None,
                         "kept_bytes": du(root / slug(n)) if dist.get_rank() == 0 else None})
            dump({"saves": recs, "errors": errors, "partial": True})
            dist.barrier()
    for n, c in live.items():
        try:
            c.close()
        except Exception as ex:  # noqa: BLE001
            errors.setdefault(n, {"phase": "close", "errors": [err(ex)]})
    return {"saves": recs, "errors": errors}


def du(path: Path) -> int:
    """Bytes of all files under ``path`` (every step directory the contender kept)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def du_step(root: Path, step: int) -> int | None:
    """Bytes of the checkpoint of ``step`` alone (``step_XXXXXXXX/`` for torchloom and DCP, ``<step>/``
    for DLRover); ``None`` if no such directory."""
    for d in (root / f"step_{step:08d}", root / str(step)):
        if d.is_dir():
            return du(d)
    return None


def phase_victim(a, st, root: Path) -> dict:
    c = C.make(a.contenders, root, st)
    fps = {}
    train_step(st, 1)
    fps[1] = fingerprint(st)
    c.save(1)
    c.wait()
    train_step(st, 2)
    fps[2] = fingerprint(st)
    dist.barrier()
    t0 = time.perf_counter()
    c.save(2)
    blk = time.perf_counter() - t0
    res = {"fingerprints": fps, "block_s_step2": blk}
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(res))
    Path(f"{a.out}.ready{dist.get_rank()}").write_text(str(time.time()))
    time.sleep(3600)                      # run.py kills the process group here
    return res


def phase_restore(a, st, root: Path, t_spawn: float) -> dict:
    t_built = time.time()
    c = C.make(a.contenders, root, st)
    t_made = time.time()
    t = time.perf_counter()
    step, source = c.load()
    load_s = time.perf_counter() - t
    t_loaded = time.time()
    fp = fingerprint(st)
    per = gather({"load_s": load_s, "restart_to_loaded_s": t_loaded - t_spawn,
                  "build_s": t_built - t_spawn, "construct_s": t_made - t_built,
                  "step": step, "source": source, "fingerprint": fp})
    c.close()
    return {"ranks": per}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("stall", "victim", "restore"), required=True)
    ap.add_argument("--contenders", required=True, help="comma-separated names (victim/restore: one)")
    ap.add_argument("--gb", type=float, required=True)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--post-steps", type=int, default=2)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dlrover-early-saver", action="store_true",
                    help="start DLRover's saver process (its own start_saver_process) before the model is built")
    a = ap.parse_args()
    t_spawn = float(os.environ.get("BENCH_T_SPAWN", time.time()))
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("BENCH_PG_TIMEOUT", 300))))
    if a.dlrover_early_saver and "dlrover flash" in a.contenders.split(","):
        # What DLRover's CheckpointEngine does at construction (fork a saver from local rank 0), done
        # before the state exists: forked from the loaded, multi-threaded process it hung (saver
        # factory up, saver never created: "Timed out waiting for socket server") in runs here.
        from dlrover.trainer.torch.flash_checkpoint.engine import CheckpointEngine, start_saver_process

        CheckpointEngine.saver_proc = start_saver_process()
    st = build(a.gb, width=a.width)
    meta = {"world_size": dist.get_world_size(), "backend": dist.get_backend(),
            "wrapper": type(st.model).__module__ + "." + type(st.model).__name__,
            "torch_threads": torch.get_num_threads(), "n_params": st.n_params, "n_layers": st.n_layers,
            "width": st.width, "state_bytes_per_rank": st.state_bytes}
    root = Path(a.root)
    if a.phase == "stall":
        def dump(obj: dict) -> None:
            if dist.get_rank() == 0:
                Path(a.out).write_text(json.dumps(obj, indent=1))

        res = phase_stall(a, st, root, dump)
    elif a.phase == "victim":
        res = phase_victim(a, st, root)
    else:
        res = phase_restore(a, st, root, t_spawn)
    res["meta"] = gather(meta)
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

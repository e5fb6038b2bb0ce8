"""Launch N ranks of one contender (torchrun's environment, gloo, one fresh interpreter per rank) and interleave
contenders over rounds (A B C, then C B A, ...)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(contender: str, cfg: dict, world: int, timeout_s: float = 900.0) -> dict:
    """Run ``contender`` ("module:name") on ``world`` ranks forked by :mod:`benchmarks.compare.zygote`; returns
    ``{"ranks": [rank0, ...]}`` or ``{"error": first failing rank's error, "traceback": ..., "stderr_tail": ...}``.
    A rank still running 20 s after another failed, or all past ``timeout_s`` seconds, is killed."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="loom_compare_") as tmp:
        env = {**os.environ, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
               "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": str(cfg["threads"]), "DS_ACCELERATOR": "cpu",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
        cmd = [sys.executable, "-m", "benchmarks.compare.zygote", str(world), tmp,
               json.dumps({**cfg, "contender": contender})]
        zyg = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
        try:
            zout = zyg.communicate(timeout=timeout_s)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            os.killpg(zyg.pid, 9)
            zout = zyg.communicate()[0].decode(errors="replace") + f"\n[killed after {timeout_s:.0f} s]"
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        ranks, errors = [], []
        for r, out in enumerate(outs):
            logf = Path(tmp, f"rank{r}.log")
            tail = (logf.read_text(errors="replace") if logf.exists() else zout)[-3000:]
            if not os.path.exists(out):
                errors.append({"error": f"rank {r} ended without a result (killed: timeout or another rank "
                                        f"failed, or a crash; launcher exit {zyg.returncode})", "stderr_tail": tail})
                continue
            res = json.loads(Path(out).read_text())
            if res["status"] != "ok":
                errors.append({"error": f"rank {r}: {res['error']}", "traceback": res.get("traceback", ""),
                               "stderr_tail": tail})
            ranks.append(res)
        if errors:
            # the root cause: a rank's own exception beats "killed because another rank failed"
            errors.sort(key=lambda e: "without a result" in e["error"])
            return {**errors[0], "all_errors": [e["error"] for e in errors]}
        return {"ranks": ranks}


def interleave(contenders: list[str], rounds: int, cfg: dict, world: int, log=print) -> dict[str, list[dict]]:
    """Every contender ``rounds`` times, in order in even rounds and reversed in odd ones. Returns name -> list of
    launch results (one per round). A contender that failed is not launched again."""
    results: dict[str, list[dict]] = {c: [] for c in contenders}
    for rnd in range(rounds):
        order = contenders if rnd % 2 == 0 else contenders[::-1]
        for c in order:
            if results[c] and "error" in results[c][-1]:
                continue
            t0 = time.monotonic()
            res = launch(c, cfg, world)
            results[c].append(res)
            msg = res["error"].splitlines()[0][:200] if "error" in res else \
                f"median step {sorted(max(s) for s in zip(*[r['step_s'][cfg['warmup']:] for r in res['ranks']]))[cfg['steps'] // 2]:.3f} s"
            log(f"[w{world} round {rnd + 1}/{rounds}] {c}: {msg} ({time.monotonic() - t0:.0f} s)")
    return results

"""Start the ranks of one launch by ``os.fork`` from one interpreter that has imported torch and transformers
already (``python -m benchmarks.compare.zygote WORLD TMPDIR CFG_JSON``): the import of transformers takes 5–15 s
per process on a loaded 2-core machine, and every contender pays it equally otherwise. No tensor op runs before
the fork (so no thread pool is inherited); each child sets torchrun's environment (RANK, LOCAL_RANK, ...) and runs
:func:`benchmarks.compare.worker.main`, writing ``TMPDIR/rank{r}.json`` and its output to ``TMPDIR/rank{r}.log``.
A child still running 20 s after another failed is killed; the exit code is the first failure's or 0."""
from __future__ import annotations

import os
import sys
import time

import torch  # noqa: F401 - imported before the fork on purpose
import transformers.models.llama.modeling_llama  # noqa: F401


def main() -> None:
    world, tmp, cfg = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    pids = {}
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            os.environ.update({"RANK": str(r), "LOCAL_RANK": str(r)})
            fd = os.open(os.path.join(tmp, f"rank{r}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.argv = ["worker", cfg, os.path.join(tmp, f"rank{r}.json")]
            from benchmarks.compare import worker

            try:
                worker.main()
            finally:
                os._exit(3)
        pids[pid] = r
    codes, failed_at = {}, None
    while len(codes) < world:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pids[pid]] = os.waitstatus_to_exitcode(status)
            if codes[pids[pid]] != 0 and failed_at is None:
                failed_at = time.monotonic()
            continue
        if failed_at is not None and time.monotonic() - failed_at > 20:
            for p, r in pids.items():
                if r not in codes:
                    os.kill(p, 9)
        time.sleep(0.1)
    bad = [c for c in codes.values() if c != 0]
    sys.exit(bad[0] if bad else 0)


if __name__ == "__main__":
    main()

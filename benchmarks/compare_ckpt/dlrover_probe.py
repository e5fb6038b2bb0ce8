"""Whether DLRover's agent mode (``dlrover-run --standalone``, where the agent owns the checkpoint saver
so it outlives the training processes and a restart can load from memory) starts here. The benchmark
itself runs DLRover's checkpointer without the agent (saver = daemon child of local rank 0); this probe
records why, with the exact error."""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
print("DLROVER_PROBE_RANK_OK", dist.get_rank(), flush=True)
"""


def probe(timeout: float = 90.0) -> dict:
    """Runs a 2-process no-op job under ``python -m dlrover.trainer.torch.main --standalone`` (what the
    ``dlrover-run`` script calls); ``{"ok", "cmd", "error"}``."""
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "probe.py"
        script.write_text(SCRIPT)
        cmd = [sys.executable, "-m", "dlrover.trainer.torch.main", "--standalone", "--nproc_per_node", "2",
               str(script)]
        try:
            p = subprocess.run(cmd, cwd=d, capture_output=True, text=True, timeout=timeout)
            out, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = f"{e.stdout or ''}{e.stderr or ''}\nTimeoutExpired: no result in {timeout} s", None
    ok = rc == 0 and out.count("DLROVER_PROBE_RANK_OK") == 2
    from benchmarks.compare_ckpt.report import headline

    return {"ok": ok, "cmd": "dlrover-run --standalone --nproc_per_node 2 probe.py", "exit_code": rc,
            "error": None if ok else headline(out), "output_tail": out[-3000:]}

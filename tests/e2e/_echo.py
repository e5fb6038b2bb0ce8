"""Writes what a worker sees (argv, launcher env) to OUT_DIR/rank<R>.json and exits with a chosen code."""
import json
import os
import sys
from pathlib import Path

out, rank = Path(sys.argv[1]), os.environ["RANK"]
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "TORCHLOOM_CONFIG_FILE")
(out / f"rank{rank}.json").write_text(json.dumps({"argv": sys.argv[2:], "env": {k: os.environ.get(k) for k in keys}}))
codes = dict(a.split("=", 1) for a in sys.argv[2:] if a.startswith("exit"))
sys.exit(int(codes.get(f"exit{rank}", 0)))

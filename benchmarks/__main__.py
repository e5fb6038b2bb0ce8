"""``python -m benchmarks COMMAND [options]``: ``compare`` (training throughput and memory vs peers,
benchmarks/compare/), ``compare-ckpt`` (checkpoint stall vs peers, benchmarks/compare_ckpt/, when present), or
the name of a script in benchmarks/ (``strategies``, ``hybrid``, ``checkpoint_save``, ...) run with its options."""
from __future__ import annotations

import importlib
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _scripts() -> list[str]:
    return sorted(f[:-3] for f in os.listdir(HERE) if f.endswith(".py") and not f.startswith("_"))


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ + "\n\nscripts: " + ", ".join(_scripts()))
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "compare":
        from benchmarks.compare.cli import main as compare

        return compare(rest)
    if cmd == "compare-ckpt":
        try:
            mod = importlib.import_module("benchmarks.compare_ckpt")
            entry = getattr(mod, "main", None) or importlib.import_module("benchmarks.compare_ckpt.run").main
        except (ImportError, AttributeError) as e:
            print(f"compare-ckpt is not available: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        return entry(rest) or 0
    if cmd in _scripts():
        sys.argv = [os.path.join(HERE, cmd + ".py"), *rest]
        runpy.run_path(sys.argv[0], run_name="__main__")
        return 0
    print(f"unknown command {cmd!r}; commands: compare, compare-ckpt, " + ", ".join(_scripts()), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

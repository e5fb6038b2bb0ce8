"""``python -m benchmarks.compare_ckpt [options]``: same as ``benchmarks/compare_ckpt/run.py``."""
import sys

from benchmarks.compare_ckpt.run import main

sys.exit(main(sys.argv[1:]))

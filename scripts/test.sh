#!/usr/bin/env bash
# Set up (./.venv) and run the whole test suite: unit, distributed (gloo, 2 and 4 ranks), cases, end to end.
# Extra arguments go to pytest (e.g. -k fsdp, tests/unit).
# Two pytest-xdist workers, each taking whole test files (--dist loadfile: a module's expensive fixtures run
# once): on 2 cores about half the serial wall time is one core idle (single-process tests, start-up,
# waits in launches). TORCHLOOM_TEST_WORKERS=0 runs serially, N > 2 on a bigger machine.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
WORKERS=${TORCHLOOM_TEST_WORKERS:-2}
PAR=()
[ "$WORKERS" -gt 1 ] && PAR=(-n "$WORKERS" --dist loadfile)
exec .venv/bin/python -m pytest -q -p no:cacheprovider "${PAR[@]}" "${@:-tests}"

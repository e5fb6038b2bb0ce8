#!/usr/bin/env bash
# Set up (./.venv) and run the main job: a LLaMA-style model on Shakespeare, 2 CPU processes.
# Extra arguments go to `loom train` (e.g. a config file, --nproc 4, --output-dir runs/x).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/loom train "$@"

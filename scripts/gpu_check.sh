#!/usr/bin/env bash
# The one-GPU check of issue [12]: run ONCE on a machine with a CUDA GPU (H100/H200 class); ~5-6 minutes, at
# most ~8 (every step has a timeout). Usage:
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # default benchmarks/results/gpu_check
#
# Steps (each independent: a failed or timed-out step is reported and the next one runs):
#   1. calibrate      loom calibrate --nproc 1 --refresh --json on the GPU -> OUT/calibrate.json (+ .txt table);
#                     cached in OUT/hw_cache, which step 2 reads
#   2. predict        scripts/gpu_predict_check.py: a 125M Llama trained with auto_accelerate (bf16 eager,
#                     bf16 + compile, fp8, fp8 + compile) measured against the cost model's predictions with
#                     the calibration and with the accelerator table -> OUT/gpu_predict_check.json
#   3. cuda_smoke     loom run --nproc 1 scripts/cuda_smoke.py OUT/cuda_smoke -> OUT/cuda_smoke/cuda_smoke.json
# Logs: OUT/<step>.log; summary: OUT/summary.txt and OUT/summary.json (also printed at the end).
#
# Python: $PYTHON, else ./.venv/bin/python if its torch sees a GPU, else python3. torchloom is imported from
# the install when there is one, else from ./src (PYTHONPATH); only when neither imports is `pip install -e .`
# tried. Nothing is downloaded otherwise (models are built from configs; HF_HUB_OFFLINE=1).
# Timeouts (seconds) can be changed: GPU_CHECK_T_CALIBRATE (80), GPU_CHECK_T_PREDICT (255), GPU_CHECK_T_SMOKE (110).
# GPU_CHECK_CPU=1 dry-runs the same steps on the CPU (tiny model, CUDA_SMOKE_ALLOW_CPU=1): a check of this script.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${1:-benchmarks/results/gpu_check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
T_CAL=${GPU_CHECK_T_CALIBRATE:-80}
T_PRED=${GPU_CHECK_T_PREDICT:-255}
T_SMOKE=${GPU_CHECK_T_SMOKE:-110}
CPU=${GPU_CHECK_CPU:-0}
PRED_ARGS=()
CAL_BUDGET=10
if [ "$CPU" = 1 ]; then
  PRED_ARGS=(--device cpu --tiny)
  CAL_BUDGET=3
  export CUDA_SMOKE_ALLOW_CPU=1
fi
START=$(date +%s)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
: > "$OUT/summary.txt"
STEPS_JSON=""

say() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*"; }

# ------------------------------------------------------------------------------------------------ python
has_cuda_torch() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
has_torch() { "$1" -c 'import torch' >/dev/null 2>&1; }
PY=""
for c in "${PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
  if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && has_cuda_torch "$c"; then PY=$c; break; fi
done
if [ -z "$PY" ]; then  # no torch sees a GPU: go on with any torch, the steps say what fails
  for c in "${PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
    if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && has_torch "$c"; then PY=$c; break; fi
  done
  [ "$CPU" = 1 ] || say "WARNING: no Python here has a torch that sees a CUDA GPU${PY:+ (using $PY)}"
fi
if [ -z "$PY" ]; then
  say "FAIL: no Python with torch found (set PYTHON=/path/to/python, or run scripts/setup.sh)"; exit 1
fi
if ! "$PY" -c 'import torchloom' >/dev/null 2>&1; then
  export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
  if ! "$PY" -c 'import torchloom' >/dev/null 2>&1; then
    say "torchloom does not import from ./src either (missing dependencies?): pip install -e . (90 s at most)"
    timeout -k 5 90 "$PY" -m pip install -q -e "$ROOT" > "$OUT/pip_install.log" 2>&1 || say "pip install failed (see $OUT/pip_install.log)"
  fi
fi
ENV_LINE=$("$PY" - <<'EOF' 2>&1
import torch
try:
    import torchloom, transformers
    extra = f"torchloom from {torchloom.__file__.rsplit('/', 2)[0]}, transformers {transformers.__version__}"
except Exception as e:
    extra = f"IMPORT ERROR {type(e).__name__}: {e}"
try:
    import torchao
    ao = f"torchao {torchao.__version__}"
except Exception:
    ao = "no torchao (fp8 variants will be skipped)"
gpu = f"{torch.cuda.get_device_name()} (sm {'.'.join(map(str, torch.cuda.get_device_capability()))})" if torch.cuda.is_available() else "NO CUDA"
print(f"{gpu}; torch {torch.__version__}; {extra}; {ao}")
EOF
)
say "python $PY: $ENV_LINE" | tee -a "$OUT/summary.txt"
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 20 nvidia-smi > "$OUT/nvidia_smi.txt" 2>&1 || true
fi

# ------------------------------------------------------------------------------------------------ steps
# run_step NAME LIMIT_S STDOUT_FILE CMD...: stdout to STDOUT_FILE (the log when "-"), stderr to OUT/NAME.log
run_step() {
  local name=$1 limit=$2 stdout=$3; shift 3
  local log="$OUT/$name.log" t0 rc status
  [ "$stdout" = "-" ] && stdout=$log
  say "step $name (timeout ${limit}s): $*"
  t0=$(date +%s)
  if [ "$stdout" = "$log" ]; then
    timeout -k 10 "$limit" "$@" > "$log" 2>&1; rc=$?
  else
    timeout -k 10 "$limit" "$@" > "$stdout" 2> "$log"; rc=$?
  fi
  case $rc in
    0) status=PASS ;;
    124|137) status=TIMEOUT ;;
    *) status="FAIL(rc=$rc)" ;;
  esac
  local secs=$(( $(date +%s) - t0 ))
  say "step $name: $status in ${secs}s (log: $log)"
  printf '%-11s %-12s %4ss  %s\n' "$name" "$status" "$secs" "$log" >> "$OUT/summary.txt"
  STEPS_JSON="$STEPS_JSON${STEPS_JSON:+,}{\"step\": \"$name\", \"status\": \"$status\", \"rc\": $rc, \"seconds\": $secs}"
  return 0
}

# 1. calibration of this GPU (one rank), cached where step 2 finds it
run_step calibrate "$T_CAL" "$OUT/calibrate.json" \
  "$PY" -m torchloom.cli calibrate --nproc 1 --refresh --budget "$CAL_BUDGET" --cache-dir "$OUT/hw_cache" --json
"$PY" - "$OUT/calibrate.json" > "$OUT/calibrate.txt" 2>/dev/null <<'EOF' || true
import json, sys
from torchloom.cost.calibrate_cli import format_table
from torchloom.cost.hardware import Hardware
print("\n\n".join(format_table(Hardware.from_dict(d)) for d in json.load(open(sys.argv[1]))))
EOF

# 2. measured vs predicted: step time, tokens/s, memory
run_step predict "$T_PRED" - \
  "$PY" scripts/gpu_predict_check.py --out "$OUT" --cache-dir "$OUT/hw_cache" --budget-s $(( T_PRED - 30 )) ${PRED_ARGS[@]+"${PRED_ARGS[@]}"}

# 3. the CUDA-only paths of the library (NCCL group of one)
run_step cuda_smoke "$T_SMOKE" - \
  "$PY" -m torchloom.cli run --nproc 1 scripts/cuda_smoke.py "$OUT/cuda_smoke"

# ------------------------------------------------------------------------------------------------ summary
TOTAL=$(( $(date +%s) - START ))
{
  echo "total ${TOTAL}s"
  if [ -s "$OUT/calibrate.txt" ]; then echo; echo "== calibration"; head -8 "$OUT/calibrate.txt"; fi
  if [ -f "$OUT/predict.log" ]; then
    echo; echo "== measured vs predicted ($OUT/gpu_predict_check.json)"
    sed -n '/^variant /,$p' "$OUT/predict.log" | head -20
  fi
  if [ -f "$OUT/cuda_smoke.log" ]; then
    echo; echo "== cuda_smoke ($OUT/cuda_smoke/cuda_smoke.json)"
    grep -E '^(FAIL |[0-9]+ of [0-9]+ checks passed)' "$OUT/cuda_smoke.log" | cut -c1-300
  fi
} >> "$OUT/summary.txt"
echo "{\"total_s\": $TOTAL, \"env\": $("$PY" -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$ENV_LINE"), \"steps\": [$STEPS_JSON]}" > "$OUT/summary.json"
echo
echo "================ gpu_check summary ($OUT)"
cat "$OUT/summary.txt"

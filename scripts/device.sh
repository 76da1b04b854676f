#!/usr/bin/env bash
# CUDA checks and benchmarks on a GPU machine, in one go; logs and JSON land in $OUT.
#   bash scripts/device.sh [STAGES] [model]    STAGES: comma list of conformance, decode,
#   soak, prefill, memory, compile; "all" is every one of them
# The machine has torch and cuda-bindings but no network: install without dependencies.
set -uo pipefail
stage=${1:-all}
[ "$stage" = all ] && stage=conformance,decode,soak,prefill,memory,compile
has() { [[ ",$stage," == *",$1,"* ]]; }
model=${2:-qwen3-0.6b}
OUT=${OUT:-out/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log="$OUT/log.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e adapters/cuda >>"$log" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$log"
xgraph info 2>&1 | tee -a "$log"
rc=0
run() { local limit=$1; shift; timeout "$limit" "$@" || { echo "FAILED ($?): $*" | tee -a "$log"; rc=1; }; }
if has conformance; then
  run 300 xgraph conformance --backend cuda -- -q -rfEs -p no:randomly \
    -W ignore::DeprecationWarning 2>&1 | tee "$OUT/conformance.log" | tail -n 40
  run 300 python3 -m pytest -q -rfEs adapters/cuda/tests -W ignore::DeprecationWarning \
    2>&1 | tee -a "$OUT/conformance.log" | tail -n 25
fi
# cheapest first, so a timeout loses the least; each writes its own JSON
if has decode; then
  run 300 xgraph bench decode --backend cuda --model "$model" --json "$OUT/decode.json" \
    2>&1 | tee -a "$log" | tail -n 12
fi
if has soak; then
  run 300 xgraph bench soak --backend cuda --steps "${SOAK_STEPS:-20000}" \
    --json "$OUT/soak.json" 2>&1 | tee -a "$log" | tail -n 26
fi
if has prefill; then
  run 400 xgraph bench prefill --backend cuda --model "$model" --iters 5 \
    --json "$OUT/prefill.json" 2>&1 | tee -a "$log" | tail -n 30
fi
if has memory; then
  run 500 xgraph bench memory --backend cuda --model "$model" --json "$OUT/memory.json" \
    --plot "$OUT/memory.png" 2>&1 | tee -a "$log" | tail -n 16
fi
if has compile; then
  run 400 xgraph bench decode --backend cuda --model "$model" --sizes 8 --compile 8 \
    --json "$OUT/decode-compile.json" 2>&1 | tee -a "$log" | tail -n 6
fi
exit $rc

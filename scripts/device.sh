#!/usr/bin/env bash
# CUDA checks and benchmarks on a GPU machine in one go, each stage under its own time limit.
#   OUT=out/device bash scripts/device.sh [STAGES] [MODEL]
# STAGES: comma list of conformance, attention, decode, host, prefill, memory (default
# "all": every one, in that order; "soak" runs only when named). MODEL: the reference shape
# (default qwen3-0.6b). The limits below add up to 550 s, so with the install a whole run
# stays under ten minutes; a stage past its limit is killed and the next one starts.
# Measured on an H200 (fresh machine, cold compile caches): decode 93 s, host 25 s,
# prefill 62 s, memory 82 s; each limit is about 1.5x that.
# Output: $OUT/<stage>.json per benchmark (written as it goes, so a stage cut short keeps
# what it measured), $OUT/memory.png, and $OUT/log.txt holding every stage's whole output
# (seven files in all); the tail of each stage is printed as it ends.
# The machine has torch and cuda-bindings but no network: install without dependencies.
set -uo pipefail
stages=${1:-all}
[ "$stages" = all ] && stages=conformance,attention,decode,host,prefill,memory
has() { [[ ",$stages," == *",$1,"* ]]; }
model=${2:-qwen3-0.6b}
OUT=${OUT:-out/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log="$OUT/log.txt"
: >"$log"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e adapters/cuda >>"$log" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$log"
xgraph info 2>&1 | tee -a "$log"
rc=0
started=$SECONDS

# stage NAME LIMIT TAIL CMD...: run CMD under LIMIT seconds into $OUT/NAME.log (a file, not a
# pipe: compile workers that outlive a killed stage cannot hold the script up), then move
# that log into log.txt and print its last TAIL lines
stage() {
  local name=$1 limit=$2 lines=$3 t0=$SECONDS status
  shift 3
  echo "=== $name (limit ${limit} s): $*" | tee -a "$log"
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  status=$?
  tail -n "$lines" "$OUT/$name.log"
  cat "$OUT/$name.log" >>"$log" && rm -f "$OUT/$name.log"
  [ "$status" -eq 124 ] && echo "=== $name: TIMED OUT after ${limit} s" | tee -a "$log"
  echo "=== $name: exit $status after $((SECONDS - t0)) s" | tee -a "$log"
  [ "$status" -eq 0 ] || rc=1
}

conformance() {
  xgraph conformance --backend cuda -- -q -rfEs -p no:randomly -W ignore::DeprecationWarning
  local a=$?
  python3 -m pytest -q -rfEs -p no:randomly adapters/cuda/tests -W ignore::DeprecationWarning
  local b=$?
  return $((a || b))
}

# host is another engineer's subcommand: run it only where this checkout's CLI has it
host_if_present() {
  if xgraph bench host --help >/dev/null 2>&1; then
    xgraph bench host --backend cuda --model "$model" --json "$OUT/host.json"
  else
    echo "skipped: this checkout's xgraph has no 'bench host' subcommand"
  fi
}

export -f conformance host_if_present
export model OUT
has conformance && stage conformance 105 30 bash -c conformance
has attention && stage attention 55 30 python3 scripts/bench_attention.py --json "$OUT/attention.json"
has decode && stage decode 140 45 xgraph bench decode --backend cuda --model "$model" \
  --compile 1,8,64 --table-check 64 --iters 30 --json "$OUT/decode.json"
has host && stage host 40 20 bash -c host_if_present
has prefill && stage prefill 90 30 xgraph bench prefill --backend cuda --model "$model" \
  --iters 5 --compile 128,512,2048 --json "$OUT/prefill.json"
has memory && stage memory 120 45 xgraph bench memory --backend cuda --model "$model" \
  --models reference,hf-llama --json "$OUT/memory.json" --plot "$OUT/memory.png"
has soak && stage soak 300 26 xgraph bench soak --backend cuda --steps "${SOAK_STEPS:-20000}" \
  --json "$OUT/soak.json"
echo "=== all stages: $((SECONDS - started)) s, exit $rc" | tee -a "$log"
exit $rc

#!/usr/bin/env bash
# CUDA checks and benchmarks on a GPU machine in one go, each stage under its own time limit.
#   OUT=out/device bash scripts/device.sh [STAGES] [MODEL]
# STAGES: comma list of host, conformance, attention, decode, prefill, memory (default
# "all": every one, in that order; "host-copy", "skinny", "decode-cublas", "decode-forward",
# "pipeline", "check", "hf-tests", "hf-compile", "hf-generate", "soak", "sleep", "multistep",
# "startup", "dist", "kernels", "decode-limit", "preload" and "hf-fused" run only when named; "kernels":
# the decode kernels' sweep, "decode-limit": issue 35's run, both in one call: `bash scripts/device.sh
# kernels,decode-limit`; "dist": graphs across ranks, one process per GPU (DIST_NPROC, default
# every GPU; DIST_MODELS, default qwen3-0.6b,qwen3-8b; docs/distributed.md);
# DECODE_SCOPE=forward compiles the decode stage's whole forward instead of its layers).
# MODEL: the reference shape (default qwen3-0.6b). A stage
# past its limit is killed and the next one starts; the limits of "all" add up to 930 s,
# more than one ten-minute device call, so name the stages a call needs (docs/benchmarks.md,
# "Running on a GPU machine", lists every stage with its command and its time on an H200).
# Output: $OUT/<stage>.json per benchmark (written as it goes, so a stage cut short keeps
# what it measured), $OUT/memory.png, and $OUT/log.txt holding every stage's whole output;
# the tail of each stage is printed as it ends. BUDGET (seconds, default 570) bounds the whole
# script: a stage gets at most what is left of it, and one with under 20 s left is skipped,
# so one ten-minute device call always ends with its outputs written.
# The machine has torch and cuda-bindings but no network: install without dependencies.
set -uo pipefail
# NVLink multicast stays off in every process started here (the lent machines' rule)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stages=${1:-all}
[ "$stages" = all ] && stages=host,conformance,attention,decode,prefill,memory
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
budget=${BUDGET:-570}
stage() {
  local name=$1 limit=$2 lines=$3 t0=$SECONDS status left
  shift 3
  left=$((budget - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "=== $name: SKIPPED, ${left} s left of the ${budget} s budget" | tee -a "$log"
    rc=1
    return
  fi
  [ "$limit" -gt $((left - 5)) ] && limit=$((left - 5))
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

# dist: NCCL inside graphs through the executor (a world-size-1 group), then the multi-rank
# run under torchrun (tp_graphs.json: every rank's results)
dist() {
  python3 -m pytest -q -rfEs -p no:randomly tests/test_distributed_cuda.py \
    -W ignore::DeprecationWarning -W ignore::FutureWarning
  local a=$?
  torchrun --standalone --nproc-per-node "${DIST_NPROC:-$(nvidia-smi -L | wc -l)}" \
    adapters/cuda/tools/tp_graphs.py --backend cuda --models "${DIST_MODELS:-qwen3-0.6b,qwen3-8b}"
  local b=$?
  return $((a || b))
}

# check: a transformers Qwen3 of the reference shape with random weights, from a folder
check() {
  xgraph check --backend cuda --model "$model" --sizes 1,8,64 || return 1
  python3 -c "import sys, torch
from xgraph.integrations.transformers.bench_runs import build_named
build_named(sys.argv[1], torch.bfloat16, torch.device('cpu')).save_pretrained(sys.argv[2])" \
    "$model" /tmp/xgraph-check-model || return 1
  xgraph check --backend cuda --model /tmp/xgraph-check-model --sizes 1,8,64 --dtype bfloat16
}

export -f conformance dist check
export model OUT
# host first, on an idle machine: no compile workers of an earlier stage still running
has host && stage host 30 20 xgraph bench host --backend cuda --model "$model" \
  --json "$OUT/host.json"
# the reference model's forward instead of a trivial one (its graph is 849 kernels)
has host && stage host-model 45 12 xgraph bench host --backend cuda --model "$model" \
  --forward model --iters 500 --json "$OUT/host-model.json"
# host-copy (only when named): the core's torch copy instead of the adapter's driver copier
has host-copy && stage host-torch-copy 30 12 env XGRAPH_CUDA_STAGING=torch xgraph bench \
  host --backend cuda --model "$model" --json "$OUT/host-torch-copy.json"
has conformance && stage conformance 330 30 bash -c conformance
has attention && stage attention 45 30 python3 adapters/cuda/tools/bench_attention.py \
  --json "$OUT/attention.json"
has decode && stage decode 240 45 xgraph bench decode --backend cuda --model "$model" \
  --compile 1,8,64 --table-check 64 --iters 30 --compile-scope "${DECODE_SCOPE:-layers}" \
  --json "$OUT/decode.json"
# decode-cublas (only when named): batch 1 with cuBLAS for every projection (no skinny
# kernel), the same-run comparison for the skinny linear kernel
has decode-cublas && stage decode-cublas 150 20 env XGRAPH_CUDA_LINEAR=torch xgraph bench \
  decode --backend cuda --model "$model" --sizes 1 --compile 1 --iters 30 \
  --compile-scope "${DECODE_SCOPE:-layers}" --json "$OUT/decode-cublas.json"
# skinny (only when named): the skinny linear kernel against cuBLAS, projection by projection
has skinny && stage skinny 120 30 python3 adapters/cuda/tools/probe_skinny_linear.py \
  "$OUT/skinny.json"
# decode-forward (only when named): the compiled row with the whole forward as one graph
has decode-forward && stage decode-forward 180 30 xgraph bench decode --backend cuda \
  --model "$model" --sizes 1,8,64 --compile 1,8,64 --compile-scope forward --iters 30 \
  --json "$OUT/decode-forward.json"
# pipeline (only when named): decode steps issued back to back with no synchronize, host and
# device metadata; wall, device and issue time per step (docs/executor.md, staging banks)
has pipeline && stage pipeline 120 30 xgraph bench pipeline --backend cuda --model "$model" \
  --sizes 1,8,64 --iters 300 --json "$OUT/pipeline.json"
# check (only when named): the parameterization check of the reference model (with the PDL
# race check of its decode buckets, 200 replays each) and of a transformers Qwen3 (random
# weights, saved to a folder first) through GraphModel
has check && stage check 120 30 bash -c check
# hf-tests, hf-compile, hf-generate (only when named): the transformers integration's GPU
# tests, then its benchmark in two parts (docs/transformers.md)
has hf-tests && stage hf-tests 150 20 python3 -m pytest -q -rfEs -p no:randomly \
  tests/test_transformers_cuda.py -W ignore::DeprecationWarning -W ignore::FutureWarning
has hf-compile && stage hf-compile 340 40 python3 -m xgraph.integrations.transformers.bench \
  --backend cuda --model "$model" --parts compile --json "$OUT/hf-compile.json"
has hf-generate && stage hf-generate 240 40 python3 -m xgraph.integrations.transformers.bench \
  --backend cuda --model "$model" --parts check,decode,ttft --batches 1,32 --prompt-len 128 \
  --new-tokens 128 --iters 3 --json "$OUT/hf-generate.json"
has prefill && stage prefill 110 30 xgraph bench prefill --backend cuda --model "$model" \
  --iters 5 --compile 128,512,2048 --json "$OUT/prefill.json"
has memory && stage memory 130 45 xgraph bench memory --backend cuda --model "$model" \
  --models reference,hf-llama --json "$OUT/memory.json" --plot "$OUT/memory.png"
has soak && stage soak 300 26 xgraph bench soak --backend cuda --steps "${SOAK_STEPS:-20000}" \
  --json "$OUT/soak.json"
has sleep && stage sleep 290 20 xgraph bench sleep --backend cuda --model "$model" \
  --kv-cache-gib 16 --json "$OUT/sleep.json"
# multistep (only when named): K decode steps per launch against one step at a time through
# the transformers engine loop (docs/multistep.md)
has multistep && stage multistep 300 20 python3 -m \
  xgraph.integrations.transformers.bench_multistep --backend cuda --model "$model" --compile \
  --batches 1,32 --k 8 --json "$OUT/multistep.json"
# hf-fused (only when named): the transformers Qwen3 under the decode kernels and PDL with
# its layers over the fused projections (fusions.py) against its own layers: the GPU test,
# bench_multistep's graph step and kernels each way (same machine), then the benchmark's
# check and decode with them (docs/transformers.md)
hf_env=(env XGRAPH_CUDA_LINEAR=triton XGRAPH_PDL=1 TORCHINDUCTOR_ENABLE_PDL=1)
hf_step=(-m xgraph.integrations.transformers.bench_multistep --backend cuda --model "$model"
  --compile --batches 1 --k 8 --new-tokens 64 --iters 2)
has hf-fused && stage hf-fused-test 90 8 "${hf_env[@]}" python3 -m pytest -q -rfEs \
  -p no:randomly tests/test_transformers_cuda.py -k fuse
for fuse in 0 1; do
  has hf-fused && stage "hf-fused-step-$fuse" 170 4 "${hf_env[@]}" "XGRAPH_FUSE_LAYERS=$fuse" \
    python3 "${hf_step[@]}" --json "$OUT/hf-fused-step-$fuse.json"
done
has hf-fused && stage hf-fused-generate 170 12 "${hf_env[@]}" XGRAPH_FUSE_LAYERS=1 python3 -m \
  xgraph.integrations.transformers.bench --backend cuda --model "$model" --parts check,decode \
  --batches 1 --prompt-len 128 --new-tokens 128 --iters 3 --steps-per-launch 8 \
  --json "$OUT/hf-fused-generate.json"
# startup (only when named): cold and warm processes of the reference model and of the
# transformers Qwen3 compiled, model build to first token (docs/startup.md)
has startup && stage startup 480 30 xgraph bench startup --backend cuda --model "$model" \
  --json "$OUT/startup.json"
has dist && stage dist 540 40 bash -c dist
# kernels (only when named): every decode kernel at the 0.6B and 8B shapes, rows 1-64, over
# its configurations: error against float32 math, bitwise repeatability, device time and
# TB/s against a measured copy; the unfused ops over cuBLAS, cuBLAS alone and the skinny
# kernel beside them; decode attention in one launch against three (bench_kernels.py)
has kernels && stage kernels 130 75 python3 adapters/cuda/tools/bench_kernels.py --jobs 12 \
  --quiet --json "$OUT/kernels.json"
# decode-limit (only when named): issue 35's run, under 6 minutes. bench decode of qwen3-0.6b
# at 1/8/64 and qwen3-8b at 1/8 (kernels per step, idle share, distance from float32; only
# reduce-overhead compiled: xgraph's row is the executor over the forward with the fused
# kernels, XGRAPH_CUDA_LINEAR=triton unless LIMIT_LINEAR names another, its full graphs with
# PDL: XGRAPH_PDL=1 unless LIMIT_PDL=0), the PDL race check
# over 200 replays per bucket, then the record: $OUT/decode-limit.json (kept as
# docs/results/h200/decode-limit.json), its table printed last
limit_env=(env "XGRAPH_CUDA_LINEAR=${LIMIT_LINEAR:-triton}" "XGRAPH_PDL=${LIMIT_PDL:-1}")
limit_args=(--backend cuda --iters 30 --compile-buckets none)
has decode-limit && stage decode-limit-0.6b 150 45 "${limit_env[@]}" xgraph bench decode \
  "${limit_args[@]}" \
  --model qwen3-0.6b --sizes 1,8,64 --compile 1,8,64 --json "$OUT/decode-0.6b.json"
has decode-limit && stage decode-limit-8b 120 30 "${limit_env[@]}" xgraph bench decode \
  "${limit_args[@]}" \
  --model qwen3-8b --sizes 1,8 --compile 1,8 --json "$OUT/decode-8b.json"
has decode-limit && stage pdl-race 60 8 "${limit_env[@]}" python3 adapters/cuda/tools/pdl_race.py \
  --model qwen3-0.6b --buckets 1,8,64 --replays 200 --json "$OUT/pdl-race.json"
has decode-limit && stage decode-limit 15 20 "${limit_env[@]}" python3 -m xgraph.bench.limit --decode \
  "$OUT/decode-0.6b.json" "$OUT/decode-8b.json" --race "$OUT/pdl-race.json" \
  --json "$OUT/decode-limit.json"
# preload (only when named): the weight tiles a projection loads before its PDL wait, the
# default (two for short slices) against three and four, the reference decode step captured
# by hand with its race check (experiments/decode_variants.py; docs/kernels.md)
variants=pdl+preloadauto+keys,pdl+preload3+keys,pdl+preload4+keys,pdl+preloadauto+keys
has preload && stage preload-0.6b 90 12 python3 experiments/decode_variants.py \
  --model qwen3-0.6b --buckets 1,8 --variants "$variants" --replays 200
has preload && stage preload-8b 100 12 python3 experiments/decode_variants.py \
  --model qwen3-8b --buckets 1 --variants pdl+preloadauto+keys,pdl+preload3+keys --replays 50
echo "=== all stages: $((SECONDS - started)) s, exit $rc" | tee -a "$log"
exit $rc

#!/usr/bin/env bash
# Graphs across ranks on a GPU machine, in one go: the CUDA tests of xgraph.distributed, then
# scripts/tp_graphs.py under torchrun, one process per GPU.
#   OUT=out/h200 bash scripts/dist_device.sh 1      # one H200: a world-size-1 NCCL group
#   OUT=out/x2 bash scripts/dist_device.sh 2        # nvidia-h200-x2: TP=2, DP=2 + EP
#   OUT=... bash scripts/dist_device.sh 2 --stages tp,desync   # extra arguments: tp_graphs.py's
# NVLink multicast stays off for every process started here (the machines' rule): the three
# variables below are exported before anything starts, and tp_graphs.py forces them again.
# Output under $OUT: tp_graphs.json (rank 0, every rank's results), log.txt (everything).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
nproc=${1:-1}
shift || true
OUT=${OUT:-out/dist}
export OUT
mkdir -p "$OUT"
log="$OUT/log.txt"
: >"$log"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e adapters/cuda >>"$log" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())" 2>&1 | tee -a "$log"
env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | tee -a "$log"
rc=0
echo "=== tests/test_distributed_cuda.py (limit 120 s)" | tee -a "$log"
timeout -k 10 120 python3 -m pytest -q -rfEs -p no:randomly tests/test_distributed_cuda.py \
  -W ignore::DeprecationWarning -W ignore::FutureWarning >>"$log" 2>&1 || rc=1
tail -n 5 "$log"
echo "=== torchrun --nproc-per-node $nproc scripts/tp_graphs.py $* (limit 400 s)" | tee -a "$log"
timeout -k 10 400 torchrun --nproc-per-node "$nproc" scripts/tp_graphs.py --backend cuda "$@" \
  >>"$log" 2>&1 || rc=1
grep -E '^\[tp_graphs\]|Error' "$log" | tail -n 30
echo "=== exit $rc" | tee -a "$log"
exit $rc

#!/usr/bin/env bash
export PYTHONUNBUFFERED=1 XGRAPH_CUDA_LINEAR=triton XGRAPH_PDL=1
python3 -m pip install -q --no-deps --no-build-isolation -e . -e adapters/cuda >/dev/null 2>&1
t=$SECONDS
timeout 240 python3 experiments/host_state.py --models qwen3-0.6b:1,8,64 qwen3-8b:1 2>&1 | grep -v Warn
echo "host_state rc=$? $((SECONDS - t)) s"
t=$SECONDS
timeout 150 xgraph bench pipeline --backend cuda --model qwen3-0.6b --sizes 1,8,64 --iters 300 \
  --json "$OUT/pipeline.json" 2>&1 | tail -15
echo "pipeline rc=$? $((SECONDS - t)) s"

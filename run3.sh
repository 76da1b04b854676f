#!/usr/bin/env bash
# device call 3: the decode attention's first key tile before its wait, A/B and race, then
# issue 35's decode-limit run with the faster setting
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . -e adapters/cuda >/dev/null 2>&1
echo "tree 585d324"
t=$SECONDS
XGRAPH_CUDA_LINEAR=triton timeout 150 python3 experiments/decode_variants.py --buckets 1,8,64 \
  --variants pdl+preload,pdl+preload+keys --replays 200 >"$OUT/dv.log" 2>&1
echo "dv rc=$? $((SECONDS - t)) s"; grep -E "^(1|8|64) " "$OUT/dv.log"
t=$SECONDS
XGRAPH_CUDA_LINEAR=triton timeout 100 python3 experiments/decode_variants.py --model qwen3-8b \
  --buckets 1,8 --variants pdl+preload,pdl+preload+keys --replays 50 >"$OUT/dv8.log" 2>&1
echo "dv8 rc=$? $((SECONDS - t)) s"; grep -E "^(1|8|64) " "$OUT/dv8.log"
keys=$(python3 - "$OUT" <<'P'
import json, sys
d = json.load(open(sys.argv[1] + "/decode-variants-qwen3-0.6b.json"))["buckets"]
wins = sum(r["pdl+preload+keys"]["us"] < r["pdl+preload"]["us"] for r in d.values())
print("on" if wins * 2 > len(d) else "off")
P
)
echo "XGRAPH_CUDA_DECODE_PRELOAD=$keys for decode-limit"
XGRAPH_CUDA_DECODE_PRELOAD=$keys OUT=$OUT/limit BUDGET=$((570 - SECONDS)) \
  bash scripts/device.sh decode-limit 2>&1 | tail -25

#!/usr/bin/env bash
# Device calls 3 and 4 of the GPU lane (docs/gpu-lane.md): the placements side by side (bench/gpu_lane.py), resumed
# where the previous call stopped (finished engines are kept in /tmp/gl/results while the machine stays warm).
# $1: seconds this call may spend (default 560). Writes $OUT/bench.log, gpu_lane_h200.json/.png, bench.tgz.
set -uo pipefail
T0=$(date +%s)
BUDGET=${1:-560}
exec > >(tee -a "$OUT/bench.log") 2>&1
source scripts/gpu_lane/device_env.sh
[ -f "$GPU_LANE_WORK/maps.json" ] || { echo "no maps: the smoke call (device_smoke.sh) did not finish here"; exit 5; }
python3 bench/gpu_lane.py --work "$GPU_LANE_WORK" --out "$OUT" --phases engines,report \
  --deadline-s $(( BUDGET - 25 )) --split-check "$GPU_LANE_WORK/split_check.json" ${GPU_LANE_ENGINES:+--engines $GPU_LANE_ENGINES} ${GPU_LANE_PLAN:+--plan "$GPU_LANE_PLAN"}
echo "bench rc=$? at +$(( $(date +%s) - T0 )) s"
gpu_lane_pack bench.tgz
nvidia-smi --query-gpu=memory.used --format=csv,noheader

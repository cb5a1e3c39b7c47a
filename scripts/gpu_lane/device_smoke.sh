#!/usr/bin/env bash
# Device call 2 of the GPU lane (docs/gpu-lane.md): install vLLM 0.26 from the carried chunks, then, in one warm
# window: build the lane's model on the GPU, check the Triton split against vLLM's unsplit kernel bit for bit
# (scripts/gpu_lane/split_check.py), run the GPU tests, and the count boot (CUDA graphs on) with its maps.
# Everything lands under $OUT: smoke.log, install.log, split_check.json, pytest_gpu.log, smoke.tgz.
# $1 (optional): when given, the bench (device_bench.sh) runs in the time left of this call, up to 585 s in all.
set -uo pipefail
T0=$(date +%s)
exec > >(tee "$OUT/smoke.log") 2>&1
source scripts/gpu_lane/device_install_lane.sh  # the install, shared with device_quant.sh
gpu_lane_install || exit $?
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader; nproc; free -g | head -2
timeout 240 python3 bench/gpu_lane.py --work "$GPU_LANE_WORK" --phases model || echo "MODEL BUILD FAILED"
echo "== model at +$(( $(date +%s) - T0 )) s"; df -h /tmp | tail -1
# The GPU tests (kernels, pinned views, bit identity of the torch reference split) beside the split check.
( timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_lane_padding.py \
    tests/test_kernels.py tests/test_backends_ref.py tests/test_backends_gpu_adapters.py -ra > "$OUT/pytest_gpu.log" 2>&1;
  echo "pytest rc=$?" >> "$OUT/pytest_gpu.log" ) &
PYTEST=$!
timeout 150 python3 scripts/gpu_lane/split_check.py --out "$GPU_LANE_WORK/split_check.json"
echo "split_check rc=$? at +$(( $(date +%s) - T0 )) s"; cp "$GPU_LANE_WORK/split_check.json" "$OUT/" 2>/dev/null
wait $PYTEST; tail -n 4 "$OUT/pytest_gpu.log"
echo "== count boot at +$(( $(date +%s) - T0 )) s"
timeout $(( 585 - ($(date +%s) - T0) )) python3 bench/gpu_lane.py --work "$GPU_LANE_WORK" --phases count,maps
echo "count rc=$? at +$(( $(date +%s) - T0 )) s"
gpu_lane_pack smoke.tgz
echo "== done at +$(( $(date +%s) - T0 )) s"
if [ -n "${1:-}" ]; then bash scripts/gpu_lane/device_bench.sh $(( 585 - ($(date +%s) - T0) )); fi

# Sourced by the device scripts: where things are on the lent H200, once the install call has run.
# /tmp survives only while the machine stays warm (about 30 s after each call).
export GPU_LANE_WORK=/tmp/gl
export PYTHONPATH="/tmp/site:$PWD/hook:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CACHE_ROOT="$GPU_LANE_WORK/vllm-cache"
export VLLM_USE_FLASHINFER_SAMPLER=0  # flashinfer is not carried (scripts/gpu_lane/patch_vllm.py)
mkdir -p "$GPU_LANE_WORK"
# device_install.sh patches FlashAttention out when FA3 does not load; then every engine must use Triton attention.
if grep -q "gpu_lane fallback" /tmp/site/vllm/vllm_flash_attn/__init__.py 2>/dev/null; then
  export GPU_LANE_ATTENTION_BACKEND=TRITON_ATTN
fi
# Pack what came back into at most a few files under $OUT (the device tool returns 8 files, 2 folders deep).
gpu_lane_pack() {  # $1: archive name
  tar -czf "$OUT/$1" -C "$GPU_LANE_WORK" --exclude=model --exclude=vllm-cache --exclude='*.safetensors' \
    logs results hook maps maps.json model_build.json counts_code.json counts_prose.json split_check.json \
    2>/dev/null || true
}
# Pack lanes kept in folders of their own under $GPU_LANE_WORK (device_quant.sh: one per quant) into one archive
# under $OUT: per lane what gpu_lane_pack takes, plus its report (PNG included). $1: archive name; then the folders.
gpu_lane_pack_lanes() {
  local archive=$1
  shift
  tar -czf "$OUT/$archive" -C "$GPU_LANE_WORK" --exclude=model --exclude=vllm-cache --exclude='*.safetensors' \
    --exclude=pids "$@" quant_calls.log 2>/dev/null || true
}

# Sourced by the device scripts (device_smoke.sh, device_quant.sh): the lane's install, written once. vLLM 0.26 from
# the carried chunks into /tmp/site (.gpu_lane/ctl/device_install.sh, written by scripts/gpu_lane/pack.py), the
# daemon's one dependency the device lacks (.gpu_lane/extra: structlog), vLLM's patches (patch_vllm.py), then the
# lane's environment (device_env.sh). Needs $OUT and $T0 (the caller's start, for the timing line).
# gpu_lane_install returns 0, or: 2 ctl not carried, the installer's code (3: a chunk missing or corrupt:
# send the calls again from call 1), 4 no extra wheels, 6 the patch failed.
GPU_LANE_INSTALLED=/tmp/gpu_lane/lane-installed  # written once all of it succeeded (kept while the machine is warm)

gpu_lane_install() {
  # The call carries the last chunk (pack.py writes as many as the working tree leaves room for) and ctl/; the
  # earlier chunks are in /tmp/gpu_lane already, from the calls that copied them there.
  mkdir -p /tmp/gpu_lane && cp .gpu_lane/ctl/* /tmp/gpu_lane/ || return 2
  local d
  for d in .gpu_lane/c[0-9][0-9]; do
    [ -d "$d" ] && { cp "$d"/* /tmp/gpu_lane/ || return 2; }
  done
  bash /tmp/gpu_lane/device_install.sh > "$OUT/install.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/install.log"
  [ $rc -eq 0 ] || { echo "install failed ($rc)"; return $rc; }
  ls .gpu_lane/extra/*.whl > /dev/null 2>&1 || { echo "no .gpu_lane/extra/*.whl carried (structlog; docs/gpu-lane.md)"; return 4; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_lane/extra/*.whl || return 4
  # wheels an earlier call of this machine left in /tmp/gpu_lane/wheels (too large to ride with a chunk: Humming's)
  if ls /tmp/gpu_lane/wheels/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/gpu_lane/wheels/*.whl || return 4
    echo "== installed $(ls /tmp/gpu_lane/wheels/*.whl | wc -l) wheels from /tmp/gpu_lane/wheels"
  fi
  python3 scripts/gpu_lane/patch_vllm.py /tmp/site || return 6
  touch "$GPU_LANE_INSTALLED"
  source scripts/gpu_lane/device_env.sh
  echo "== installed at +$(( $(date +%s) - T0 )) s; attention backend: ${GPU_LANE_ATTENTION_BACKEND:-auto}"
}

# True when an earlier call installed everything on this (still warm) machine: a resumed call skips the install.
gpu_lane_installed() {
  [ -f "$GPU_LANE_INSTALLED" ] && [ -d /tmp/site/vllm ]
}

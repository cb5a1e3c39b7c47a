#!/usr/bin/env bash
# The whole loop on the H200: the daemon supervising a GPU vLLM 0.26 engine, as an operator runs it. In as few
# device calls as the steps need, resumably (like device_quant.sh): each step is skipped when an earlier call on
# this warm machine finished it, and a step that would not fit the call's time is left for the next call.
#
# Steps, in order of what they are worth if the device time runs out (a cold-cache boot ~100 s, a warm one ~60 s):
#   model     the lane's bf16 model (bench/gpu_lane.py --phases model), ~30 s
#   guide     docs/gpu-operator.md, every bash block (scripts/gpu_lane/run_guide.py), on the lane model: the wheel
#             installed beside vLLM, the config, two count boots (code, prose), the map, `pinsidecar run` with
#             NVML, /metrics, `pinsidecar status`, the stop, ~330 s
#   heal1     bench/heal_scenario.py at 1 stream on the daemon, maps from the guide's count boots, its compile
#             cache (three warm boots: start, drain-reboot, restart after the kill), ~480 s
#   table     bench/gpu_lane.py: off, p23, u23 booted together, decode at 1/4/16 streams, 3 interleaved rounds
#   calmodel  the same geometry with the calibrated router (the reference skew: pinsidecar demo-model --router
#             calibrated), ~60 s
#   callane   its count boot (code), its usage map at 23 %, and that map's cold rate on held-out code, ~200 s
#   apply     bench/apply_gpu.py --reps 2 --async-steps: an in-place apply of >= 800 rows at the reference row size
#             under decode steps left running past their guard (as vLLM's asynchronous scheduling does); batched in
#             stream order, one hold, and batched ordered by host syncs, interleaved, 2 rounds, alone on the GPU
#   heal4     the scenario again at 4 streams
#   heal16    the scenario again at 16 streams
#   heal16s   the scenario at 16 streams with the stream-ordered apply ([remap.advanced] apply_ordering)
#   engapply  bench/apply_engine.py: in-place applies inside one pin engine under 1, 4 and 16 streams, host order,
#             stream order and stream order with 8 ms batches interleaved, 3 each, every apply against equal windows
#             without one, ~500 s
#   engapplyw the same at 16 streams, 1024 rows an apply (64 hot rows against the complement map), ~300 s
#   cachekern bench/cache_tier.py: the cache tier's step at the kernel level per routing profile (static, LRU
#             only, hybrid; batch 1 and 4; CUDA graphs; interleaved rounds), no vLLM needed, ~240 s
#             (GPU_LANE_CACHEKERN_PROFILES: a comma list, default all)
#   cachelane bench/cache_lane.py: the same three placements as pin engines on a replay model per profile, booted
#             together, 1 and 4 streams interleaved, ~4 min a profile (GPU_LANE_CACHE_PROFILES: a comma list, default all)
#             (GPU_LANE_CACHE_TOKENS: tokens per stream and run, default 256). Two profiles a call: four replay
#             models do not fit the device's disk at once (2026-12-06)
# Every heal step gives the engine one Triton cache of its own (/tmp/gl/triton, shared by the heal steps), so its
# document lists the kernels compiled during the run and which long gaps they overlapped (jit, gaps).
# GPU_LANE_LOOP_STEPS overrides the list (e.g. "model guide heal1"); GPU_LANE_ENGAPPLY_REPS the rounds of
# engapplyw (default 3), for a call with little device time left; GPU_LANE_ENGAPPLY_ORDERINGS the variants of both
# steps (ORDERING[@MS], MS the batch budget; default "host,stream,stream@8"; "stream,stream@8" skips the host order,
# whose 1024-row apply took 194 s under 16 streams on an H100 before its drain stopped counting against the budget).
#
# Calls (kind nvidia-h200; each within ~30 s of the previous one's end; a call sends at most 64 MiB, working tree
# included, so the chunks and the control files travel apart):
#   1..N-1. the calls of .gpu_lane/device-calls.txt but its last: each copies one chunk to /tmp/gpu_lane (300)
#   N. carry [the last chunk's folder, ".gpu_lane/ctl", ".gpu_lane/extra", ".gpu_lane/wheel"]:
#      bash scripts/gpu_lane/device_loop.sh (600)
#   N+1... no carry: bash scripts/gpu_lane/device_loop.sh (600), again while it exits 3
# .gpu_lane/extra holds structlog and watchdog (installed into vLLM's /tmp/site), .gpu_lane/wheel this checkout's wheel
# (pip wheel --no-deps --no-build-isolation -w .gpu_lane/wheel .), which only the guide step installs, beside it.
# Exit: 0 all done, 3 more to do, 4 done but a step failed, 20 the install failed (send the chunk calls again).
# Under $OUT: loop.log, and per step its JSON/PNG/log; loop.tgz with the daemon and engine logs.
set -uo pipefail
T0=$(date +%s)
BUDGET=${1:-585}
STEPS=${GPU_LANE_LOOP_STEPS:-model guide heal1 table apply calmodel callane heal16}
PACK_S=30
L=/tmp/gl/loop  # step markers and work folders, kept while the machine is warm
mkdir -p "$L"
exec > >(tee "$OUT/loop.log") 2>&1
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
at() { echo "+$(( $(date +%s) - T0 )) s"; }
declare -A EST=([model]=40 [guide]=400 [heal1]=330 [table]=300 [calmodel]=70 [callane]=200 [apply]=260 [heal4]=330 [heal16]=330 [heal16s]=330 [engapply]=500 [engapplyw]=300 [cachekern]=300 [cachelane]=500)
[ "${GPU_LANE_ENGAPPLY_REPS:-3}" -lt 3 ] && EST[engapplyw]=230  # a boot, 2 warm-up applies, 4 measured

source scripts/gpu_lane/device_install_lane.sh
if gpu_lane_installed; then
  source scripts/gpu_lane/device_env.sh
  echo "== installed by an earlier call; attention backend: ${GPU_LANE_ATTENTION_BACKEND:-auto}"
else
  gpu_lane_install || { echo "INSTALL FAILED ($?): on a cold machine send the chunk calls again"; exit 20; }
fi
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader; free -g | head -2
ATTN=()
[ -n "${GPU_LANE_ATTENTION_BACKEND:-}" ] && ATTN=("--attention-backend" "$GPU_LANE_ATTENTION_BACKEND")
WHEEL=$(ls .gpu_lane/wheel/pinsidecar-*.whl 2>/dev/null | head -1)
OPS=/tmp/op-site   # the operator's install of the wheel, beside vLLM's /tmp/site (the device's vLLM environment)

step_model() { timeout 240 python3 bench/gpu_lane.py --work "$GPU_LANE_WORK" --phases model; }
psc() { python3 -c "from pinsidecar.cli import main; main()" "$@"; }  # the checkout's CLI (PYTHONPATH)
CALMODEL=/tmp/gl/model-calibrated
step_calmodel() {
  timeout 240 python3 -c "from pinsidecar.cli import main; main()" demo-model "$CALMODEL" --hidden 2048 --experts 128 --top-k 8 \
    --expert-intermediate 768 --layers 16 --router calibrated
}

step_apply() {
  timeout $(( $(left) - PACK_S )) python3 bench/apply_gpu.py --reps 2 --async-steps --out "$OUT/apply_h200.json"
}

step_guide() {
  [ -n "$WHEEL" ] || { echo "no pinsidecar wheel in .gpu_lane/wheel (pip wheel --no-deps -w .gpu_lane/wheel .)"; return 2; }
  rm -rf /tmp/op "$OPS"; mkdir -p /tmp/op/traffic
  cp pinsidecar/demo/fixtures/code.jsonl pinsidecar/demo/fixtures/prose.jsonl /tmp/op/traffic/
  local extra=$'max-num-batched-tokens = 2048\ncudagraph-capture-sizes = [1, 2, 4, 8, 16]'
  [ ${#ATTN[@]} -gt 0 ] && extra="$extra"$'\n'"attention-backend = \"${ATTN[1]}\""
  # Not the repository: the guide runs what the wheel installed (PYTHONPATH: vLLM's packages and the wheel's).
  ( cd /tmp/op && env PYTHONPATH="/tmp/site:$OPS" PATH="$OPS/bin:$PATH" VLLM_PY=python3 MODEL="$GPU_LANE_WORK/model" \
      PS_HOME=/tmp/op WHEEL="$OLDPWD/$WHEEL" PIP_INSTALL_ARGS="--no-index --no-deps --target $OPS" \
      EXTRA_VLLM_FLAGS="$extra" HOT_ROWS=99 \
      timeout $(( $(left) - PACK_S )) python3 "$OLDPWD/scripts/gpu_lane/run_guide.py" "$OLDPWD/docs/gpu-operator.md" \
      --log "$OUT/guide.log" --json "$OUT/guide.json" )
}

# The scenario's maps from the guide's count boots of the lane model (/tmp/op/counts): code and prose at 99 hot
# rows (23 % of the expert bytes in host memory), prose at 92 (another geometry: only a drain-reboot can deploy
# it), each with its counts beside it (the drift watch's reference).
COMMITTED_HEAL_MAPS=bench/results/heal_h200_2026-12-03/maps
heal_maps() {
  local m=/tmp/gl/heal-maps c=/tmp/op/counts
  [ -f "$m/prose-92.json" ] && return 0
  if [ ! -f "$c/prose.counts.json" ] && [ -d "$COMMITTED_HEAL_MAPS" ]; then
    # No guide on this machine: the maps of 2026-12-03's run (the lane model is seeded, so its maps fit any build
    # of it). The first boot then compiles (~65 s more than with the guide's cache), still ~235 s less in all.
    mkdir -p "$(dirname "$m")" && cp -r "$COMMITTED_HEAL_MAPS" "$m" && return 0
  fi
  [ -f "$c/prose.counts.json" ] || { echo "no counts of the lane model: the guide step makes them"; return 1; }
  mkdir -p "$m"
  for spec in code:99:code prose:99:prose prose:92:prose-92; do
    IFS=: read -r counts hot label <<< "$spec"
    psc map build "$c/$counts.counts.json" --hot-rows "$hot" --label "$label" \
      --out "$m/$label.json" > /dev/null || return 1
    cp "$c/$counts.counts.json" "$m/$label.counts.json"
  done
}

# The GPU lane's engine settings (bench/gpu_lane.py engine_for), and the compile cache the guide's pin boot filled
# (same model and compile settings): without it the scenario's first boot compiles (150 s against 85 s on
# 2026-12-02) and a 1-stream scenario no longer fits one call.
heal_engine_toml() {
  local attn=""
  [ ${#ATTN[@]} -gt 0 ] && attn=", \"--attention-backend\", \"${ATTN[1]}\""
  cat > /tmp/gl/heal-engine.toml <<EOF
[engine]
enforce_eager = false
dtype = "auto"
kv_cache_bytes = 1073741824
max_model_len = 1024
extra_args = ["--max-num-seqs", "16", "--max-num-batched-tokens", "2048", "--gpu-memory-utilization", "0.2",
              "--cudagraph-capture-sizes", "1", "2", "4", "8", "16"$attn]
env = { VLLM_CACHE_ROOT = "/tmp/op/vllm-cache", VLLM_USE_FLASHINFER_SAMPLER = "0" }
EOF
}

step_heal() {  # $1 clients, $2 apply ordering (default host)
  heal_maps || return 1
  heal_engine_toml
  # Drift windows of a few seconds of traffic: the trip needs three windows after a shift (the gain is scored out
  # of sample, on a candidate built from the window before, then two in a row), and the verify one more. With
  # 4096 tokens at 1 stream (~300 routed tok/s) that was 61 s to the trip on 2026-12-02; 2048 gave 30 s.
  local window=4096
  case $1 in 1) window=2048 ;; 16) window=8192 ;; esac
  local order=${2:-host} name="c$1"
  [ "$order" = host ] || name="c$1_$order"
  timeout $(( $(left) - PACK_S )) python3 bench/heal_scenario.py --clients "$1" --model "$GPU_LANE_WORK/model" \
    --maps /tmp/gl/heal-maps --hot-rows 99 --other-hot-rows 92 --engine-toml /tmp/gl/heal-engine.toml --nvml \
    --prose-s 30 --settle-s 15 --window-tokens "$window" --apply-ordering "$order" --jit-cache /tmp/gl/triton \
    --work "/tmp/gl/heal$name" --out "$OUT/heal_h200_$name.json" --png "$OUT/heal_h200_$name.png"
}
step_heal1() { step_heal 1; }

# The in-engine apply gap (bench/apply_engine.py): host- and stream-ordered applies interleaved on one pin engine,
# each against equal windows without an apply. engapply: the heal scenario's pair (code <-> prose at 99 hot rows,
# 347 rows an apply) at 1, 4 and 16 streams; engapplyw: code at 64 hot rows against its complement (every cold
# row of every layer changes: 1024 rows an apply) at 16 streams.
step_engapply() {
  heal_maps || return 1
  heal_engine_toml
  local m=/tmp/gl/heal-maps
  timeout $(( $(left) - PACK_S )) python3 bench/apply_engine.py --model "$GPU_LANE_WORK/model" \
    --engine-toml /tmp/gl/heal-engine.toml --pair "usage99=$m/code.json,$m/prose.json:1,4,16" --reps 3 \
    --orderings "${GPU_LANE_ENGAPPLY_ORDERINGS:-host,stream,stream@8}" \
    --work /tmp/gl/engapply --out "$OUT/apply_engine_h200.json"
}
step_engapplyw() {
  heal_maps || return 1
  heal_engine_toml
  local m=/tmp/gl/heal-maps/code-64.json
  [ -f "$m" ] || psc map build /tmp/gl/heal-maps/code.counts.json --hot-rows 64 --label code-64 --out "$m" \
    > /dev/null || return 1
  timeout $(( $(left) - PACK_S )) python3 bench/apply_engine.py --model "$GPU_LANE_WORK/model" \
    --engine-toml /tmp/gl/heal-engine.toml --pair "complement64=$m:16" --reps "${GPU_LANE_ENGAPPLY_REPS:-3}" \
    --orderings "${GPU_LANE_ENGAPPLY_ORDERINGS:-host,stream,stream@8}" --work /tmp/gl/engapplyw --out "$OUT/apply_engine_wide_h200.json"
}

# The calibrated lane: count its code traffic (the guide's engine table, another model), a usage map at 23 %, and
# the map's cold rate on held-out code: the reference deployment's figure is 1.55 % (89 of 384 experts cold).
# Without the guide on this machine it writes a count-only config of its own (eager: a count boot needs no graphs).
callane_config() {
  [ -f /tmp/op/pinsidecar.toml ] && { echo /tmp/op/pinsidecar.toml; return 0; }
  local attn=""
  [ ${#ATTN[@]} -gt 0 ] && attn="attention-backend = \"${ATTN[1]}\""
  cat > /tmp/gl/callane/pinsidecar.toml <<EOF
[engine]
model = "$CALMODEL"
served_model_name = "moe"
python = "$(command -v python3)"
port = 18431
env = { VLLM_CACHE_ROOT = "/tmp/gl/callane/vllm-cache" }

[engine.vllm]
dtype = "auto"
enforce-eager = true
max-model-len = 1024
kv-cache-memory-bytes = 1073741824
max-num-seqs = 16
gpu-memory-utilization = 0.5
$attn

[engine.advanced]
ready_timeout_s = 1800

[control]
token_file = "/tmp/gl/callane/control.token"
create_token = true
EOF
  echo /tmp/gl/callane/pinsidecar.toml
}
step_callane() {
  local w=/tmp/gl/callane cfg
  mkdir -p "$w"
  cfg=$(callane_config)
  for t in code code_heldout; do
    timeout 300 python3 -c "from pinsidecar.cli import main; main()" count-boot --config "$cfg" \
      --model "$CALMODEL" --workload "pinsidecar/demo/fixtures/$t.jsonl" --out "$w/$t.counts.json" --label "$t" \
      --json > "$w/$t.count_boot.json" || return 1
  done
  psc map build "$w/code.counts.json" --hot-rows 99 --label "calibrated code" --out "$w/code.json" --json \
    > "$w/code.build.json" || return 1
  psc map eval "$w/code.json" "$w/code_heldout.counts.json" --json > "$OUT/callane_eval.json" || return 1
  cp "$w/code.build.json" "$OUT/callane_build.json"
  python3 -c "import json; d=json.load(open('$OUT/callane_eval.json')); print({k: v for k, v in d.items() if 'rate' in k})"
}
# The cache tier (issue: a cache beside the static map). cachelane stops measuring rounds at its deadline and
# still writes its report; a profile whose engines did not boot in time is missing from it.
step_cachekern() {
  timeout $(( $(left) - PACK_S )) python3 bench/cache_tier.py --out "$OUT/cache_tier_h200.json" \
    ${GPU_LANE_CACHEKERN_PROFILES:+--profiles "$GPU_LANE_CACHEKERN_PROFILES"} --deadline-s $(( $(left) - PACK_S - 120 ))
}
step_cachelane() {
  timeout $(( $(left) - PACK_S )) python3 bench/cache_lane.py --work /tmp/gl/cachelane \
    ${GPU_LANE_CACHE_PROFILES:+--profiles "$GPU_LANE_CACHE_PROFILES"} ${GPU_LANE_CACHE_TOKENS:+--tokens "$GPU_LANE_CACHE_TOKENS"} \
    --out "$OUT/cache_lane_h200.json" --deadline-s $(( $(left) - PACK_S - 30 ))
}
step_heal4() { step_heal 4; }
step_heal16() { step_heal 16; }
step_heal16s() { step_heal 16 stream; }

step_table() {
  timeout -s TERM -k 15 $(( $(left) - PACK_S )) python3 bench/gpu_lane.py --work "$GPU_LANE_WORK" --out "$OUT" \
    --phases count,maps,engines,report --plan off,p23,u23 --sweep all --reps 3 \
    --deadline-s $(( $(left) - PACK_S - 10 ))
}

STATUS=0
for s in $STEPS; do
  if [ -f "$L/$s.done" ]; then echo "== $s: done in an earlier call"; continue; fi
  if [ -f "$L/$s.failed" ] && [ -z "${GPU_LANE_RETRY:-}" ]; then echo "== $s: FAILED earlier (GPU_LANE_RETRY=1 runs it)"; continue; fi
  if [ "$(left)" -lt $(( ${EST[$s]:-300} + PACK_S )) ]; then
    echo "== $s: needs ~${EST[$s]:-300} s, $(left) s left: next call"; STATUS=3; break
  fi
  echo "== $s at $(at)"
  "step_$s"
  rc=$?
  echo "== $s rc=$rc at $(at)"
  case $rc in
    0) touch "$L/$s.done" ;;
    3|124|137|143) STATUS=3; break ;;
    *) echo "$rc" > "$L/$s.failed" ;;
  esac
done
tar -czf "$OUT/loop.tgz" --exclude='*.safetensors' --exclude=vllm-cache --exclude=model \
  -C /tmp op/daemon.log op/state op/counts op/maps gl/heal1 gl/heal4 gl/heal16 gl/healc1 gl/healc4 gl/healc16 gl/healc16_stream gl/heal-maps gl/logs gl/results gl/maps.json \
  2>/dev/null || true
FAILED=$(cd "$L" && ls -- *.failed 2>/dev/null | sed 's/\.failed$//' | tr '\n' ' ')
if [ $STATUS -ne 0 ]; then echo "== more to do: call again (no carry) at $(at)${FAILED:+; failed: $FAILED}"
elif [ -n "$FAILED" ]; then echo "== done at $(at), failed: $FAILED"; STATUS=4
else echo "== all done at $(at)"; fi
exit $STATUS

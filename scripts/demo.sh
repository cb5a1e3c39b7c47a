#!/usr/bin/env bash
# One command from a fresh clone to the demo loop on vLLM CPU with the tiny local MoE model.
# Extra arguments go to `pinsidecar demo` (see `pinsidecar demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
exec .venv/bin/pinsidecar demo "$@"

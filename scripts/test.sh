#!/usr/bin/env bash
# One command from a fresh clone to a full test run: set up, lint, then pytest (real vLLM CPU, real Prometheus).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not vllm"` or `-k maps`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"

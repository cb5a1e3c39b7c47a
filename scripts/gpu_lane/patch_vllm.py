"""Fix-ups of the slim vLLM 0.26.0 install on the device (run after ``device_install.sh``; idempotent).

- ``v1/sample/ops/topk_topp_sampler.py`` ``flashinfer_sampler_supported()`` imports vLLM's FlashInfer attention
  backend, which imports ``flashinfer`` (not carried: docs/gpu-lane.md), whenever the GPU could use FlashInfer's
  sampler; the ``ImportError`` kills the engine core while the model runner is built. The patch makes the function
  answer False when ``flashinfer`` is missing (``VLLM_USE_FLASHINFER_SAMPLER=0`` is also exported by
  ``device_env.sh``). Found on the H200, 2026-11-30.
"""

from __future__ import annotations

import sys
from pathlib import Path

SITE = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/site")
GUARD = "    try:\n        import flashinfer  # noqa: F401\n    except ImportError:\n        return False\n"


def main() -> int:
    path = SITE / "vllm/v1/sample/ops/topk_topp_sampler.py"
    src = path.read_text()
    if GUARD in src:
        print("patch_vllm: flashinfer sampler guard already there")
        return 0
    head = "def flashinfer_sampler_supported"
    start = src.index(head)
    end = src.index("\n", start) + 1
    patched = src[:end] + GUARD + src[end:]
    compile(patched, str(path), "exec")
    path.write_text(patched)
    print(f"patch_vllm: guarded {src[start:end].strip()} against a missing flashinfer")
    return 0


if __name__ == "__main__":
    sys.exit(main())

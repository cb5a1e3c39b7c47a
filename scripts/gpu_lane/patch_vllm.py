"""Fix-ups of the slim vLLM install on the device (run after ``device_install.sh``; idempotent; 0.26 and 0.34).

- ``v1/sample/ops/topk_topp_sampler.py`` ``flashinfer_sampler_supported()`` imports vLLM's FlashInfer attention
  backend, which imports ``flashinfer`` (not carried: docs/gpu-lane.md), whenever the GPU could use FlashInfer's
  sampler; the ``ImportError`` kills the engine core while the model runner is built. The patch makes the function
  answer False when ``flashinfer`` is missing (``VLLM_USE_FLASHINFER_SAMPLER=0`` is also exported by
  ``device_env.sh``). Found on the H200, 2026-11-30.
- vLLM 0.34's ``model_executor/warmup/kernel_warmup.py`` imports the MiniMax-M3 MSA warmup on every CUDA engine,
  and that module imports ``cutlass`` (nvidia-cutlass-dsl, not carried): every engine died in its warm-up with
  ``ModuleNotFoundError: No module named 'cutlass'``. The patch skips that warm-up when the import fails; it only
  serves MiniMax-M3 models. Found on the H100, 2026-12-07. Absent on 0.26 (nothing to patch).
"""

from __future__ import annotations

import sys
from pathlib import Path

SITE = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/site")
GUARD = "    try:\n        import flashinfer  # noqa: F401\n    except ImportError:\n        return False\n"
MSA_IMPORT = """        from vllm.model_executor.warmup.minimax_m3_msa_warmup import (
            minimax_m3_msa_warmup,
        )

        minimax_m3_msa_warmup(worker)"""
MSA_GUARDED = """        try:  # pinsidecar GPU lane: the slim install carries no nvidia-cutlass-dsl (patch_vllm.py)
            from vllm.model_executor.warmup.minimax_m3_msa_warmup import (
                minimax_m3_msa_warmup,
            )
        except ImportError:
            minimax_m3_msa_warmup = None
        if minimax_m3_msa_warmup is not None:
            minimax_m3_msa_warmup(worker)"""


def _write(path: Path, src: str) -> None:
    compile(src, str(path), "exec")
    path.write_text(src)


def guard_flashinfer_sampler(site: Path) -> str:
    path = site / "vllm/v1/sample/ops/topk_topp_sampler.py"
    src = path.read_text()
    if GUARD in src:
        return "flashinfer sampler guard already there"
    head = "def flashinfer_sampler_supported"
    start = src.index(head)
    end = src.index("\n", start) + 1
    _write(path, src[:end] + GUARD + src[end:])
    return f"guarded {src[start:end].strip()} against a missing flashinfer"


def guard_msa_warmup(site: Path) -> str:
    path = site / "vllm/model_executor/warmup/kernel_warmup.py"
    src = path.read_text() if path.exists() else ""
    if MSA_GUARDED in src:
        return "MiniMax-M3 MSA warm-up guard already there"
    if MSA_IMPORT not in src:
        return "no MiniMax-M3 MSA warm-up in this vLLM (nothing to guard)"
    _write(path, src.replace(MSA_IMPORT, MSA_GUARDED))
    return "guarded the MiniMax-M3 MSA warm-up against a missing cutlass (nvidia-cutlass-dsl)"


def main() -> int:
    for patch in (guard_flashinfer_sampler, guard_msa_warmup):
        print(f"patch_vllm: {patch(SITE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

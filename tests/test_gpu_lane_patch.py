"""scripts/gpu_lane/patch_vllm.py: the slim device install's fix-ups apply once, compile, and skip what is absent.

The files are stand-ins with the exact lines the patches look for (copied from vLLM 0.34.0's
``v1/sample/ops/topk_topp_sampler.py`` and ``model_executor/warmup/kernel_warmup.py``), not vLLM itself: the
device has the real ones, and the lane's install runs the script there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("patch_vllm", REPO / "scripts/gpu_lane/patch_vllm.py")
patch_vllm = importlib.util.module_from_spec(spec)
assert spec.loader is not None
spec.loader.exec_module(patch_vllm)

SAMPLER = "def flashinfer_sampler_supported():\n    return True\n"
WARMUP = ("def kernel_warmup(worker):\n    if current_platform.is_cuda():\n"
          "        # The MSA kernels, and the CuTe DSL their modules import, are CUDA-only.\n"
          f"{patch_vllm.MSA_IMPORT}\n\n    return None\n")


def _site(tmp_path: Path, warmup: bool) -> Path:
    (tmp_path / "vllm/v1/sample/ops").mkdir(parents=True)
    (tmp_path / "vllm/v1/sample/ops/topk_topp_sampler.py").write_text(SAMPLER)
    if warmup:
        (tmp_path / "vllm/model_executor/warmup").mkdir(parents=True)
        (tmp_path / "vllm/model_executor/warmup/kernel_warmup.py").write_text(WARMUP)
    return tmp_path


def test_the_msa_warmup_is_guarded_once_and_still_compiles(tmp_path: Path) -> None:
    site = _site(tmp_path, warmup=True)
    assert "guarded the MiniMax-M3" in patch_vllm.guard_msa_warmup(site)
    src = (site / "vllm/model_executor/warmup/kernel_warmup.py").read_text()
    assert patch_vllm.MSA_GUARDED in src and "except ImportError:" in src
    compile(src, "kernel_warmup.py", "exec")
    assert "already there" in patch_vllm.guard_msa_warmup(site)
    assert (site / "vllm/model_executor/warmup/kernel_warmup.py").read_text() == src  # idempotent


def test_a_vllm_without_the_msa_warmup_is_left_alone(tmp_path: Path) -> None:
    site = _site(tmp_path, warmup=False)  # 0.26: no such warm-up
    assert "nothing to guard" in patch_vllm.guard_msa_warmup(site)
    assert "against a missing flashinfer" in patch_vllm.guard_flashinfer_sampler(site)
    assert "already there" in patch_vllm.guard_flashinfer_sampler(site)

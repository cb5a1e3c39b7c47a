"""``PINSIDECAR_NO_SKIP=1`` (what ``.ci/run`` sets) makes a skipped promise a failure, and leaves hardware skips be.

The suite's own conftest is copied beside a small test file and run in a child pytest, with and without the
variable: the same four tests must come out differently only where a part (not hardware) is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TESTS = Path(__file__).resolve().parent

PROBE = '''
import pytest

def test_missing_part():
    pytest.skip("podman missing")

@pytest.mark.skipif(True, reason="prometheus missing")
def test_missing_binary():
    pass

@pytest.mark.gpu
def test_needs_gpu():
    pass

@pytest.mark.xfail(strict=True, reason="a known bug")
def test_known_bug():
    assert False
'''


def _outcomes(tmp_path: Path, no_skip: bool, workers: int = 0) -> dict[str, str]:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: gpu\n    amx: amx\n    vllm: vllm\n")
    env = {k: v for k, v in os.environ.items() if k != "PINSIDECAR_NO_SKIP"}
    if no_skip:
        env["PINSIDECAR_NO_SKIP"] = "1"
    xml = tmp_path / f"out-{no_skip}-{workers}.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                    *(["-n", str(workers)] if workers else []), f"--junitxml={xml}",
                    str(tmp_path / "test_probe.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                   timeout=300)
    result: dict[str, str] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("skipped", "failure", "error")]
        result[case.get("name", "")] = kinds[0] if kinds else "passed"
    return result


def test_no_skip_turns_a_missing_part_into_a_failure_and_leaves_hardware_skips(tmp_path: Path) -> None:
    laptop = _outcomes(tmp_path, no_skip=False)
    ci = _outcomes(tmp_path, no_skip=True)
    assert laptop["test_missing_part"] == laptop["test_missing_binary"] == "skipped", laptop
    assert ci["test_missing_part"] == "failure" and ci["test_missing_binary"] in ("failure", "error"), ci
    gpu_expected = "passed" if _cuda() else "skipped"
    assert laptop["test_needs_gpu"] == ci["test_needs_gpu"] == gpu_expected, (laptop, ci)
    assert laptop["test_known_bug"] == ci["test_known_bug"] == "skipped", (laptop, ci)  # junit writes xfail so


def test_no_skip_holds_in_xdist_workers(tmp_path: Path) -> None:
    """scripts/test.sh runs the tests that boot no engine under pytest-xdist: the report is rewritten in the worker,
    and the run's result (the controller's) must still count the skipped promise as a failure."""
    ci = _outcomes(tmp_path, no_skip=True, workers=2)
    assert ci["test_missing_part"] == "failure" and ci["test_missing_binary"] in ("failure", "error"), ci
    assert ci["test_needs_gpu"] == ("passed" if _cuda() else "skipped"), ci
    assert ci["test_known_bug"] == "skipped", ci


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False

"""Faults reach the hook's in-place apply from outside it: the hook reads no test variables.

``pinsidecar.testing.hook_faults`` wraps ``pinsidecar_hook.swap.apply.swap_layers`` with ``stall_s`` /
``fail_after_layers``, in the test's process or, through a ``sitecustomize.py`` on the engine's ``PYTHONPATH``, in
a real engine's (that path is also exercised by ``test_remap_in_place.py``, which kills an engine mid-apply).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pinsidecar.testing import hook_faults

HOOK = Path(__file__).resolve().parents[1] / "hook"

PROBE = ("import functools, pinsidecar_hook.swap.apply as s; f = s.swap_layers; "
         "print(f.keywords if isinstance(f, functools.partial) else None)")


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120, check=True)


def test_the_engine_environment_wraps_swap_layers_when_the_hook_is_imported(tmp_path: Path) -> None:
    env = hook_faults.engine_env(tmp_path / "faults", stall_s=2.5, fail_after_layers=1)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "faults")
    out = _probe(env)
    assert out.stdout.strip() == "{'stall_s': 2.5, 'fail_after_layers': 1}", out
    assert "swap_layers wrapped" in out.stderr


def test_without_it_the_hook_serves_the_plain_function_whatever_the_environment(tmp_path: Path) -> None:
    old_variables = {"PINSIDECAR_TEST_APPLY_STALL_S": "600", "PINSIDECAR_TEST_APPLY_FAIL_AFTER_LAYERS": "0"}
    assert _probe(old_variables).stdout.strip() == "None"


def test_the_hook_source_names_no_test_variable() -> None:
    found = [f"{p.relative_to(HOOK)}" for p in HOOK.rglob("*.py") if "PINSIDECAR_TEST_" in p.read_text()]
    assert not found, f"test-only variables on the hook's live path: {found}"


def test_a_fault_must_be_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="no fault given"):
        hook_faults.engine_env(tmp_path)
    with pytest.raises(ValueError, match="no fault given"):
        hook_faults.inject(monkeypatch)


LIVE_PROBE = ("import pinsidecar_hook.swap.apply as s\n"
              "try:\n    s._prepare(None, {})\nexcept s.ApplyRefused as e:\n    print('refused:', e)\n")
REAL = "refused: malformed apply request"  # the real checks refuse these empty arguments


def test_live_faults_are_read_at_each_call_and_scoped_to_ranks(tmp_path: Path) -> None:
    folder = tmp_path / "live"
    env = hook_faults.live_engine_env(folder)

    def probe() -> str:
        return subprocess.run([sys.executable, "-c", LIVE_PROBE], env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=120, check=True).stdout.strip()

    assert probe().startswith(REAL)  # no fault set: the real checks run
    hook_faults.set_live_faults(folder, refuse="no such file on this node")
    assert probe() == "refused: no such file on this node"
    hook_faults.set_live_faults(folder, ranks=[1], refuse="no such file on this node")
    assert probe().startswith(REAL)  # not rank 1 (no process group at all here)
    hook_faults.set_live_faults(folder)
    assert probe().startswith(REAL)

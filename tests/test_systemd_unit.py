"""The unit files pass ``systemd-analyze verify`` cleanly and keep the settings the daemon relies on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SYSTEMD = Path(__file__).resolve().parents[1] / "systemd"
UNIT = SYSTEMD / "pinsidecar.service"
DROPIN = SYSTEMD / "pinsidecar.service.d" / "container.conf"


def _settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def _verify(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    """Verify a copy whose ExecStart points at this environment's pinsidecar (verify requires it to exist)."""
    exe = Path(sys.executable).parent / "pinsidecar"
    assert exe.exists(), f"{exe} missing: install the package (pip install -e .)"
    copy = tmp_path / "pinsidecar.service"
    copy.write_text(text.replace("/opt/pinsidecar/.venv/bin/pinsidecar", str(exe)))
    return subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)


needs_systemd = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


@needs_systemd
def test_unit_verifies_clean(tmp_path: Path) -> None:
    res = _verify(tmp_path, UNIT.read_text())
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "", res.stderr
    assert res.stdout.strip() == "", res.stdout


@needs_systemd
def test_unit_with_container_dropin_verifies_clean(tmp_path: Path) -> None:
    # A drop-in's sections merge into the unit; verifying the concatenation checks every directive in it.
    res = _verify(tmp_path, UNIT.read_text() + "\n" + DROPIN.read_text())
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "", res.stderr


def test_unit_settings_the_daemon_relies_on() -> None:
    s = _settings(UNIT.read_text())
    assert s["Type"] == ["notify"]
    assert s["NotifyAccess"] == ["main"]
    assert s["Restart"] == ["on-failure"]
    assert s["WatchdogSec"] and s["WatchdogSec"][0].endswith("s")
    assert s["ExecStart"][0].split()[1:3] == ["run", "--config"]
    # hardening that still allows GPU access
    assert s["ProtectSystem"] == ["strict"]
    assert s["ProtectHome"] == ["true"] and s["NoNewPrivileges"] == ["true"] and s["PrivateTmp"] == ["true"]
    assert "PrivateDevices" not in s
    allowed = " ".join(s["DeviceAllow"])
    assert "/dev/nvidiactl" in allowed and "/dev/nvidia-uvm" in allowed and "char-nvidia-frontend" in allowed
    assert "AF_UNIX" in s["RestrictAddressFamilies"][0]  # the docker/podman socket and sd_notify
    rw = " ".join(s["ReadWritePaths"])
    assert "/var/lib/pinsidecar" in rw and "/run/pinsidecar" in rw
    assert "docker" in _settings(DROPIN.read_text())["SupplementaryGroups"][0]

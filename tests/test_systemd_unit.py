"""The unit files pass ``systemd-analyze verify`` cleanly and keep the settings the daemon relies on; so do the
periodic re-profile's timer and its oneshot service."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SYSTEMD = Path(__file__).resolve().parents[1] / "systemd"
UNIT = SYSTEMD / "pinsidecar.service"
DROPIN = SYSTEMD / "pinsidecar.service.d" / "container.conf"
REMAP_SERVICE = SYSTEMD / "pinsidecar-remap.service"
REMAP_TIMER = SYSTEMD / "pinsidecar-remap.timer"


def _settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def _copy(tmp_path: Path, name: str, text: str) -> Path:
    """A copy whose ExecStart points at this environment's pinsidecar (verify requires it to exist)."""
    exe = Path(sys.executable).parent / "pinsidecar"
    assert exe.exists(), f"{exe} missing: install the package (pip install -e .)"
    copy = tmp_path / name
    copy.write_text(text.replace("/opt/pinsidecar/.venv/bin/pinsidecar", str(exe)))
    return copy


def _verify(tmp_path: Path, text: str, *others: Path) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` of the main unit's text (and of ``others``, verified beside it)."""
    units = [_copy(tmp_path, "pinsidecar.service", text), *(_copy(tmp_path, p.name, p.read_text()) for p in others)]
    return subprocess.run(["systemd-analyze", "verify", *map(str, reversed(units))], capture_output=True, text=True,
                          timeout=60)


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


@needs_systemd
def test_unit_with_podman_dropin_verifies_clean(tmp_path: Path) -> None:
    dropin = SYSTEMD / "pinsidecar.service.d" / "container-podman.conf"
    res = _verify(tmp_path, UNIT.read_text() + "\n" + dropin.read_text())
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "", res.stderr
    assert "CONTAINER_HOST=unix:///run/podman/podman.sock" in dropin.read_text()


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


@needs_systemd
def test_remap_timer_and_service_verify_clean(tmp_path: Path) -> None:
    # The remap service requires the main unit (Requisite=), so it is verified beside it.
    res = _verify(tmp_path, UNIT.read_text(), REMAP_SERVICE, REMAP_TIMER)
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "", res.stderr
    assert res.stdout.strip() == "", res.stdout


@needs_systemd
def test_verify_sees_a_mistake_in_the_remap_service(tmp_path: Path) -> None:
    """The check above can fail: a misspelt directive in the timer's service is reported."""
    bad = tmp_path / "src" / REMAP_SERVICE.name
    bad.parent.mkdir()
    bad.write_text(REMAP_SERVICE.read_text().replace("SuccessExitStatus=", "SucessExitStatus="))
    res = _verify(tmp_path, UNIT.read_text(), bad, REMAP_TIMER)
    assert "SucessExitStatus" in res.stderr


def test_remap_timer_settings() -> None:
    svc = _settings(REMAP_SERVICE.read_text())
    assert svc["Type"] == ["oneshot"]
    argv = svc["ExecStart"][0].split()
    assert argv[1] == "remap" and "--config" in argv and argv[argv.index("--trigger") + 1] == "timer"
    assert svc["SuccessExitStatus"] == ["3"]  # refused by the gate (busy, cooldown, cap) is not a failure
    from pinsidecar.cli.remap import EXIT_REFUSED

    assert EXIT_REFUSED == 3
    assert svc["User"] == _settings(UNIT.read_text())["User"]  # can read the control token
    # the main unit's hardening, where it applies to a client of the control API (and tighter: no devices)
    main = _settings(UNIT.read_text())
    for key in ("ProtectSystem", "ProtectHome", "PrivateTmp", "NoNewPrivileges", "ProtectKernelTunables",
                "ProtectKernelModules", "ProtectControlGroups", "RestrictSUIDSGID", "RestrictNamespaces",
                "LockPersonality", "SystemCallArchitectures"):
        assert svc[key] == main[key], key
    assert svc["PrivateDevices"] == ["true"] and "DeviceAllow" not in svc
    assert "ReadWritePaths" not in svc
    timer = _settings(REMAP_TIMER.read_text())
    assert timer["Unit"] == [REMAP_SERVICE.name]
    assert timer["OnCalendar"] and timer["Persistent"] == ["true"]
    assert timer["WantedBy"] == ["timers.target"]

"""Alertmanager sends the control token through systemd's credentials, so the token file stays 0600.

The daemon refuses a token file readable by anyone but its owner (pinsidecar); Alertmanager runs as prometheus.
The shipped drop-in has systemd load the file for Alertmanager (``LoadCredential=``) and ``alertmanager.yml``
reads that private copy. These tests check the two agree, and that ``systemd-analyze verify`` reads the drop-in
onto Debian's unit cleanly (a broken key in it is reported, so the clean run is not the drop-in being ignored).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DROPIN = ROOT / "systemd" / "prometheus-alertmanager.service.d" / "pinsidecar-token.conf"
AM_CONFIG = ROOT / "grafana" / "alertmanager.yml"
UNIT_NAME = "prometheus-alertmanager.service"
# Debian's unit, when the package is installed (scripts/setup.sh installs it); else the same lines.
DEBIAN_UNIT = Path("/lib/systemd/system") / UNIT_NAME
FALLBACK_UNIT = """[Unit]
Description=Alertmanager for prometheus

[Service]
User=prometheus
ExecStart=/bin/true
"""


def _load_credential() -> tuple[str, str]:
    lines = [ln for ln in DROPIN.read_text().splitlines() if ln.startswith("LoadCredential=")]
    assert len(lines) == 1, lines
    name, source = lines[0].removeprefix("LoadCredential=").split(":", 1)
    return name, source


def _credentials_files() -> list[str]:
    doc = yaml.safe_load(AM_CONFIG.read_text())
    out = []
    for receiver in doc["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            out.append(hook["http_config"]["authorization"]["credentials_file"])
    return out


def test_alertmanager_reads_the_copy_systemd_loads_from_the_daemons_token_file() -> None:
    name, source = _load_credential()
    assert source == "/etc/pinsidecar/control.token"  # the path systemd/pinsidecar.service documents
    assert _credentials_files() == [f"/run/credentials/{UNIT_NAME}/{name}"]


def _verify(tmp_path: Path, dropin_text: str) -> subprocess.CompletedProcess[str]:
    unit_text = DEBIAN_UNIT.read_text() if DEBIAN_UNIT.exists() else FALLBACK_UNIT
    (tmp_path / UNIT_NAME).write_text(unit_text.replace("/usr/bin/prometheus-alertmanager", "/bin/true"))
    (tmp_path / f"{UNIT_NAME}.d").mkdir(exist_ok=True)
    (tmp_path / f"{UNIT_NAME}.d" / DROPIN.name).write_text(dropin_text)
    env = {"PATH": "/usr/bin:/bin", "SYSTEMD_UNIT_PATH": f"{tmp_path}:"}
    return subprocess.run(["systemd-analyze", "verify", str(tmp_path / UNIT_NAME)], capture_output=True,
                          text=True, timeout=60, env=env)


def test_the_drop_in_verifies_on_the_alertmanager_unit(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd)")
    clean = _verify(tmp_path, DROPIN.read_text())
    assert clean.returncode == 0 and not clean.stderr.strip(), clean.stderr
    broken = _verify(tmp_path, DROPIN.read_text().replace("LoadCredential=", "LoadCredentialz="))
    assert "LoadCredentialz" in broken.stderr, "the drop-in was not read: the clean verify proves nothing"

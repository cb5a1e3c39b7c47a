"""The daemon end to end, against the real vLLM CPU engine: THE drain-reboot figure, plus systemd notify, metrics,
status, and SIGTERM (an engine killed from outside and restarted is tests/test_engine_faults.py's first case).

One daemon process (``pinsidecar run``, exactly what the unit starts) serves the whole module, so the engine boots
twice in all (start, drain-reboot). It runs with a real ``$NOTIFY_SOCKET`` (an AF_UNIX datagram
socket read by a thread here) and ``$WATCHDOG_USEC``, like under systemd.

The drain-reboot figure: 8 concurrent streaming clients send completions through the gate in a loop; a drain-reboot
is requested (through the real CLI) in the middle; every request must complete (``[DONE]`` and a finish reason),
none may fail (HTTP error, broken stream) and none may be lost (sent but neither completed nor failed). The counts
and the longest stall a client saw (gap before a response's first chunk or between chunks) are printed and written
to ``$PINSIDECAR_FIGURES_DIR/drain_reboot.json`` when that is set.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from pinsidecar.testing.daemon import DaemonUnderTest, drain_reboot_figure
from pinsidecar.testing.figures import record_figure
from pinsidecar.testing.streaming import load_during

pytestmark = pytest.mark.vllm

CLIENTS = 8
MAX_TOKENS = 32


class NotifyListener:
    """The systemd side of sd_notify: a datagram socket, every message with its arrival time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.5)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((time.monotonic(), fields))

    def seen(self, key: str) -> list[tuple[float, dict[str, str]]]:
        return [(t, m) for t, m in list(self.messages) if key in m]

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


@pytest.fixture(scope="module")
def notify(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NotifyListener]:
    listener = NotifyListener(tmp_path_factory.mktemp("notify") / "notify.sock")
    yield listener
    listener.close()


@pytest.fixture(scope="module")
def daemon(demo_model_dir: Path, notify: NotifyListener, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[DaemonUnderTest]:
    """The daemon as systemd runs it: ``$NOTIFY_SOCKET`` and a 4 s ``$WATCHDOG_USEC``; ready once it says READY."""
    d = DaemonUnderTest(tmp_path_factory.mktemp("daemon"), demo_model_dir,
                        env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "4000000"})
    try:
        d.start(wait=False)
        d.wait_for(lambda: notify.seen("READY"), "READY=1 from the daemon")
        yield d
    finally:
        d.stop()


def test_ready_notify_status_and_watchdog(daemon: DaemonUnderTest, notify: NotifyListener) -> None:
    ready_t, ready = notify.seen("READY")[0]
    assert ready["READY"] == "1" and ready["STATUS"].startswith("engine ready")
    # WATCHDOG=1 kept coming while the engine booted: the event loop was never blocked by the boot
    pings = [t for t, _ in notify.seen("WATCHDOG")]
    boot_s = ready_t - daemon.started_at
    if boot_s > 8:
        assert len([t for t in pings if t <= ready_t]) >= int(boot_s / 2.0) // 2
    st = daemon.status()
    assert st["engine"]["state"] == "ready"
    assert st["engine"]["last_boot"]["reason"] == "start" and st["engine"]["last_boot"]["ok"]
    assert st["gate"]["upstream"] == f"http://127.0.0.1:{daemon.ports.engine}"
    human = daemon.cli("status")
    assert human.returncode == 0, human.stderr
    assert human.stdout.startswith("engine   ready")
    assert json.loads(daemon.cli("status", "--json").stdout)["engine"]["state"] == "ready"


def test_drain_reboot_under_load_loses_nothing(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    before = daemon.status()["engine"]

    # the drain-reboot, through the real CLI, while all 8 clients stream
    load = asyncio.run(load_during(daemon.gate_url, "demo", daemon.drain_reboot_cli, clients=CLIENTS,
                                   max_tokens=MAX_TOKENS))
    result: dict[str, Any] = load.action
    after = daemon.status()
    figure = {
        **load.figure(), "max_tokens": MAX_TOKENS,
        "drain_reboot": drain_reboot_figure(result),
        "gate_counters": after["gate"]["counters"],
    }
    failed, lost, completed = figure["failed"], figure["lost"], figure["completed"]
    record_figure("drain_reboot", figure)
    assert result["ok"] is True and result["in_flight_cut"] == 0 and not result["rolled_back"]
    assert failed == 0, figure["errors"]
    assert lost == 0
    assert completed >= 4 * CLIENTS
    # the reboot really happened, under traffic, and requests really were held across it
    assert after["engine"]["pid"] != before["pid"]
    assert after["engine"]["last_boot"]["reason"] == "drain-reboot"
    assert result["held_at_release"] > 0
    assert result["hold_s"] >= result["boot_s"]
    assert figure["longest_stall_s"] >= result["boot_s"] * 0.5  # a held request waited out the reboot
    assert after["gate"]["counters"].get("rejected_queue_full", 0) == 0
    assert after["gate"]["counters"].get("rejected_hold_timeout", 0) == 0


def test_metrics_scrape_cleanly(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    text = daemon.metrics()
    assert 'pinsidecar_engine_state{state="ready"} 1.0' in text
    assert 'pinsidecar_engine_boots_total{reason="drain-reboot"}' in text
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), res.stdout + res.stderr


def test_api_refuses_without_token_and_sigterm_stops_cleanly(daemon: DaemonUnderTest,
                                                                notify: NotifyListener) -> None:
    pid_before = daemon.status()["engine"]["pid"]
    r = httpx.post(f"{daemon.control_url}/drain-reboot", json={}, timeout=10)
    assert r.status_code == 401
    assert daemon.status()["engine"]["pid"] == pid_before  # nothing happened
    engine = psutil.Process(pid_before)
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(180) == 0
    assert notify.seen("STOPPING")
    assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE

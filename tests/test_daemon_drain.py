"""The daemon end to end, against the real vLLM CPU engine: THE drain-reboot figure, plus systemd notify, metrics,
status, an engine killed from outside, and SIGTERM.

One daemon process (``pinsidecar run``, exactly what the unit starts) serves the whole module, so the engine boots
three times in all (start, drain-reboot, crash restart). It runs with a real ``$NOTIFY_SOCKET`` (an AF_UNIX datagram
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
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from pinsidecar.testing.streaming import load_during

pytestmark = pytest.mark.vllm

GATE, ENGINE, CONTROL, METRICS = 8284, 8285, 8286, 8287
CLIENTS = 8
MAX_TOKENS = 32
BOOT_LIMIT_S = 900.0  # a loaded 2-core CI box can take minutes to boot vLLM
PINSIDECAR = str(Path(sys.executable).parent / "pinsidecar")


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


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    config: Path
    notify: NotifyListener
    log_path: Path
    token: str = ""
    started: float = field(default_factory=time.monotonic)

    def status(self) -> dict[str, Any]:
        return httpx.get(f"http://127.0.0.1:{CONTROL}/status", timeout=10).json()

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PINSIDECAR, *args, "--config", str(self.config)], capture_output=True, text=True,
                              timeout=timeout)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def _wait(cond: Callable[[], bool], what: str, limit_s: float, daemon: Daemon | None = None) -> float:
    t0 = time.monotonic()
    while not cond():
        if daemon is not None and daemon.proc.poll() is not None:
            raise AssertionError(f"daemon exited ({daemon.proc.returncode}) waiting for {what}:\n"
                                 + daemon.log_text()[-3000:])
        if time.monotonic() - t0 > limit_s:
            raise AssertionError(f"not reached within {limit_s} s: {what}")
        time.sleep(0.2)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def model_dir(request: pytest.FixtureRequest) -> Path:
    """The demo model; ``$PINSIDECAR_TEST_MODEL_DIR`` names another model folder to serve instead."""
    if os.environ.get("PINSIDECAR_TEST_MODEL_DIR"):
        return Path(os.environ["PINSIDECAR_TEST_MODEL_DIR"])
    return request.getfixturevalue("demo_model_dir")


@pytest.fixture(scope="module")
def daemon(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("daemon")
    cfg = tmp / "pinsidecar.toml"
    cfg.write_text(f"""
[engine]
model = "{model_dir}"
served_model_name = "demo"
port = {ENGINE}
enforce_eager = true
shutdown_timeout_s = 5
ready_timeout_s = {BOOT_LIMIT_S}
stop_timeout_s = 30
[supervisor]
health_interval_s = 1
health_failures = 3
backoff_initial_s = 1
backoff_max_s = 5
crash_loop_limit = 3
[gate]
port = {GATE}
max_queue = 64
max_hold_s = {BOOT_LIMIT_S}
[control]
port = {CONTROL}
token_file = "{tmp}/control.token"
create_token = true
drain_timeout_s = 120
[metrics]
port = {METRICS}
nvml = false
[maps]
dir = "{tmp}/maps"
[daemon]
state_dir = "{tmp}/state"
""")
    notify = NotifyListener(tmp / "notify.sock")
    env = {**os.environ, "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "4000000",
           "VLLM_CACHE_ROOT": str(tmp / "vllm-cache")}
    env.pop("WATCHDOG_PID", None)
    log_path = tmp / "daemon.log"
    with open(log_path, "wb") as fh:
        proc = subprocess.Popen([PINSIDECAR, "run", "--config", str(cfg)], env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    d = Daemon(proc, cfg, notify, log_path)
    try:
        _wait(lambda: bool(notify.seen("READY")), "READY=1 from the daemon", BOOT_LIMIT_S, d)
        d.token = (tmp / "control.token").read_text().strip()
        yield d
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        _kill_engine_leftovers(tmp)
        notify.close()


def _kill_engine_leftovers(tmp: Path) -> None:
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "vllm.entrypoints.openai.api_server" in cmd and f"--port {ENGINE}" in cmd:
            p.kill()


def test_ready_notify_status_and_watchdog(daemon: Daemon) -> None:
    ready_t, ready = daemon.notify.seen("READY")[0]
    assert ready["READY"] == "1" and ready["STATUS"].startswith("engine ready")
    # WATCHDOG=1 kept coming while the engine booted: the event loop was never blocked by the boot
    pings = [t for t, _ in daemon.notify.seen("WATCHDOG")]
    boot_s = ready_t - daemon.started
    if boot_s > 8:
        assert len([t for t in pings if t <= ready_t]) >= int(boot_s / 2.0) // 2
    st = daemon.status()
    assert st["engine"]["state"] == "ready"
    assert st["engine"]["last_boot"]["reason"] == "start" and st["engine"]["last_boot"]["ok"]
    assert st["gate"]["upstream"] == f"http://127.0.0.1:{ENGINE}"
    human = daemon.cli("status")
    assert human.returncode == 0, human.stderr
    assert human.stdout.startswith("engine   ready")
    assert json.loads(daemon.cli("status", "--json").stdout)["engine"]["state"] == "ready"


def test_drain_reboot_under_load_loses_nothing(daemon: Daemon, tmp_path: Path) -> None:
    before = daemon.status()["engine"]

    async def drain_reboot() -> dict[str, Any]:
        """The drain-reboot, through the real CLI, while all 8 clients stream."""
        proc = await asyncio.create_subprocess_exec(
            PINSIDECAR, "drain-reboot", "--config", str(daemon.config), "--timeout", "120", "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        assert proc.returncode == 0, (out.decode(), err.decode())
        return json.loads(out)

    load = asyncio.run(load_during(f"http://127.0.0.1:{GATE}", "demo", drain_reboot, clients=CLIENTS,
                                   max_tokens=MAX_TOKENS))
    result: dict[str, Any] = load.action
    after = daemon.status()
    figure = {
        **load.figure(), "max_tokens": MAX_TOKENS,
        "drain_reboot": {k: result.get(k) for k in ("seconds", "drain_s", "boot_s", "in_flight_cut",
                                                     "hold_s", "held_at_release", "hash_hit")},
        "gate_counters": after["gate"]["counters"],
    }
    failed, lost, completed = figure["failed"], figure["lost"], figure["completed"]
    print("\nDRAIN-REBOOT FIGURE:", json.dumps(figure, indent=1))
    if os.environ.get("PINSIDECAR_FIGURES_DIR"):
        out = Path(os.environ["PINSIDECAR_FIGURES_DIR"]) / "drain_reboot.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figure, indent=1) + "\n")
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


def test_engine_killed_from_outside_is_restarted(daemon: Daemon) -> None:
    st = daemon.status()["engine"]
    assert st["state"] == "ready"
    pid = st["pid"]
    killed_at = time.monotonic()
    os.killpg(pid, signal.SIGKILL)  # the engine's whole process group, as an OOM killer or an operator might
    noticed = _wait(lambda: daemon.status()["engine"]["state"] != "ready", "the daemon noticing the kill", 15.0,
                    daemon)
    print(f"\nengine SIGKILL noticed after {noticed:.2f} s")
    _wait(lambda: daemon.status()["engine"]["state"] == "ready", "the engine restarted", BOOT_LIMIT_S, daemon)
    after = daemon.status()["engine"]
    assert after["pid"] != pid
    assert after["last_boot"]["reason"] == "crash"
    assert after["restarts_total"] >= 1
    assert "restarting" in daemon.log_text()
    # served again through the gate
    r = httpx.post(f"http://127.0.0.1:{GATE}/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 4},
                   timeout=120)
    assert r.status_code == 200
    assert time.monotonic() - killed_at > noticed


def test_metrics_scrape_cleanly(daemon: Daemon, tmp_path: Path) -> None:
    text = httpx.get(f"http://127.0.0.1:{METRICS}/metrics", timeout=30).text
    assert 'pinsidecar_engine_state{state="ready"} 1.0' in text
    assert 'pinsidecar_engine_boots_total{reason="drain-reboot"}' in text
    assert 'pinsidecar_engine_boots_total{reason="crash"}' in text
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), res.stdout + res.stderr


def test_api_refuses_without_token_and_sigterm_stops_cleanly(daemon: Daemon) -> None:
    pid_before = daemon.status()["engine"]["pid"]
    r = httpx.post(f"http://127.0.0.1:{CONTROL}/drain-reboot", json={}, timeout=10)
    assert r.status_code == 401
    assert daemon.status()["engine"]["pid"] == pid_before  # nothing happened
    engine = psutil.Process(pid_before)
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(180) == 0
    assert daemon.notify.seen("STOPPING")
    assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE

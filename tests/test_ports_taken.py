"""A port the daemon needs (engine, gate, control API, exporter) taken by another process: one clear error that
names the setting, the port and the process holding it, before anything starts (in particular before the engine's
long boot: the engine's own port check would only fail each boot in a loop), and nothing left running."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pinsidecar.daemon.config import load_config
from pinsidecar.daemon.service import Daemon
from pinsidecar.engine import free_port
from pinsidecar.engine.ports import PortsTakenError, check_ports_free

PINSIDECAR = str(Path(sys.executable).parent / "pinsidecar")
KEYS = ("engine.port", "gate.port", "control.port", "metrics.port")


def _config(tmp: Path) -> tuple[Path, dict[str, int]]:
    """A daemon config whose engine is a script that leaves a marker if it is ever started."""
    (tmp / "model").mkdir()
    engine = tmp / "engine"
    engine.write_text(f"#!/bin/sh\ntouch {tmp / 'engine-started'}\nexec sleep 600\n")
    engine.chmod(0o755)
    ports: list[int] = []
    for _ in KEYS:
        ports.append(free_port(ports[-1] + 1) if ports else free_port())
    by_key = dict(zip(KEYS, ports, strict=True))
    cfg = tmp / "pinsidecar.toml"
    cfg.write_text(f"""
[engine]
model = "{tmp / 'model'}"
python = "{engine}"
port = {by_key['engine.port']}
ready_timeout_s = 60
stop_timeout_s = 5
[gate]
port = {by_key['gate.port']}
[control]
port = {by_key['control.port']}
token_file = "{tmp / 'token'}"
create_token = true
[metrics]
port = {by_key['metrics.port']}
nvml = false
[daemon]
state_dir = "{tmp / 'state'}"
""")
    return cfg, by_key


@pytest.fixture
def listener() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    yield held
    for s in held:
        s.close()


def _take(held: list[socket.socket], port: int) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    held.append(s)


@pytest.mark.parametrize("key", KEYS)
def test_a_taken_port_stops_the_daemon_before_anything_starts(tmp_path: Path, listener: list[socket.socket],
                                                              key: str) -> None:
    cfg_path, ports = _config(tmp_path)
    _take(listener, ports[key])
    daemon = Daemon(load_config(cfg_path))
    with pytest.raises(PortsTakenError) as err:
        asyncio.run(daemon.start())
    msg = str(err.value)
    me = psutil.Process()  # the holder is this process ("python", or an xdist worker's title)
    assert f"{key} = {ports[key]} on 127.0.0.1 is taken by pid {me.pid} ({me.name()})" in msg, msg
    assert f"sport = :{ports[key]}" in msg and "set another port" in msg
    assert all(f"{k} =" not in msg for k in KEYS if k != key)  # only the taken one is named
    assert daemon.supervisor is None and daemon.gate is None and daemon.exporter is None
    assert not (tmp_path / "engine-started").exists()


def test_every_taken_port_is_named_at_once(listener: list[socket.socket]) -> None:
    a, b = free_port(), free_port()
    _take(listener, a)
    _take(listener, b)
    with pytest.raises(PortsTakenError, match=rf"gate.port = {a} .*; metrics.port = {b} "):
        check_ports_free({"gate.port": ("127.0.0.1", a), "control.port": ("127.0.0.1", 0),
                          "metrics.port": ("127.0.0.1", b)})
    assert isinstance(PortsTakenError("x"), OSError)  # the CLI's "cannot start" path


def test_pinsidecar_run_exits_2_at_once_with_the_port_when_the_engine_port_is_taken(
        tmp_path: Path, listener: list[socket.socket]) -> None:
    cfg_path, ports = _config(tmp_path)
    _take(listener, ports["engine.port"])
    t0 = time.monotonic()
    r = subprocess.run([PINSIDECAR, "run", "--config", str(cfg_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot start: engine.port = {ports['engine.port']} on 127.0.0.1 is taken"), last
    assert not (tmp_path / "engine-started").exists()
    print(f"\nexit after {time.monotonic() - t0:.1f} s")

"""sd_notify against a real AF_UNIX datagram socket, the way systemd receives it (path and abstract)."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pinsidecar.daemon.sdnotify import Notifier


def _recv(sock: socket.socket) -> dict[str, str]:
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.splitlines())


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    addr = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(addr)
    sock.settimeout(5)
    yield addr, sock
    sock.close()


def test_ready_status_watchdog_stopping_arrive_in_order(path_socket: tuple[str, socket.socket]) -> None:
    addr, sock = path_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": addr})
    assert n.enabled
    assert n.ready("engine ready")
    assert _recv(sock) == {"READY": "1", "STATUS": "engine ready"}
    assert n.status("draining\nfor reboot")
    assert _recv(sock) == {"STATUS": "draining for reboot"}
    assert n.watchdog()
    assert _recv(sock) == {"WATCHDOG": "1"}
    assert n.stopping()
    assert _recv(sock) == {"STOPPING": "1"}
    n.close()


def test_abstract_socket() -> None:
    name = f"pinsidecar-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.ready()
        assert _recv(sock) == {"READY": "1"}
    finally:
        sock.close()


def test_no_socket_is_a_noop() -> None:
    n = Notifier.from_env({})
    assert not n.enabled
    assert not n.ready()
    assert n.watchdog_interval_s() is None


def test_missing_socket_does_not_raise(tmp_path: Path) -> None:
    n = Notifier(str(tmp_path / "gone.sock"))
    assert n.notify({"READY": 1}) is False


def test_watchdog_interval_is_half_the_timeout() -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "30000000"})
    assert n.watchdog_interval_s() == 15.0
    # WATCHDOG_PID naming another process: the watchdog is not ours to feed.
    other = Notifier.from_env({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "30000000",
                               "WATCHDOG_PID": str(os.getpid() + 1)})
    assert other.watchdog_interval_s() is None
    mine = Notifier.from_env({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())})
    assert mine.watchdog_interval_s() == 2.0

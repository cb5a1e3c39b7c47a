"""TCP ports: is one taken, and find a free one.

Every launcher checks its port before it starts anything (a second engine on a busy port fails only after a 20 s
boot, with "address already in use" deep in its log), and every command that boots an engine for itself (parity,
the tests, the benchmarks) needs a port nobody uses. Both questions are answered here, once.

The daemon asks :func:`check_ports_free` for all its ports (engine, gate, control API, exporter) before it starts
anything: a port taken by another process is one clear error naming the setting, the port and who holds it, before
the engine's long boot, not a bind error from deep inside a server or an engine that fails its boots in a loop.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import psutil

__all__ = ["check_ports_free"]

# PINSIDECAR_TEST_PORTS="8150-8199" keeps free_port() inside a range: on a box shared by several test runs, each
# run owns a range and the runs never take each other's ports.
PORT_RANGE_ENV = "PINSIDECAR_TEST_PORTS"
_MAX_PORT = 65535


def port_in_use(host: str, port: int) -> bool:
    """True when ``host:port`` cannot be bound right now (another server, or another engine, holds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Same option uvicorn sets: a port in TIME_WAIT from a previous engine is free, a listening one is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def free_port(lo: int | None = None, hi: int | None = None, host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now.

    With ``lo``: the first free port in ``lo..hi`` (``hi`` defaults to 65535). Without: the first free one in
    ``$PINSIDECAR_TEST_PORTS`` (``"8150-8199"``) when that is set, else one the OS picks. The port is free when
    this returns; a caller that binds it later can still lose a race with another process.
    """
    if lo is None and os.environ.get(PORT_RANGE_ENV, "").strip():
        raw = os.environ[PORT_RANGE_ENV].strip()
        a, _, b = raw.partition("-")
        try:
            lo, hi = int(a), int(b or a)
        except ValueError:
            raise ValueError(f"{PORT_RANGE_ENV}={raw!r} is not a port range like 8150-8199") from None
    if lo is not None:
        top = hi if hi is not None else _MAX_PORT
        for port in range(lo, top + 1):
            if not port_in_use(host, port):
                return port
        raise RuntimeError(f"no free port in {lo}-{top} on {host}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class PortsTakenError(OSError):
    """One or more of the ports a daemon needs are held by another process (an ``OSError``, like a failed bind)."""


def port_holder(port: int) -> str | None:
    """``"pid 1234 (nginx)"`` for the process listening on ``port``, when the system lets us see it."""
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.Error, OSError):  # not root on some systems: the port is still named, without its holder
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            try:
                return f"pid {c.pid} ({psutil.Process(c.pid).name()})"
            except psutil.Error:
                return f"pid {c.pid}"
    return None


def check_ports_free(wanted: Mapping[str, tuple[str, int]]) -> None:
    """Raise :class:`PortsTakenError` naming every setting in ``wanted`` (``{"gate.port": (host, port)}``) whose
    port cannot be bound now, who holds it, and how to fix it. Port 0 (the OS picks) is never taken."""
    taken, ports = [], []
    for key, (host, port) in wanted.items():
        if port and port_in_use(host, port):
            holder = port_holder(port)
            taken.append(f"{key} = {port} on {host} is taken" + (f" by {holder}" if holder else ""))
            ports.append(f"`ss -ltnp 'sport = :{port}'`")
    if taken:
        raise PortsTakenError(f"{'; '.join(taken)}: stop whatever listens there ({', '.join(ports)} shows it) or "
                              "set another port in the config")

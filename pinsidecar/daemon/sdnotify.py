"""systemd's notify protocol (``sd_notify``), spoken directly over the AF_UNIX datagram socket systemd gives us.

Why not a library: the protocol is one ``sendto`` of ``KEY=VALUE`` lines to the socket named in
``$NOTIFY_SOCKET``, and a dependency for that is more surface than the code. What the daemon sends:

- ``READY=1`` once the engine is ready (``Type=notify``: until then, ``systemctl start`` waits);
- ``STATUS=...`` the state in words, shown by ``systemctl status``;
- ``WATCHDOG=1`` from the main loop at half of ``$WATCHDOG_USEC`` (:meth:`Notifier.watchdog_interval_s`), so a
  hung event loop misses its pings and systemd restarts the daemon;
- ``STOPPING=1`` when shutdown begins.

``$NOTIFY_SOCKET`` may be a path or an abstract socket (leading ``@``, sent as a leading NUL byte). Without it (not
under systemd) every call is a no-op, so the daemon code never has to ask.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import structlog

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)


class Notifier:
    """Sends notify messages to systemd. Build it once, early: ``Notifier.from_env()``."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address or None
        self.watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        """Read ``$NOTIFY_SOCKET`` and ``$WATCHDOG_USEC`` (ignored when ``$WATCHDOG_PID`` names another process,
        as sd_watchdog_enabled does)."""
        env = os.environ if env is None else env
        usec: int | None = None
        raw = env.get("WATCHDOG_USEC", "").strip()
        wpid = env.get("WATCHDOG_PID", "").strip()
        if raw.isdigit() and (not wpid or wpid == str(os.getpid())):
            usec = int(raw)
        return cls(env.get("NOTIFY_SOCKET", "").strip() or None, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def watchdog_interval_s(self) -> float | None:
        """How often to send ``WATCHDOG=1``: half the timeout, as sd_watchdog_enabled(3) advises; None = off."""
        return None if self.watchdog_usec is None else self.watchdog_usec / 2e6

    def notify(self, fields: Mapping[str, str | int]) -> bool:
        """Send one message; True if it went out. Errors are logged once and never raised: a daemon must not die
        because the journal or the manager hiccuped."""
        if self.address is None:
            return False
        msg = "\n".join(f"{k}={v}" for k, v in fields.items()).encode("utf-8")
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, addr)
        except OSError as exc:
            if not self._warned:
                log.warning("sd_notify_failed", socket=self.address, error=str(exc))
                self._warned = True
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        fields: dict[str, str | int] = {"READY": 1}
        if status:
            fields["STATUS"] = status
        return self.notify(fields)

    def status(self, text: str) -> bool:
        return self.notify({"STATUS": text.replace("\n", " ")})

    def watchdog(self) -> bool:
        return self.notify({"WATCHDOG": 1})

    def stopping(self, status: str | None = None) -> bool:
        fields: dict[str, str | int] = {"STOPPING": 1}
        if status:
            fields["STATUS"] = status
        return self.notify(fields)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

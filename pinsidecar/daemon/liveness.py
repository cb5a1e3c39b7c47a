"""How the supervisor knows the serving engine is still there: an exit watch, and a cheap health probe.

**Liveness** is the process (or container) alive *and* ``/health`` answering (within ``health_timeout_s``). A
local engine process that exits is noticed at once: the event loop watches a pidfd of it (:class:`ExitWatch`, no
thread, no poll), so the state leaves ``ready`` and the gate holds in the same moment; a container's exit is
noticed at the next check (every ``health_interval_s``). The periodic check (:class:`HealthProbe`) must stay
cheap: the idle daemon's CPU budget is 1 %, so it asks ``/health`` on one kept-alive connection and asks a local
process with a ``waitpid``, never through a thread. What counts as hung (``health_failures`` misses in a row) is
the supervisor's decision, not this module's.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import aiohttp
import structlog

from pinsidecar.engine import EngineProcess, Launcher

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger("pinsidecar.daemon.supervisor")  # the supervisor's events, under its logger


class ExitWatch:
    """Calls ``on_exit`` on the event loop the moment process ``pid`` exits: a pidfd (Linux >= 5.3) becomes readable
    then. The process must be our child and not yet reaped (Popen reaps only when asked), so the pid cannot have
    been reused. Without pidfd support nothing is watched and the liveness check finds the exit instead."""

    def __init__(self, pid: int, on_exit: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_exit = on_exit
        self._fd: int | None = None
        try:
            self._fd = os.pidfd_open(pid)
        except (OSError, AttributeError) as exc:
            log.info("engine_exit_watch_unavailable", pid=pid, error=str(exc), fallback="liveness check")
            return
        self._loop.add_reader(self._fd, self._fire)

    def _fire(self) -> None:
        self.close()
        self._on_exit()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            self._loop.remove_reader(fd)
            os.close(fd)


class HealthProbe:
    """The two questions of one liveness check: is the engine alive, and does ``/health`` answer 200."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def alive(self, launcher: Launcher) -> bool:
        if isinstance(launcher, EngineProcess):
            return launcher.alive()  # a waitpid(WNOHANG): no thread needed
        return await asyncio.to_thread(launcher.alive)  # e.g. `docker inspect`

    async def healthy(self, launcher: Launcher, timeout_s: float) -> bool:
        """``GET /health`` on one kept-alive connection. Same check as ``launcher.health()``, without a thread
        hop and a fresh HTTP client (and TLS context) every few seconds: the idle daemon's CPU budget is 1 %."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))
        try:
            async with self._session.get(f"{launcher.base_url}/health") as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

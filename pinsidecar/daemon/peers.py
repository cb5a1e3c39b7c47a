"""The supervisor's two peers, as typed protocols: the observer that hears what it does, and the gate it drives.

- **Observers** hear every state change and every boot that reached ready through :class:`BootObserver` (the
  exporter implements it): typed calls, so a renamed method fails the type check and the tests, not a log line.
- **The gate follows the engine** (:class:`EngineGate`, the daemon's :class:`~pinsidecar.daemon.gate.Gate`): the
  supervisor holds it the moment it loses the engine, points it at the restarted engine and releases it once that
  serves, and makes it refuse when it gives up (see :mod:`pinsidecar.daemon.supervisor`).

They live apart from the supervisor so that the exporter and the gate can be checked against them without
importing the engine's lifecycle.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from pinsidecar_hook.contract import ExpertMap

__all__: list[str] = []  # nothing here is another package's business


@runtime_checkable
class BootObserver(Protocol):
    """Who hears what the supervisor does to the engine (:class:`pinsidecar.metrics.Exporter` implements it).

    Called on the daemon's event loop: return at once. An exception is logged and ignored: metrics must never take
    the supervisor down. The engine's pid, container and URL are not pushed: the observer reads them when it needs
    them (the exporter at scrape time, from :attr:`~pinsidecar.daemon.supervisor.Supervisor.launcher`).
    """

    def on_state(self, state: str) -> None:
        """The engine's state changed; ``state`` is an exported one
        (:attr:`~pinsidecar.daemon.supervisor.EngineState.EXPORTED` applied)."""

    def on_boot(self, *, reason: str, seconds: float, map_hash: str, cache_miss: bool) -> None:
        """A boot reached ready after ``seconds`` (``cache_miss``: much slower than the last like it)."""

    def on_map(self, emap: ExpertMap) -> None:
        """The engine that just booted serves ``emap``."""


@runtime_checkable
class EngineGate(Protocol):
    """What the supervisor does to the gate in front of the engine (:class:`pinsidecar.daemon.gate.Gate`)."""

    def hold(self) -> None:
        """New requests wait (bounded) instead of reaching the engine."""

    def release(self) -> None:
        """Let held and new requests through."""

    def refuse(self, why: str) -> None:
        """Answer every request 503 at once: no engine is coming back."""

    def set_upstream(self, url: str) -> None:
        """Send requests to ``url`` from now on."""

"""What every metrics source shares: the collector protocols, and a status that is logged once per change.

A *source* is something outside the daemon that a scrape reads (the engine's ``/metrics``, the stats file, the
engine's cgroup, host memory, NVML). Each one exports ``pinsidecar_exporter_source_up{source}``: 1 when it was
read this scrape, 0 when it failed, and no sample at all when it is not configured (no engine yet, NVML absent):
not configured is not down. Failure is local: a source that cannot be read drops its own metrics, the others
still export, and the scrape never fails. The reason is logged once when a source starts failing (and again only
if the reason changes), and once when it recovers, never once per scrape.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import structlog
from prometheus_client.core import Metric

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)


class SourceStatus:
    """One source's state for ``pinsidecar_exporter_source_up``: ``up`` is True, False, or None (not configured).

    Call :meth:`ok`, :meth:`fail` or :meth:`off` once per scrape; the log sees only the changes.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.reason: str | None = None
        self.up: bool | None = None

    def fail(self, reason: str) -> None:
        self.up = False
        if reason != self.reason:
            log.warning("metrics source unavailable; its metrics are left out", source=self.source, reason=reason)
            self.reason = reason

    def ok(self) -> None:
        self.up = True
        if self.reason is not None:
            log.info("metrics source recovered", source=self.source)
            self.reason = None

    def off(self) -> None:
        self.up = None


class Collector(Protocol):
    """Anything the exporter's registry can collect (prometheus_client's custom-collector interface)."""

    def collect(self) -> Iterable[Metric]: ...


class Source(Collector, Protocol):
    """A collector that reads something outside the daemon, and says in ``status`` whether it could."""

    source: str  # the ``source`` label of pinsidecar_exporter_source_up
    status: SourceStatus

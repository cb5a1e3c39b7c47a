"""The exporter: every collector in one registry, the ``/metrics`` HTTP server, and the daemon's way in.

Build one :class:`Exporter` with where its sources are (stats path, cgroup and ``/proc`` roots, NVML) and how to
find the running engine: ``engine_pid``, ``engine_container_id``, ``engine_url``, ``gate``, ``drift`` (the drift
watch) and ``remap`` (the running remap's record) are each a value or a zero-argument callable that the collectors
call at every scrape (None: not known now). The daemon passes
callables that look at the engine its supervisor runs, so a restarted engine (a new pid, a new container, another
URL) is followed without anyone calling the exporter. What only the daemon knows (the engine's state, boots, the
map it activated) it reports through :meth:`Exporter.on_state`, :meth:`Exporter.on_boot` and
:meth:`Exporter.on_map`: the supervisor's ``BootObserver`` protocol, typed and tested, not method names in strings.

``registry`` defaults to a fresh :class:`~prometheus_client.CollectorRegistry` (not the global one), so several
exporters can live in one process (tests); everything comes from one collector there, with no ``_created``
clutter, plus prometheus_client's ``ProcessCollector`` for the daemon's own RSS and CPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import structlog
from pinsidecar_hook.contract import ExpertMap
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

from pinsidecar.metrics.cgroup import CgroupMemoryCollector
from pinsidecar.metrics.daemon_state import DaemonStateCollector
from pinsidecar.metrics.drift import DriftCollector, DriftView
from pinsidecar.metrics.engine import EngineMetricsCollector
from pinsidecar.metrics.gate import GateCollector, GateView
from pinsidecar.metrics.gpu import REAL_NVML, GpuMemoryCollector
from pinsidecar.metrics.host import HostMemoryCollector
from pinsidecar.metrics.remap import RemapCollector
from pinsidecar.metrics.routing import RoutingCollector
from pinsidecar.metrics.source import Collector, Source

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

T = TypeVar("T")
# A live input: a fixed value, or a callable asked at every scrape; None (or a callable returning None): unknown.
Live: TypeAlias = T | Callable[[], T | None] | None


def _live(value: Live[T]) -> Callable[[], T | None]:
    if callable(value):
        return value
    return lambda: value


class _ExporterCollector:
    """Chains the collectors and adds ``pinsidecar_exporter_source_up``. A source that raises anyway (a bug) is
    logged once and left out (and reported down), so one source can never fail the scrape."""

    def __init__(self, sources: list[Source], others: list[Collector]) -> None:
        self.sources = sources
        self.others = others
        self._broken: set[str] = set()

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration time: that would scrape the engine

    def _safe(self, name: str, collector: Collector) -> list[Metric] | None:
        try:
            return list(collector.collect())
        except Exception as exc:
            if name not in self._broken:
                log.exception("metrics collector raised; its metrics are left out", source=name, error=str(exc))
                self._broken.add(name)
            return None

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("pinsidecar_exporter_source_up",
                               "1 when a configured metrics source was read this scrape, 0 when it failed.",
                               labels=["source"])
        for other in self.others:
            yield from self._safe(type(other).__name__, other) or []
        for src in self.sources:
            families = self._safe(src.source, src)
            if families is None:
                up.add_metric([src.source], 0.0)
                continue
            yield from families
            if src.status.up is not None:
                up.add_metric([src.source], 1.0 if src.status.up else 0.0)
        yield up


class Exporter:
    """The sidecar's metrics (the names are listed in :mod:`pinsidecar.metrics`); see the module docstring.

    Usage: build it, :meth:`start_http` once, call :meth:`on_state` / :meth:`on_boot` / :meth:`on_map` /
    :meth:`record_remap` (and the ``record_apply_*`` calls) as things happen, :meth:`stop` at the end. Everything
    else is read at scrape time: the daemon passes ``drift=lambda: self.watch`` (None in count mode) and
    ``remap=`` a callable returning the running remap's record dict (None when none runs).
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, stats_path: Path | None = None,
                 engine_url: Live[str] = None, engine_pid: Live[int] = None, engine_container_id: Live[str] = None,
                 gate: Live[GateView] = None, drift: Live[DriftView] = None,
                 remap: Live[Mapping[str, Any]] = None, cgroup_root: Path = Path("/sys/fs/cgroup"),
                 proc_root: Path = Path("/proc"), nvml: object | None = REAL_NVML,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 process_metrics: bool = True) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.daemon = DaemonStateCollector(wall_clock=wall_clock)
        self.gate = GateCollector(_live(gate))
        self.drift = DriftCollector(_live(drift))
        self.remaps = RemapCollector(_live(remap), wall_clock=wall_clock)
        self.engine = EngineMetricsCollector(_live(engine_url), clock=clock)
        self.routing = RoutingCollector(stats_path, wall_clock=wall_clock)
        self.cgroup = CgroupMemoryCollector(pid=_live(engine_pid), container_id=_live(engine_container_id),
                                            cgroup_root=cgroup_root, proc_root=proc_root)
        self.host = HostMemoryCollector()
        self.gpu = GpuMemoryCollector(nvml)
        self.registry.register(_ExporterCollector(
            [self.engine, self.routing, self.cgroup, self.host, self.gpu],
            [self.daemon, self.gate, self.drift, self.remaps]))
        if process_metrics:
            # the daemon's own RSS and CPU (pinsidecar_process_*), for the idle-daemon budget
            ProcessCollector(namespace="pinsidecar", registry=self.registry)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # -- what the supervisor reports (its BootObserver protocol)
    def on_state(self, state: str) -> None:
        """The engine's state, one of :data:`~pinsidecar.metrics.ENGINE_STATES`."""
        self.daemon.set_state(state)

    def on_boot(self, *, reason: str, seconds: float, map_hash: str, cache_miss: bool) -> None:
        """A boot reached ready after ``seconds``; ``cache_miss`` when it was much slower than the last one."""
        self.daemon.record_boot(reason, seconds, map_hash, cache_miss)

    def on_map(self, emap: ExpertMap) -> None:
        """The engine now serves ``emap`` (its predicted cold ratio feeds the drift alert)."""
        self.daemon.set_map(emap.content_hash, emap.label, emap.created_at, emap.predicted_cold_rate)

    # -- what the remap pipeline reports
    def record_remap(self, outcome: str, seconds: float | None = None) -> None:
        """A remap ended: ``outcome`` is one of :data:`~pinsidecar.metrics.remap.REMAP_OUTCOMES` (committed,
        rolled_back, refused, aborted, dry_run); ``seconds`` from its start, when known."""
        self.remaps.record(outcome, seconds)

    def record_apply_request(self, result: str, *, seconds: float | None = None, rows: int = 0,
                             bytes_moved: int = 0) -> None:
        """An apply request came to ``result`` (applied, refused, failed, timeout, engine_died); an applied one
        held the engine's step ``seconds`` and swapped ``rows`` rows (``bytes_moved`` bytes)."""
        self.remaps.record_apply_request(result, seconds=seconds, rows=rows, bytes_moved=bytes_moved)

    def record_apply_outcome(self, outcome: str) -> None:
        """A remap's in-place deploy ended: applied, rolled_back, fell_back_reboot or engine_died."""
        self.remaps.record_apply_outcome(outcome)

    # -- serving
    def start_http(self, addr: str, port: int) -> None:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread (prometheus_client's WSGI server)."""
        from prometheus_client import start_http_server

        if self._server is not None:
            raise RuntimeError("metrics HTTP server already started")
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        log.info("metrics server listening", addr=addr, port=self.port)

    @property
    def port(self) -> int | None:
        return None if self._server is None else int(self._server.server_address[1])

    def stop(self) -> None:
        self.engine.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server, self._thread = None, None

    def render(self) -> bytes:
        """The exposition text a scrape would get now (Prometheus text format 0.0.4)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

"""What the daemon itself knows and tells the exporter: the engine's state, its boots, the active map.

These are not read from a source at scrape time: the supervisor reports them as they happen (through the
exporter's ``on_state`` / ``on_boot`` / ``on_map``, its side of the supervisor's ``BootObserver`` protocol), and
this collector keeps them for the next scrape. Thread-safe: the daemon's event loop writes, the metrics server's
threads read.
"""

from __future__ import annotations

import calendar
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

__all__: list[str] = []  # nothing here is another package's business

# The states pinsidecar_engine_state exports. The supervisor folds its own finer states into these
# (pinsidecar.daemon.supervisor.EngineState.EXPORTED: unhealthy -> restarting, stopping -> stopped).
ENGINE_STATES = ("starting", "ready", "draining", "restarting", "failed", "stopped")
# Start-to-ready seconds: CPU demo boots take 7-25 s, a cache-hit GPU reboot of a large MoE model a minute or two,
# a cold compile many minutes.
BOOT_DURATION_BUCKETS_S = (5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0, 1800.0)


@dataclass(frozen=True)
class _MapState:
    hash: str
    label: str
    created_at: str
    created_ts: float | None
    predicted_cold_ratio: float | None


@dataclass(frozen=True)
class _LastBoot:
    reason: str
    seconds: float
    map_hash: str
    cache_miss: bool


def _parse_utc(stamp: str) -> float | None:
    """The artifacts' ``YYYY-MM-DDTHH:MM:SSZ`` as epoch seconds (None when empty or not in that form)."""
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))
    except (ValueError, TypeError):
        return None


def _fmt_bound(b: float) -> str:
    return repr(float(b))


class DaemonStateCollector:
    """Engine state, boots (by reason, cache misses, a duration histogram, the last one) and the active map (the
    remaps are :class:`~pinsidecar.metrics.remap.RemapCollector`'s). The setters validate their input and raise
    ``ValueError`` on nonsense."""

    def __init__(self, *, wall_clock: Callable[[], float] = time.time) -> None:
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self.state = "stopped"
        self.boots: dict[str, int] = {}
        self.cache_misses = 0
        self.boot_buckets = [0] * len(BOOT_DURATION_BUCKETS_S)
        self.boot_count = 0
        self.boot_sum = 0.0
        self.last_boot: _LastBoot | None = None
        self.map: _MapState | None = None

    def set_state(self, state: str) -> None:
        if state not in ENGINE_STATES:
            raise ValueError(f"unknown engine state {state!r}; expected one of {ENGINE_STATES}")
        with self._lock:
            self.state = state

    def record_boot(self, reason: str, seconds: float, map_hash: str, cache_miss: bool) -> None:
        if not reason:
            raise ValueError("boot reason must be a non-empty string")
        if not seconds >= 0 or math.isinf(seconds):
            raise ValueError(f"boot seconds must be a finite number >= 0, got {seconds!r}")
        with self._lock:
            self.boots[reason] = self.boots.get(reason, 0) + 1
            self.cache_misses += int(bool(cache_miss))
            for i, bound in enumerate(BOOT_DURATION_BUCKETS_S):
                if seconds <= bound:
                    self.boot_buckets[i] += 1
            self.boot_count += 1
            self.boot_sum += seconds
            self.last_boot = _LastBoot(reason, float(seconds), map_hash, bool(cache_miss))

    def set_map(self, hash: str, label: str, created_at: str, predicted_cold_ratio: float | None = None) -> None:
        with self._lock:
            self.map = _MapState(hash, label, created_at, _parse_utc(created_at), predicted_cold_ratio)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            state, boots, misses = self.state, dict(self.boots), self.cache_misses
            buckets, count, total = list(self.boot_buckets), self.boot_count, self.boot_sum
            last, emap = self.last_boot, self.map
        states = GaugeMetricFamily("pinsidecar_engine_state", "1 for the engine's current state, 0 for the others.",
                                   labels=["state"])
        for s in ENGINE_STATES:
            states.add_metric([s], 1.0 if s == state else 0.0)
        yield states
        by_reason = CounterMetricFamily("pinsidecar_engine_boots", "Engine boots by reason.", labels=["reason"])
        for reason in sorted(boots):
            by_reason.add_metric([reason], boots[reason])
        yield by_reason
        yield CounterMetricFamily("pinsidecar_engine_boot_cache_misses",
                                  "Boots much slower than the last one with the same geometry (compile cache miss).",
                                  value=misses)
        yield HistogramMetricFamily(
            "pinsidecar_engine_boot_duration_seconds", "Seconds from engine start to ready.",
            buckets=[*((_fmt_bound(b), c) for b, c in zip(BOOT_DURATION_BUCKETS_S, buckets, strict=True)),
                     ("+Inf", count)],
            sum_value=total)
        if last is not None:
            yield GaugeMetricFamily("pinsidecar_engine_last_boot_duration_seconds",
                                    "Seconds from start to ready of the last engine boot.", value=last.seconds)
            info = InfoMetricFamily("pinsidecar_engine_last_boot", "The last engine boot.", labels=[])
            info.add_metric([], {"reason": last.reason, "map_hash": last.map_hash,
                                 "cache_miss": str(last.cache_miss).lower()})
            yield info
        if emap is not None:
            info = InfoMetricFamily("pinsidecar_map", "The row map the daemon activated.", labels=[])
            info.add_metric([], {"hash": emap.hash, "label": emap.label})
            yield info
            if emap.created_ts is not None:
                yield GaugeMetricFamily("pinsidecar_map_created_timestamp_seconds",
                                        "When the active map was built (Unix time).", value=emap.created_ts)
                yield GaugeMetricFamily("pinsidecar_map_age_seconds", "Seconds since the active map was built.",
                                        value=max(0.0, self._wall_clock() - emap.created_ts))
            if emap.predicted_cold_ratio is not None:
                yield GaugeMetricFamily("pinsidecar_map_predicted_cold_selection_ratio",
                                        "The cold-selection ratio the active map predicted on its source counts.",
                                        value=emap.predicted_cold_ratio)

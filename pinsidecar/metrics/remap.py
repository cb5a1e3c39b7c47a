"""The remaps as metrics: how each one ended and how long it took (reported), and the one running now (live).

Outcomes and durations are reported by the remap pipeline as each remap ends, through the exporter's
:meth:`~pinsidecar.metrics.Exporter.record_remap`; the remap in progress is a live input read at scrape time (the
pipeline's current record as a dict, or None), so ``pinsidecar_remap_running_seconds`` keeps growing while a remap
hangs, which is what the "remap stalled" alert needs and what a pushed gauge could not show.

``pinsidecar_remaps_total{outcome}`` starts with every known outcome at 0: a series that appears only with its
first remap (at 1) has no *change* for ``changes()``/``increase()`` to see, and the dashboard's remap annotations
and the "refused repeatedly" alert would miss the first one. Cardinality: ``outcome`` and ``state`` are fixed
sets; ``trigger`` has four values (drift, alert, manual, timer).
"""

from __future__ import annotations

import calendar
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

__all__ = ["REMAP_DURATION_BUCKETS_S", "REMAP_OUTCOMES", "REMAP_STATES", "REMAP_TERMINAL_STATES", "RemapCollector"]

# How a remap ends (the label values of pinsidecar_remaps_total); "dry_run" is a decision that changed nothing.
REMAP_OUTCOMES = ("committed", "rolled_back", "refused", "aborted", "dry_run")
# The pipeline's non-terminal states, in order, and the terminal ones (the remap record's "state").
REMAP_STATES = ("choosing_workload", "library_check", "count_boot", "building", "evaluating", "rebooting",
                "verifying")
REMAP_TERMINAL_STATES = ("committed", "rolled_back", "refused", "aborted")
# Start-to-end seconds: a dry run or a library hit takes seconds, a CPU-demo remap (count boot + reboot) 1-2 min,
# a GPU remap of a large MoE model (count boot, cache-hit reboot, verification) 5-30 min.
REMAP_DURATION_BUCKETS_S = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)


def _epoch(stamp: Any) -> float | None:
    """A record's time as epoch seconds: a number, or ``YYYY-MM-DDTHH:MM:SS[.fff][Z|+00:00]`` (UTC)."""
    if isinstance(stamp, int | float) and not isinstance(stamp, bool):
        return float(stamp)
    if not isinstance(stamp, str) or not stamp:
        return None
    text = stamp.removesuffix("Z").removesuffix("+00:00")
    base, _, frac = text.partition(".")
    try:
        t = float(calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None
    return t + (float(f"0.{frac}") if frac.isdigit() else 0.0)


class RemapCollector:
    """``pinsidecar_remaps_total{outcome}``, ``pinsidecar_remap_duration_seconds``,
    ``pinsidecar_remap_last_end_timestamp_seconds``, and from ``current()`` (the running remap's record, or None):
    ``pinsidecar_remap_running``, ``pinsidecar_remap_state{state,trigger}``, ``pinsidecar_remap_running_seconds``.
    Thread-safe: the daemon's loop reports, the metrics server's threads read."""

    def __init__(self, current: Callable[[], Mapping[str, Any] | None] = lambda: None, *,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.current = current
        self.wall_clock = wall_clock
        self._lock = threading.Lock()
        self.outcomes: dict[str, int] = dict.fromkeys(REMAP_OUTCOMES, 0)
        self.buckets = [0] * len(REMAP_DURATION_BUCKETS_S)
        self.count = 0
        self.sum = 0.0
        self.last_end: float | None = None

    def record(self, outcome: str, seconds: float | None = None) -> None:
        """A remap ended with ``outcome`` after ``seconds`` (None: not measured, no duration sample)."""
        if not outcome:
            raise ValueError("remap outcome must be a non-empty string")
        if seconds is not None and (not seconds >= 0 or math.isinf(seconds)):
            raise ValueError(f"remap seconds must be a finite number >= 0, got {seconds!r}")
        with self._lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            self.last_end = self.wall_clock()
            if seconds is not None:
                for i, bound in enumerate(REMAP_DURATION_BUCKETS_S):
                    if seconds <= bound:
                        self.buckets[i] += 1
                self.count += 1
                self.sum += seconds

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            outcomes, buckets, count, total = dict(self.outcomes), list(self.buckets), self.count, self.sum
            last_end = self.last_end
        fam = CounterMetricFamily("pinsidecar_remaps", "Remaps by outcome (dry runs included).", labels=["outcome"])
        for outcome in sorted(outcomes):
            fam.add_metric([outcome], outcomes[outcome])
        yield fam
        yield HistogramMetricFamily(
            "pinsidecar_remap_duration_seconds", "Seconds from a remap's start to its end (any outcome).",
            buckets=[*((repr(float(b)), c) for b, c in zip(REMAP_DURATION_BUCKETS_S, buckets, strict=True)),
                     ("+Inf", count)],
            sum_value=total)
        if last_end is not None:
            yield GaugeMetricFamily("pinsidecar_remap_last_end_timestamp_seconds",
                                    "When the last remap ended (Unix time).", value=last_end)
        yield from self._running()

    def _running(self) -> Iterator[Metric]:
        rec = self.current()
        state = str(rec.get("state", "")) if rec is not None else ""
        running = rec is not None and state not in REMAP_TERMINAL_STATES
        yield GaugeMetricFamily("pinsidecar_remap_running", "1 while a remap is in a non-terminal state.",
                                value=1.0 if running else 0.0)
        if not running or rec is None:
            return
        fam = GaugeMetricFamily("pinsidecar_remap_state", "1 for the running remap's state, 0 for the others.",
                                labels=["state", "trigger"])
        trigger = str(rec.get("trigger", ""))
        for s in REMAP_STATES:
            fam.add_metric([s, trigger], 1.0 if s == state else 0.0)
        yield fam
        started = _epoch(rec.get("started_at"))
        if started is not None:
            yield GaugeMetricFamily("pinsidecar_remap_running_seconds", "Seconds since the running remap started.",
                                    value=max(0.0, self.wall_clock() - started))

"""The remaps as metrics: how each one ended and how long it took (reported), and the one running now (live).

Outcomes and durations are reported by the remap pipeline as each remap ends, through the exporter's
:meth:`~pinsidecar.metrics.Exporter.record_remap`; the remap in progress is a live input read at scrape time (the
pipeline's current record as a dict, or None), so ``pinsidecar_remap_running_seconds`` keeps growing while a remap
hangs, which is what the "remap stalled" alert needs and what a pushed gauge could not show.

**In-place deploys** (:mod:`pinsidecar.remap.apply`), reported as they happen:

- ``pinsidecar_remap_apply_total{outcome}`` — once per remap that tried to deploy in place: ``applied`` (the
  candidate stayed and was committed), ``rolled_back`` (applied, then parity or verification failed and the old
  map came back), ``fell_back_reboot`` (not applied in place: another geometry, or the hook refused, failed or
  did not answer; the drain-reboot deployed it), ``engine_died`` (the engine died mid-apply);
- ``pinsidecar_remap_apply_requests_total{result}`` — every apply request the hook was sent (a rollback's too):
  ``applied``, ``refused``, ``failed``, ``timeout``, ``engine_died``;
- ``pinsidecar_remap_apply_seconds`` — histogram of how long an applied request held the engine's step (how long
  serving stood still), as the hook measured it; ``pinsidecar_remap_apply_last_seconds`` the last one;
- ``pinsidecar_remap_apply_rows_swapped_total`` and ``pinsidecar_remap_apply_bytes_moved_total`` — expert rows
  swapped between the tiers and the bytes copied (both directions) by applied requests.

``pinsidecar_remaps_total{outcome}`` (and the apply counters) start with every known label at 0: a series that
appears only with its first remap (at 1) has no *change* for ``changes()``/``increase()`` to see, and the
dashboard's remap annotations and the "refused repeatedly" alert would miss the first one. Cardinality:
``outcome``, ``result`` and ``state`` are fixed sets; ``trigger`` has four values (drift, alert, manual, timer).
"""

from __future__ import annotations

import calendar
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

__all__: list[str] = []  # nothing here is another package's business

# How a remap ends (the label values of pinsidecar_remaps_total); "dry_run" is a decision that changed nothing,
# "commit_failed" a verified map whose active-map.json could not be written (the old map was put back).
REMAP_OUTCOMES = ("committed", "rolled_back", "refused", "aborted", "commit_failed", "dry_run")
# The pipeline's non-terminal states, in order, and the terminal ones (the remap record's "state").
REMAP_STATES = ("choosing_workload", "library_check", "count_boot", "building", "evaluating", "applying",
                "rebooting", "verifying")
REMAP_TERMINAL_STATES = ("committed", "rolled_back", "refused", "aborted", "commit_failed")
# Start-to-end seconds: a dry run or a library hit takes seconds, a CPU-demo remap (count boot + reboot) 1-2 min,
# a GPU remap of a large MoE model (count boot, cache-hit reboot, verification) 5-30 min.
REMAP_DURATION_BUCKETS_S = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)
# How an in-place deploy ended, and what one apply request came to (pinsidecar.remap.apply, which the metrics do
# not import: the daemon's layers import downwards).
APPLY_OUTCOMES = ("applied", "rolled_back", "fell_back_reboot", "engine_died")
APPLY_REQUEST_RESULTS = ("applied", "refused", "failed", "timeout", "engine_died")
# Seconds an apply held the engine's step: the demo model's apply is milliseconds, a large model's copies of
# tens of GB over the host link take seconds; remap.apply_timeout_s (60 s by default) bounds it.
APPLY_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
    ``pinsidecar_remap_last_end_timestamp_seconds``, the ``pinsidecar_remap_apply*`` series, and from
    ``current()`` (the running remap's record, or None): ``pinsidecar_remap_running``,
    ``pinsidecar_remap_state{state,trigger}``, ``pinsidecar_remap_running_seconds``.
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
        self.apply_outcomes: dict[str, int] = dict.fromkeys(APPLY_OUTCOMES, 0)
        self.apply_requests: dict[str, int] = dict.fromkeys(APPLY_REQUEST_RESULTS, 0)
        self.apply_buckets = [0] * len(APPLY_SECONDS_BUCKETS)
        self.apply_count = 0
        self.apply_sum = 0.0
        self.apply_last: float | None = None
        self.rows_swapped = 0
        self.bytes_moved = 0

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

    def record_apply_request(self, result: str, *, seconds: float | None = None, rows: int = 0,
                             bytes_moved: int = 0) -> None:
        """One apply request came to ``result``; an applied one held the engine's step ``seconds`` and swapped
        ``rows`` rows, moving ``bytes_moved`` bytes."""
        if not result:
            raise ValueError("apply result must be a non-empty string")
        if seconds is not None and (not seconds >= 0 or math.isinf(seconds)):
            raise ValueError(f"apply seconds must be a finite number >= 0, got {seconds!r}")
        if rows < 0 or bytes_moved < 0:
            raise ValueError(f"apply rows and bytes must be >= 0, got {rows}, {bytes_moved}")
        with self._lock:
            self.apply_requests[result] = self.apply_requests.get(result, 0) + 1
            self.rows_swapped += rows
            self.bytes_moved += bytes_moved
            if seconds is not None:
                for i, bound in enumerate(APPLY_SECONDS_BUCKETS):
                    if seconds <= bound:
                        self.apply_buckets[i] += 1
                self.apply_count += 1
                self.apply_sum += seconds
                self.apply_last = seconds

    def record_apply_outcome(self, outcome: str) -> None:
        """A remap's in-place deploy ended with ``outcome`` (see the module docstring)."""
        if not outcome:
            raise ValueError("apply outcome must be a non-empty string")
        with self._lock:
            self.apply_outcomes[outcome] = self.apply_outcomes.get(outcome, 0) + 1

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
        yield from self._apply()
        yield from self._running()

    def _apply(self) -> Iterator[Metric]:
        with self._lock:
            outcomes, requests = dict(self.apply_outcomes), dict(self.apply_requests)
            buckets, count, total, last = list(self.apply_buckets), self.apply_count, self.apply_sum, self.apply_last
            rows, moved = self.rows_swapped, self.bytes_moved
        fam = CounterMetricFamily("pinsidecar_remap_apply", "In-place deploys by how they ended (applied, "
                                  "rolled_back, fell_back_reboot, engine_died).", labels=["outcome"])
        for outcome in sorted(outcomes):
            fam.add_metric([outcome], outcomes[outcome])
        yield fam
        fam = CounterMetricFamily("pinsidecar_remap_apply_requests", "Apply requests sent to the hook, by result.",
                                  labels=["result"])
        for result in sorted(requests):
            fam.add_metric([result], requests[result])
        yield fam
        yield HistogramMetricFamily(
            "pinsidecar_remap_apply_seconds", "Seconds an applied request held the engine's step (serving stood "
            "still), as the hook measured it.",
            buckets=[*((repr(float(b)), c) for b, c in zip(APPLY_SECONDS_BUCKETS, buckets, strict=True)),
                     ("+Inf", count)],
            sum_value=total)
        if last is not None:
            yield GaugeMetricFamily("pinsidecar_remap_apply_last_seconds",
                                    "Seconds the last applied request held the engine's step.", value=last)
        yield CounterMetricFamily("pinsidecar_remap_apply_rows_swapped",
                                  "Expert rows swapped between the tiers by applied requests.", value=rows)
        yield CounterMetricFamily("pinsidecar_remap_apply_bytes_moved",
                                  "Bytes copied between the tiers by applied requests (both directions).",
                                  value=moved)

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

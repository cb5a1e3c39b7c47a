"""The drift watch of one engine: stats readings -> windows -> signals -> detector -> one record per window.

:class:`DriftWatch` is the one object the daemon holds and ``pinsidecar drift replay`` drives, so both run the
same code: the daemon feeds it every stats reading (:meth:`DriftWatch.feed_reading`) and polls it on a timer
(:meth:`DriftWatch.poll`, which closes a quiet engine's window by time); replay hands it recorded windows
(:meth:`DriftWatch.observe`). It keeps what the signals need between windows: the active map, the reference
counts for the divergence, and the previous judged window (the out-of-sample candidate is built from it). It does
no I/O; the remap pipeline reads :meth:`DriftWatch.held_out_window` to judge a candidate and reports back with
:meth:`DriftWatch.remap_finished`.

It also says how its input looks (``status()["stats"]``): how long since a new stats write arrived (monotonic
seconds: a hook that stopped writing leaves the watch blind, and it must say so rather than look steady), how many
engine restarts the counters went back over, and why the file could not be read, if it could not.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from pinsidecar_hook.contract import ArtifactError, CountsArtifact, ExpertMap

from pinsidecar.drift.config import DriftConfig
from pinsidecar.drift.detector import DriftDetector, WindowRecord
from pinsidecar.drift.signals import Signals, compute_signals
from pinsidecar.drift.windows import LiveSample, LiveWindows, Window, sample_from_reading

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

# Closed windows kept for the pipeline (held-out candidates) and records kept for status: a few minutes of demo
# traffic; the daemon's metrics only need the last one.
KEEP_WINDOWS = 16
KEEP_RECORDS = 256
# No new stats write for this long while the engine serves: the watch is blind. The same bound as the
# PinsidecarStatsStale alert (grafana/alerts.yml), so status and the alert agree.
STATS_STALE_S = 120.0


class DriftWatch:
    """See the module docstring. ``reference``: the counts the active map was built from (summed), if known;
    without them the first judged window under the map stands in for the divergence."""

    def __init__(self, config: DriftConfig, active: ExpertMap, *, reference: CountsArtifact | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.windows = LiveWindows.from_config(config, clock=clock)
        self.detector = DriftDetector(config, clock=clock)
        self.active = active
        self.reference: CountsArtifact | Window | None = reference
        self.reference_kind = "source counts" if reference is not None else ""
        self.previous: Window | None = None
        self.recent: deque[Window] = deque(maxlen=KEEP_WINDOWS)
        self.records: deque[WindowRecord] = deque(maxlen=KEEP_RECORDS)
        self._stats: dict[str, Any] = {"boot_id": None, "seq": None, "restarts": 0, "error": None}
        self._stats_changed_at: float | None = None

    # ----------------------------------------------------------------------------------------------- feeding
    def feed(self, sample: LiveSample) -> list[WindowRecord]:
        """One stats reading's deltas; returns the records of the windows it closed (usually none)."""
        return [self.observe(w) for w in self.windows.feed(sample)]

    def feed_reading(self, reading: Any, now: float | None = None, error: str | None = None) -> list[WindowRecord]:
        """A :class:`~pinsidecar.live_stats.StatsReading` (None, from a missing or unreadable stats file, feeds
        nothing); ``error``: the reader's reason when the file could not be read (shown in the status)."""
        self._note_stats(reading, error, self.clock() if now is None else now)
        if reading is None:
            return []
        return self.feed(sample_from_reading(reading, now))

    def _note_stats(self, reading: Any, error: str | None, now: float) -> None:
        st = self._stats
        st["error"] = error if reading is None else None
        if reading is None:
            return
        snap = reading.snapshot
        if (snap.boot_id, snap.seq) != (st["boot_id"], st["seq"]):
            st["restarts"] += int(bool(reading.restarted) and not reading.first)
            st["boot_id"], st["seq"] = snap.boot_id, snap.seq
            self._stats_changed_at = now

    def poll(self, now: float | None = None) -> list[WindowRecord]:
        """Close a quiet engine's window once its time cap has passed; call it on the daemon's timer."""
        return [self.observe(w) for w in self.windows.poll(now)]

    def observe(self, window: Window, now: float | None = None) -> WindowRecord:
        """Judge one closed window (live, or recorded in replay) and return its record."""
        now = window.ended if now is None else now
        signals: Signals | None = None
        extra = {"active_map": self.active.content_hash, "active_label": self.active.label}
        try:
            signals = compute_signals(window, self.active, self.config, reference=self.reference,
                                      reference_kind=self.reference_kind, previous=self.previous)
        except ArtifactError as exc:
            log.warning("drift_window_skipped", window=window.index, error=str(exc))
            extra["error"] = str(exc)
        record = self.detector.observe(window, signals, now, extra)
        self.records.append(record)
        self.recent.append(window)
        if window.judgeable(self.config.min_tokens) and window.histogram is not None and signals is not None:
            self.previous = window
            if self.reference is None:
                self.reference, self.reference_kind = window, "first window"
        return record

    # -------------------------------------------------------------------------------------------- the remap
    def held_out_window(self, exclude: Iterable[str] = ()) -> Window | None:
        """The most recent judged window whose counts are not in ``exclude`` (digests, e.g. a candidate's
        ``source_counts``): what :func:`~pinsidecar.remap.decision.decide` judges a candidate on."""
        skip = set(exclude)
        for w in reversed(self.recent):
            if w.histogram is not None and w.judgeable(self.config.min_tokens) and w.to_counts().digest() not in skip:
                return w
        return None

    def set_active_map(self, emap: ExpertMap, reference: CountsArtifact | None = None) -> None:
        """The engine now serves ``emap`` (built from ``reference``, when known). The previous window is kept: the
        router's picks do not depend on the map, so a candidate can still be built from it."""
        self.active = emap
        self.reference = reference
        self.reference_kind = "source counts" if reference is not None else ""

    def remap_finished(self, deployed: bool, new_map: ExpertMap | None = None,
                       reference: CountsArtifact | None = None, now: float | None = None) -> None:
        """The remap a trip started is over; with ``deployed`` and ``new_map`` the engine now serves it."""
        if deployed and new_map is not None:
            self.set_active_map(new_map, reference)
        self.detector.remap_finished(deployed, now)

    # ------------------------------------------------------------------------------------------------ status
    @property
    def last_record(self) -> WindowRecord | None:
        return self.records[-1] if self.records else None

    def status(self, now: float | None = None) -> dict[str, Any]:
        """What the daemon's status and metrics show: the detector's state and the last window's signals."""
        now = self.clock() if now is None else now
        last = self.last_record
        changed = self._stats_changed_at
        unchanged = None if changed is None else round(max(0.0, now - changed), 3)
        stats = {**self._stats, "unchanged_s": unchanged, "stale": unchanged is not None and unchanged >= STATS_STALE_S}
        return {**self.detector.snapshot(now), "active_map": self.active.content_hash,
                "open_window_tokens": self.windows.open_tokens,
                "last_window": last.as_dict() if last else None,
                "status": last.status if last else "no window closed yet", "stats": stats}

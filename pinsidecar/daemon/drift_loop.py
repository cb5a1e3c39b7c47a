"""The daemon's drift loop: read the engine's live stats on a timer, feed the drift watch, ask for a remap on a trip.

Pin mode only, and only when the engine writes a live stats file (``PINSIDECAR_STATS_PATH``). The loop holds the
daemon's one :class:`~pinsidecar.drift.DriftWatch` (the exporter, status and the remap pipeline read it) and a
:class:`~pinsidecar.live_stats.StatsReader` of its own: the exporter reads the same file at scrape time with
another, and a scrape must not move the watch's windows.

What the loop asks of the rest of the daemon is two callables, given at construction: the one remap entry every
trigger goes through (:meth:`~pinsidecar.daemon.service.Daemon.request_remap`: cooldown, daily cap, one remap at a
time) and whether a remap is running. A trip that entry refuses is logged, and the detector is told no remap runs,
so it can trip again after the cooldown. The watch must never take the daemon down: a failing tick is logged and
the next one runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import structlog
from pinsidecar_hook.contract import ExpertMap

from pinsidecar.drift import DriftWatch, WindowRecord
from pinsidecar.drift.config import DriftConfig
from pinsidecar.errors import ControlError
from pinsidecar.live_stats import StatsReader
from pinsidecar.remap import admission
from pinsidecar.remap.candidates import reference_counts
from pinsidecar.remap.record import RemapRecord

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)


class RemapEntry(Protocol):
    """The daemon's one remap entry, as a trip calls it; raises :class:`~pinsidecar.errors.ControlError` when it
    refuses (a remap running, the cooldown, the daily cap)."""

    async def __call__(self, *, trigger: str, reason: str = "", detail: dict[str, Any] | None = None
                       ) -> dict[str, Any]: ...


class DriftLoop:
    """The drift watch of one daemon, and the task that feeds it (:meth:`start`)."""

    def __init__(self, request_remap: RemapEntry, remap_running: Callable[[], bool]) -> None:
        self.request_remap = request_remap
        self.remap_running = remap_running
        self.watch: DriftWatch | None = None  # None until started (and for good outside pin mode)
        self.reader: StatsReader | None = None
        self.interval_s = 0.0

    @property
    def stats_path(self) -> Path | None:
        """The hook's live stats file the loop reads, None while it does not run."""
        return self.reader.path if self.reader is not None else None

    def start(self, config: DriftConfig, interval_s: float, stats_path: Path, served_path: Path | None,
              served: ExpertMap, history: Iterable[RemapRecord]) -> asyncio.Task[None]:
        """Watch ``served`` (its counts beside ``served_path`` as the divergence's reference) on ``stats_path``
        every ``interval_s``; the remaps of ``history`` count against the cooldown and the daily cap (a restart
        keeps them). Returns the loop's task (the daemon cancels it at shutdown)."""
        self.watch = DriftWatch(config, served, reference=reference_counts(served_path, served))
        seeded = admission.seed_from_history(self.watch.detector, history)
        self.reader = StatsReader(stats_path)
        self.interval_s = interval_s
        log.info("drift_watch_started", map=served.short_hash, label=served.label, stats=str(stats_path),
                 reference=self.watch.reference_kind or "first window", remaps_last_day=seeded)
        return asyncio.create_task(self._run(), name="drift-watch")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception as exc:  # the watch must never take the daemon down
                log.exception("drift_watch_failed", error=str(exc))

    async def tick(self, now: float | None = None) -> list[WindowRecord]:
        """One look at the live stats: feed the drift watch, log each closed window, ask for a remap on a trip."""
        watch, reader = self.watch, self.reader
        if watch is None or reader is None:
            return []
        reading = reader.read()
        records = watch.feed_reading(reading, now, error=reader.last_error) + watch.poll(now)
        for rec in records:
            sig = rec.signals
            log.info("drift_window", index=rec.index, tokens=rec.window.get("tokens"), judged=rec.judged,
                     state=rec.state, gain=None if sig is None else sig.projected_gain,
                     cold_rate=None if sig is None else sig.cold_rate, trip=rec.trip, status=rec.status)
            if rec.trip:
                await self._trip(rec)
        return records

    async def _trip(self, rec: WindowRecord) -> None:
        try:
            await self.request_remap(trigger="drift", reason=rec.status,
                                     detail={"window": rec.index, "signals": rec.as_dict().get("signals")})
        except ControlError as exc:
            log.warning("drift_remap_not_started", status=exc.status, reason=str(exc))
            if self.watch is not None and not self.remap_running():
                self.watch.detector.remap_finished(False)  # the trip marked a remap as running

    def follow_map(self, path: Path, emap: ExpertMap) -> None:
        """The engine serves ``emap`` now (a switch or an apply in place): the watch judges against it."""
        if self.watch is not None:
            self.watch.set_active_map(emap, reference_counts(path, emap))

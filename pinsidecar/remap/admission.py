"""Who may start a remap now: one at a time, and every trigger through the drift config's cooldown and daily cap.

A remap costs a count boot and a reboot, so however it is asked for (the drift detector, an Alertmanager alert,
``pinsidecar remap``, the systemd timer) it passes the same gate. The drift detector (:class:`~pinsidecar.drift.
DriftDetector`) already keeps the cooldown and the cap for its own trips; this module makes the other triggers
check and count against the *same* figures, so an operator's remap starts the cooldown for the detector and the
other way round. There is no force flag: an operator who must bypass waits or edits ``[drift]``.

The detector's bookkeeping lives in memory; :func:`seed_from_history` replays the starts of remaps recorded on disk
into it when the daemon starts, so a restart does not reset the cooldown or the cap. Across a restart the records'
wall-clock start times are all there is; everything after that runs on the detector's monotonic clock.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterable

from pinsidecar.drift.detector import DAY_S, DriftDetector
from pinsidecar.remap.record import RemapRecord

__all__ = ["seed_from_history"]


def blocked(detector: DriftDetector, now: float | None = None) -> str | None:
    """Why a remap may not start now (cooldown or daily cap), or None. Checks the running remap elsewhere: the
    daemon knows which one it is and names it."""
    now = detector.clock() if now is None else now
    cfg = detector.config
    left = detector.cooldown_left(now)
    if left > 0:
        return f"cooldown: {left:.0f} s left (drift.cooldown_s = {cfg.cooldown_s:.0f} s since the last remap)"
    n = detector.remaps_last_day(now)
    if n >= cfg.max_remaps_per_day:
        return (f"daily cap of {cfg.max_remaps_per_day} remaps reached ({n} in the last 24 h; "
                "drift.max_remaps_per_day)")
    return None


def note_started(detector: DriftDetector, now: float | None = None) -> None:
    """A remap not started by the detector begins now: count it against the cooldown and the cap, and keep the
    detector from tripping while it runs (as its own trip does)."""
    detector.remap_started(now)


def _epoch(stamp: str) -> float | None:
    try:
        return calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, TypeError):
        return None


def seed_from_history(detector: DriftDetector, records: Iterable[RemapRecord], *, wall_now: float | None = None,
                      now: float | None = None) -> int:
    """Count the remaps recorded in the last 24 h against the detector's cooldown and cap (after a restart).
    Returns how many were counted."""
    wall_now = time.time() if wall_now is None else wall_now
    now = detector.clock() if now is None else now
    starts = []
    for rec in records:
        started = _epoch(rec.started_at)
        if rec.dry_run or started is None:
            continue
        # A start "in the future" means the wall clock was set back since: count it as starting now (the cooldown
        # is kept, never skipped by a clock step). Older than a day: no longer counts.
        age = max(0.0, wall_now - started)
        if age >= DAY_S:
            continue
        starts.append(now - age)
    for t in sorted(starts):
        detector.count_past_remap(t)
    return len(starts)

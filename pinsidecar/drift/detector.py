"""The drift detector: a small state machine over per-window signals that says when a remap should start.

It trips on the **projected gain** only (signal c, see signals.py); the live cold rate and the divergence are
recorded beside it to explain a trip, never to cause one. The rules, and why each is there:

- **min tokens**: a window with fewer than ``min_tokens`` is recorded, not judged (it neither advances nor
  breaks a streak): a quiet minute says nothing about whether traffic moved.
- **no exploitable skew never trips**: on a near-uniform router no map helps, whatever the gain's noise says.
- **never on a gain under the margin**: the level a window must reach is ``max(trip_gain, margin)``, so nothing
  the deploy decision would refuse can start a remap.
- **consecutive windows**: one window above the level is a fluke as often as a shift; ``consecutive_windows``
  in a row is a shift.
- **hysteresis**: once drifted, the detector stays drifted until the gain falls below ``clear_gain`` (lower than
  the trip level), so a gain hovering around the trip level does not flap between states and alerts.
- **cooldown and daily cap**: at most one remap start per ``cooldown_s``, and ``max_remaps_per_day`` in any 24 h;
  a remap costs a count boot and a reboot, and a loop that remaps on every window is worse than none. A trip
  blocked by either is recorded with the reason, and fires once the block lifts if the drift is still there.
- **one remap at a time**: after a trip the detector waits for :meth:`DriftDetector.remap_finished`; a deployed
  map starts a fresh steady state, a refused or failed one leaves it drifted (it may trip again after the
  cooldown).

Time is monotonic seconds from an injected ``clock``. Each window yields a :class:`WindowRecord`: the signals, the
state after the window, whether it tripped and, if not, why not.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from pinsidecar.drift.config import DriftConfig
from pinsidecar.drift.signals import NO_SKEW, Signals
from pinsidecar.drift.windows import Window

__all__ = ["DAY_S", "STATES", "DriftDetector"]

log = structlog.get_logger(__name__)

DAY_S = 86400.0
# steady: no drift; rising: judged windows at or above the trip level, not yet enough in a row; drifted: drift
# confirmed (a remap started, or was blocked by the cooldown or the cap), until the gain falls below clear_gain.
STATES = ("steady", "rising", "drifted")


@dataclass(frozen=True)
class WindowRecord:
    """What one window did to the detector: its signals, the state after it, and whether it tripped."""

    index: int
    window: dict[str, Any]
    signals: Signals | None
    judged: bool
    state: str
    streak: int
    trip: bool
    why_not: str | None  # None when trip is True
    remap_running: bool
    cooldown_left_s: float
    remaps_last_day: int
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the active map's hash and label

    @property
    def status(self) -> str:
        """One line for a person (and the daemon's status): the trip, or why not."""
        if self.trip:
            return f"drift: remap started ({self.signals.status if self.signals else ''})"
        return f"{self.state}: {self.why_not}"

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "window": self.window,
                "signals": self.signals.as_dict() if self.signals else None, "judged": self.judged,
                "state": self.state, "streak": self.streak, "trip": self.trip, "why_not": self.why_not,
                "status": self.status, "remap_running": self.remap_running,
                "cooldown_left_s": round(self.cooldown_left_s, 3), "remaps_last_day": self.remaps_last_day,
                **self.extra}


def _pts(x: float) -> str:
    return f"{100 * x:.2f} pts"


class DriftDetector:
    """Feed it one (window, signals) pair per closed window with :meth:`observe`; it says when to remap.

    The daemon (and ``drift replay``) calls :meth:`remap_finished` when the remap the trip started has ended,
    deployed or not. Nothing here does I/O.
    """

    def __init__(self, config: DriftConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.state = "steady"
        self.streak = 0
        self.remap_running = False
        self._remap_starts: deque[float] = deque()
        self.last_trip_at: float | None = None

    # ----------------------------------------------------------------------------------------------- queries
    def cooldown_left(self, now: float) -> float:
        if self.last_trip_at is None:
            return 0.0
        return max(0.0, self.config.cooldown_s - (now - self.last_trip_at))

    def remaps_last_day(self, now: float) -> int:
        while self._remap_starts and now - self._remap_starts[0] >= DAY_S:
            self._remap_starts.popleft()
        return len(self._remap_starts)

    def _blocked(self, now: float) -> str | None:
        cfg = self.config
        if not cfg.enabled:
            return "drift remaps are off (drift.enabled = false)"
        if not cfg.auto_remap:
            return "automatic remaps are off (drift.auto_remap = false): alerts and operators remap"
        if self.remap_running:
            return "a remap is already running"
        if cfg.max_remaps_per_day == 0:
            return "automatic remaps are off (drift.max_remaps_per_day = 0)"
        left = self.cooldown_left(now)
        if left > 0:
            return f"cooldown: {left:.0f} s left of {cfg.cooldown_s:.0f} s since the last remap"
        n = self.remaps_last_day(now)
        if n >= cfg.max_remaps_per_day:
            return f"daily cap: {n} remaps in the last 24 h (drift.max_remaps_per_day = {cfg.max_remaps_per_day})"
        return None

    # ----------------------------------------------------------------------------------------------- updates
    def observe(self, window: Window, signals: Signals | None, now: float | None = None,
                extra: dict[str, Any] | None = None) -> WindowRecord:
        """Judge one closed window; returns its record (``trip`` True: start a remap now)."""
        now = self.clock() if now is None else now
        cfg = self.config
        level = cfg.trip_level
        trip = False
        why_not: str | None
        judged = False
        gain = signals.projected_gain if signals is not None else None
        if not window.judgeable(cfg.min_tokens):
            why_not = f"too few tokens ({window.tokens} < drift.min_tokens = {cfg.min_tokens}): not judged"
        elif signals is not None and signals.exploitable_skew is False:
            judged = True
            why_not = (f"{NO_SKEW}: best reachable cold rate {signals.best_cold_rate or 0.0:.2%} is "
                       f"{_pts(signals.skew_gap or 0.0)} below uniform {signals.uniform_cold_rate:.2%} "
                       f"(< drift.skew_margin = {_pts(cfg.skew_margin)})")
            self.streak = 0
            self.state = "steady"
        elif signals is None or gain is None:
            why_not = "; ".join(signals.notes) if signals is not None and signals.notes else "no projected gain"
        else:
            judged = True
            if self.state == "drifted":
                if gain < cfg.clear_gain:
                    self.state, self.streak = "steady", 0
                    why_not = f"cleared: gain {_pts(gain)} < drift.clear_gain = {_pts(cfg.clear_gain)}"
                elif gain < level:
                    why_not = (f"still drifted (gain {_pts(gain)} between clear {_pts(cfg.clear_gain)} and trip "
                               f"{_pts(level)}): no new remap")
                else:
                    blocked = self._blocked(now)
                    trip = blocked is None
                    why_not = None if trip else f"drifted, gain {_pts(gain)}; {blocked}"
            elif gain >= level:
                self.streak += 1
                if self.streak < cfg.consecutive_windows:
                    self.state = "rising"
                    why_not = (f"gain {_pts(gain)} >= trip level {_pts(level)}: {self.streak} of "
                               f"{cfg.consecutive_windows} consecutive windows")
                else:
                    self.state = "drifted"
                    blocked = self._blocked(now)
                    trip = blocked is None
                    why_not = None if trip else f"drift confirmed, gain {_pts(gain)}; {blocked}"
            else:
                self.streak = 0
                self.state = "steady"
                why_not = f"gain {_pts(gain)} < trip level {_pts(level)}"
        if trip:
            self.remap_started(now)
            log.info("drift_trip", window=window.index, gain=gain, streak=self.streak)
        return WindowRecord(
            index=window.index, window=window.summary(), signals=signals, judged=judged, state=self.state,
            streak=self.streak, trip=trip, why_not=why_not, remap_running=self.remap_running,
            cooldown_left_s=self.cooldown_left(now), remaps_last_day=self.remaps_last_day(now),
            extra=dict(extra or {}),
        )

    def remap_started(self, now: float | None = None) -> None:
        """A remap begins now (this detector's trip, or another trigger through the same gate): it counts against
        the cooldown and the daily cap, and no trip happens while it runs."""
        now = self.clock() if now is None else now
        self.remap_running = True
        self.last_trip_at = now
        self._remap_starts.append(now)

    def count_past_remap(self, started: float) -> None:
        """A remap that started at ``started`` (this clock) before a restart still counts against the cooldown and
        the cap."""
        self._remap_starts.append(started)
        self.last_trip_at = started if self.last_trip_at is None else max(self.last_trip_at, started)

    def remap_finished(self, deployed: bool, now: float | None = None) -> None:
        """The remap the last trip started has ended. A deployed map starts a fresh steady state; a refused or
        failed one leaves the detector drifted, so the drift is retried after the cooldown if it persists."""
        self.remap_running = False
        if deployed:
            self.state, self.streak = "steady", 0
        log.info("drift_remap_finished", deployed=deployed, state=self.state)

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """The detector's state for metrics and the status line."""
        now = self.clock() if now is None else now
        return {"state": self.state, "streak": self.streak, "remap_running": self.remap_running,
                "cooldown_left_s": self.cooldown_left(now), "remaps_last_day": self.remaps_last_day(now)}

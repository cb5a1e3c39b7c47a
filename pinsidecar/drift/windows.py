"""Live windows: the hook's cumulative counters cut into windows of recent traffic, sized by tokens.

The drift signals compare *recent* routing with what the active map was built for, so they need windows: per-layer
x per-expert selection histograms of the traffic since some point. :class:`LiveWindows` builds them from the
deltas of successive stats readings (one :class:`LiveSample` per reading; :func:`sample_from_reading` adapts a
:class:`~pinsidecar.live_stats.StatsReading`). The rules, and why:

- **closed by tokens** (``window_tokens``): a window is a sample of traffic, and how much it says depends on how
  many tokens it holds, not how long it took. A busy engine closes windows fast, a quiet one slowly, each with the
  same statistical weight.
- **a time cap** (``max_window_s``, from the window's first token): a quiet engine still closes its windows, so a
  shift that arrives with little traffic is still seen. Such a window may hold fewer than ``min_tokens``; it is
  emitted and recorded, and the detector does not judge it.
- **a restart, a reset or a new map starts a new window.** The cumulative counters start again from zero on a
  restart or a reset, and a new served map changes what counts as cold; a window must describe one engine life
  and one map. The open window is closed (``closed_by`` says why) and the reading's counters, which are what was
  counted since the restart or reset, begin the next one. A negative delta (counters going back without the
  reading saying so) is treated as a reset: it is never added as negative traffic.
- **the first reading only sets the baseline**: its counters hold everything since the engine booted, at an
  unknown age, so they are not traffic of "now".

Time is monotonic seconds from an injected ``clock`` (``time.monotonic`` by default), so tests control it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
from pinsidecar_hook.contract import CountsArtifact, utc_now

__all__: list[str] = []  # nothing here is another package's business

log = structlog.get_logger(__name__)

# Why a window closed. "tokens" and "time" are the normal ends; the others cut a window short.
CLOSED_BY = ("tokens", "time", "restart", "reset", "map_change", "geometry_change", "end", "recorded")


@dataclass(frozen=True)
class Window:
    """One window of live traffic: what the router picked, per layer and expert, in a span of tokens.

    ``histogram`` is ``None`` when the hook writes no histogram (``PINSIDECAR_STATS_HISTOGRAM=0``): then only the
    live cold rate is known, and the divergence and the projected gain cannot be computed. ``cold_selections``
    is what the hook counted as cold under the map it served (``map_hash``); ``None`` for a recorded window (a
    counts file), whose cold rate under any map is computed from the histogram instead.
    """

    index: int
    layer_ids: tuple[int, ...]
    num_experts: int
    top_k: int
    tokens: int
    selections: np.ndarray = field(repr=False)  # int64 [layers]
    histogram: np.ndarray | None = field(default=None, repr=False)  # int64 [layers, experts]
    cold_selections: np.ndarray | None = field(default=None, repr=False)  # int64 [layers], as served
    map_hash: str = ""
    started: float = 0.0
    ended: float = 0.0
    closed_by: str = "tokens"
    source: str = ""  # where it came from: a counts file in replay, "live" in the daemon

    @property
    def duration_s(self) -> float:
        return max(0.0, self.ended - self.started)

    @property
    def total_selections(self) -> int:
        return int(self.selections.sum())

    def judgeable(self, min_tokens: int) -> bool:
        return self.tokens >= min_tokens

    def to_counts(self, workload: str = "") -> CountsArtifact:
        """The window as a counts artifact: what a map is built from, and what a decision is judged on."""
        if self.histogram is None:
            raise ValueError(f"window {self.index} has no histogram (the hook was started with "
                             "PINSIDECAR_STATS_HISTOGRAM=0), so it cannot be turned into counts")
        return CountsArtifact(
            layer_ids=list(self.layer_ids), num_experts=self.num_experts, top_k=self.top_k,
            counts=self.histogram.copy(), tokens=self.tokens, workload=workload or self.source or f"window{self.index}",
            started_at=utc_now(), ended_at=utc_now(), meta={"drift_window": self.index},
        )

    @classmethod
    def from_counts(cls, counts: CountsArtifact, index: int, *, started: float = 0.0, ended: float = 0.0,
                    map_hash: str = "", source: str = "") -> Window:
        """A recorded window (replay, tests): one counts file is one window of traffic."""
        hist = np.asarray(counts.counts, dtype=np.int64)
        return cls(index=index, layer_ids=tuple(counts.layer_ids), num_experts=counts.num_experts,
                   top_k=counts.top_k, tokens=int(counts.tokens), selections=hist.sum(axis=1), histogram=hist,
                   cold_selections=None, map_hash=map_hash, started=started, ended=ended, closed_by="recorded",
                   source=source or counts.workload)

    def summary(self) -> dict[str, Any]:
        return {"index": self.index, "tokens": self.tokens, "selections": self.total_selections,
                "started": self.started, "ended": self.ended, "duration_s": round(self.duration_s, 3),
                "closed_by": self.closed_by, "map_hash": self.map_hash, "source": self.source,
                "has_histogram": self.histogram is not None}


@dataclass(frozen=True)
class LiveSample:
    """What one stats reading adds: deltas since the previous reading, and the events that cut a window.

    Plain values, so a window can be tested without a stats file; :func:`sample_from_reading` builds one from a
    :class:`~pinsidecar.live_stats.StatsReading`.
    """

    layer_ids: tuple[int, ...]
    num_experts: int
    top_k: int
    tokens: int
    selections: Sequence[int]  # per layer
    cold_selections: Sequence[int] | None = None  # per layer, under map_hash
    histogram: np.ndarray | None = None  # int [layers, experts]
    map_hash: str = ""
    restarted: bool = False
    reset: bool = False
    first: bool = False
    now: float | None = None  # monotonic seconds; None: the windows' clock


def sample_from_reading(reading: Any, now: float | None = None) -> LiveSample:
    """Adapt a :class:`~pinsidecar.live_stats.StatsReading` (duck-typed: its deltas and its snapshot's geometry)."""
    snap = reading.snapshot
    return LiveSample(
        layer_ids=tuple(snap.layer_ids), num_experts=int(snap.num_experts), top_k=int(snap.top_k),
        tokens=int(reading.delta_tokens), selections=list(reading.delta_selections),
        cold_selections=list(reading.delta_cold_selections), histogram=reading.delta_histogram,
        map_hash=str(snap.map_hash or ""), restarted=bool(reading.restarted), reset=bool(reading.reset),
        first=bool(reading.first), now=now,
    )


class _Open:
    """The window being filled."""

    def __init__(self, sample: LiveSample) -> None:
        n_layers = len(sample.layer_ids)
        self.layer_ids = tuple(sample.layer_ids)
        self.num_experts = sample.num_experts
        self.top_k = sample.top_k
        self.map_hash = sample.map_hash
        self.tokens = 0
        self.selections = np.zeros(n_layers, dtype=np.int64)
        self.cold = np.zeros(n_layers, dtype=np.int64)
        self.cold_known = True
        self.histogram: np.ndarray | None = np.zeros((n_layers, sample.num_experts), dtype=np.int64)
        self.started: float | None = None  # time of the first token

    def geometry(self) -> tuple[tuple[int, ...], int, int]:
        return self.layer_ids, self.num_experts, self.top_k

    def add(self, s: LiveSample, now: float) -> None:
        if s.tokens <= 0 and not any(s.selections):
            return
        if self.started is None:
            self.started = now
        self.tokens += int(s.tokens)
        self.selections += np.asarray(s.selections, dtype=np.int64)
        if s.cold_selections is None:
            self.cold_known = False
        else:
            self.cold += np.asarray(s.cold_selections, dtype=np.int64)
        if s.histogram is None or self.histogram is None:
            self.histogram = None
        else:
            self.histogram += np.asarray(s.histogram, dtype=np.int64)

    def close(self, index: int, now: float, closed_by: str) -> Window:
        return Window(index=index, layer_ids=self.layer_ids, num_experts=self.num_experts, top_k=self.top_k,
                      tokens=self.tokens, selections=self.selections, histogram=self.histogram,
                      cold_selections=self.cold if self.cold_known else None, map_hash=self.map_hash,
                      started=self.started if self.started is not None else now, ended=now, closed_by=closed_by,
                      source="live")


def _negative(s: LiveSample) -> bool:
    if s.tokens < 0 or any(v < 0 for v in s.selections):
        return True
    if s.cold_selections is not None and any(v < 0 for v in s.cold_selections):
        return True
    return s.histogram is not None and bool((np.asarray(s.histogram) < 0).any())


class LiveWindows:
    """Cuts a stream of :class:`LiveSample` into :class:`Window` objects (see the module docstring for the rules).

    Call :meth:`feed` with every stats reading and :meth:`poll` now and then (a quiet engine writes no new stats,
    so its window is closed by time from here); both return the windows that closed, oldest first. Windows with no
    tokens at all are never emitted.
    """

    def __init__(self, window_tokens: int, max_window_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_tokens <= 0 or max_window_s <= 0:
            raise ValueError("window_tokens and max_window_s must be > 0")
        self.window_tokens = int(window_tokens)
        self.max_window_s = float(max_window_s)
        self.clock = clock
        self._open: _Open | None = None
        self._next_index = 0

    @classmethod
    def from_config(cls, cfg: Any, clock: Callable[[], float] = time.monotonic) -> LiveWindows:
        """From a :class:`~pinsidecar.drift.config.DriftConfig`."""
        return cls(cfg.window_tokens, cfg.max_window_s, clock=clock)

    @property
    def open_tokens(self) -> int:
        return self._open.tokens if self._open is not None else 0

    def _close(self, now: float, closed_by: str) -> Window | None:
        open_, self._open = self._open, None
        if open_ is None or open_.tokens <= 0:
            return None
        window = open_.close(self._next_index, now, closed_by)
        self._next_index += 1
        return window

    def feed(self, sample: LiveSample) -> list[Window]:
        """Add one reading's deltas; return the windows that closed because of it."""
        now = self.clock() if sample.now is None else sample.now
        closed: list[Window] = []
        if sample.first:
            # Counters since boot, of unknown age: a baseline, not traffic of now. Close whatever was open.
            w = self._close(now, "restart")
            return [w] if w is not None else []
        boundary = None
        if sample.restarted:
            boundary = "restart"
        elif sample.reset:
            boundary = "reset"
        elif _negative(sample):
            log.warning("drift_window_negative_delta", hint="counters went back without a restart or reset; "
                        "treated as a reset, the reading's counts are dropped")
            w = self._close(now, "reset")
            return [w] if w is not None else []
        elif self._open is not None and (
                self._open.geometry() != (tuple(sample.layer_ids), sample.num_experts, sample.top_k)):
            boundary = "geometry_change"
        elif self._open is not None and self._open.map_hash != sample.map_hash and self._open.tokens > 0:
            boundary = "map_change"
        if boundary is not None:
            w = self._close(now, boundary)
            if w is not None:
                closed.append(w)
        elif self._open is not None and self._open.started is not None \
                and now - self._open.started >= self.max_window_s:
            # The cap passed before this reading arrived: what it brings belongs to the next window.
            w = self._close(now, "time")
            if w is not None:
                closed.append(w)
        if _negative(sample):  # a restart or reset whose own counters are bad: nothing to add
            return closed
        if self._open is None:
            self._open = _Open(sample)
        self._open.map_hash = sample.map_hash if self._open.tokens == 0 else self._open.map_hash
        self._open.add(sample, now)
        if self._open.tokens >= self.window_tokens:
            w = self._close(now, "tokens")
            if w is not None:
                closed.append(w)
        return closed

    def poll(self, now: float | None = None) -> list[Window]:
        """Close the open window if its time cap has passed (call it on a timer; no reading is needed)."""
        now = self.clock() if now is None else now
        if self._open is not None and self._open.started is not None and now - self._open.started >= self.max_window_s:
            w = self._close(now, "time")
            return [w] if w is not None else []
        return []

    def flush(self, now: float | None = None, closed_by: str = "end") -> list[Window]:
        """Close the open window now, whatever it holds (shutdown, or before a planned remap)."""
        w = self._close(self.clock() if now is None else now, closed_by)
        return [w] if w is not None else []

"""The daemon's reader of pin mode's live stats file: deltas, cold ratios, restarts.

The hook's side thread (:mod:`pinsidecar_hook.stats_writer`) rewrites the stats file now and then with
*cumulative* counters since the engine booted (or since the last reset request). Metrics and drift watch want
*windows*: how many selections, and how many of them cold, since the last look. :class:`StatsReader` turns
successive snapshots into :class:`StatsReading` objects with those deltas, and it has to be right across the
events that make cumulative counters jump:

- **restart**: a new ``boot_id``, or ``seq`` going backwards: the counters started again from zero, so the delta
  is the new snapshot itself (never a negative number);
- **reset** (a ``reset`` request served within the same boot): some counter went down; the delta is again the new
  snapshot (what was counted between our last read and the reset is lost, and the reading says so);
- **no new write** (same boot, same ``seq``): zero delta.

It is tolerant the way a scrape must be: a missing file is "no stats yet" (``None``), a corrupt or half-written
one is remembered in :attr:`StatsReader.last_error` and also gives ``None``; nothing here raises on a bad file.
When the hook cannot write its configured path it writes :func:`~pinsidecar_hook.stats_writer.fallback_stats_path`
instead, and the reader looks there too (the newer of the two wins).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog
from pinsidecar_hook.contract import ArtifactError, StatsSnapshot, load_stats

__all__ = ["StatsReader", "StatsReading", "compare", "fallback_stats_path", "ratio", "wait_for_stats_token"]

log = structlog.get_logger(__name__)


def fallback_stats_path(stats_path: str | os.PathLike[str]) -> Path:
    """Where the hook writes when ``stats_path`` is not writable (the hook's own definition, re-exported)."""
    from pinsidecar_hook.contract import fallback_stats_path as hook_fallback

    return hook_fallback(stats_path)


def ratio(part: int, whole: int) -> float | None:
    """``part / whole``, or None when nothing was counted (a ratio of nothing is unknown, not zero)."""
    return part / whole if whole > 0 else None


@dataclass(frozen=True)
class StatsReading:
    """One look at the stats file, with what changed since the previous look."""

    snapshot: StatsSnapshot
    source: Path
    restarted: bool  # the engine rebooted since the previous reading (or this is the first reading)
    reset: bool  # counters went down within one boot (a reset request was served)
    first: bool  # no previous reading to compare with
    delta_selections: list[int]
    delta_cold_selections: list[int]
    delta_tokens: int
    delta_histogram: np.ndarray | None = field(default=None, repr=False)  # int64 [layers, experts]

    @property
    def cold_ratio(self) -> float | None:
        """Cold share of all selections since boot (or the last reset)."""
        return ratio(self.snapshot.total_cold_selections, self.snapshot.total_selections)

    @property
    def window_cold_ratio(self) -> float | None:
        """Cold share of the selections since the previous reading."""
        return ratio(sum(self.delta_cold_selections), sum(self.delta_selections))

    @property
    def cold_ratio_per_layer(self) -> list[float | None]:
        return [ratio(c, s) for s, c in zip(self.snapshot.selections, self.snapshot.cold_selections, strict=True)]

    @property
    def window_cold_ratio_per_layer(self) -> list[float | None]:
        return [ratio(c, s) for s, c in zip(self.delta_selections, self.delta_cold_selections, strict=True)]

    @property
    def errors(self) -> dict[str, int]:
        """The hook's error counters (e.g. ``stats_write``: writes to the configured path that failed)."""
        return dict(self.snapshot.errors)

    @property
    def from_fallback(self) -> bool:
        return self.source != Path(self.snapshot.meta.get("stats_path", self.source))


class StatsReader:
    """Reads one engine's stats file repeatedly; see the module docstring for the delta rules."""

    def __init__(self, path: str | os.PathLike[str], *, use_fallback: bool = True) -> None:
        self.path = Path(path)
        self.use_fallback = use_fallback
        self.last: StatsReading | None = None
        self.last_error: str | None = None

    def _candidates(self) -> list[Path]:
        paths = [self.path]
        if self.use_fallback:
            paths.append(fallback_stats_path(self.path))
        return paths

    def _load_newest(self) -> tuple[StatsSnapshot, Path] | None:
        found: list[tuple[StatsSnapshot, Path]] = []
        errors: list[str] = []
        for p in self._candidates():
            if not p.exists():
                continue
            try:
                found.append((load_stats(p), p))
            except ArtifactError as exc:
                errors.append(str(exc))
        if not found:
            self.last_error = "; ".join(errors) if errors else None
            return None
        self.last_error = None
        return max(found, key=lambda sp: sp[0].written_at)

    def read(self) -> StatsReading | None:
        """The current reading, or None when there is no readable stats file (see :attr:`last_error`)."""
        loaded = self._load_newest()
        if loaded is None:
            return None
        snap, source = loaded
        reading = compare(self.last.snapshot if self.last else None, snap, source)
        if reading.restarted and self.last is not None:
            log.info("stats_restart_detected", path=str(self.path), boot_id=snap.boot_id, seq=snap.seq)
        self.last = reading
        return reading


def _hist(snap: StatsSnapshot) -> np.ndarray | None:
    return None if snap.histogram is None else np.asarray(snap.histogram, dtype=np.int64)


def compare(prev: StatsSnapshot | None, snap: StatsSnapshot, source: Path) -> StatsReading:
    """The reading for ``snap`` given the previous snapshot ``prev`` (None: first look)."""
    first = prev is None
    restarted = first or prev.boot_id != snap.boot_id or snap.seq < prev.seq or prev.layer_ids != snap.layer_ids
    reset = False
    if not restarted:
        assert prev is not None
        went_down = (snap.tokens < prev.tokens
                     or any(a < b for a, b in zip(snap.selections, prev.selections, strict=True))
                     or any(a < b for a, b in zip(snap.cold_selections, prev.cold_selections, strict=True)))
        reset = went_down
    hist = _hist(snap)
    if restarted or reset:
        d_sel, d_cold, d_tok, d_hist = list(snap.selections), list(snap.cold_selections), snap.tokens, hist
    else:
        assert prev is not None
        d_sel = [a - b for a, b in zip(snap.selections, prev.selections, strict=True)]
        d_cold = [a - b for a, b in zip(snap.cold_selections, prev.cold_selections, strict=True)]
        d_tok = snap.tokens - prev.tokens
        prev_hist = _hist(prev)
        d_hist = hist - prev_hist if hist is not None and prev_hist is not None and hist.shape == prev_hist.shape \
            else None
    return StatsReading(snapshot=snap, source=source, restarted=restarted, reset=reset, first=first,
                        delta_selections=d_sel, delta_cold_selections=d_cold, delta_tokens=d_tok,
                        delta_histogram=d_hist)


def wait_for_stats_token(path: str | os.PathLike[str], token: str, timeout_s: float = 60.0) -> StatsSnapshot:
    """Wait until the stats file answers a ``flush``/``reset`` request (its ``meta.flush_token`` is ``token``).

    The request itself is :func:`pinsidecar_hook.contract.write_hook_request` on the stats path. Raises
    ``TimeoutError`` naming the file when the hook never answers (it is not loaded, or not in pin mode).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            snap = load_stats(path)
            if snap.meta.get("flush_token") == token:
                return snap
        except ArtifactError:
            pass  # not written yet, or mid-replace on a filesystem without atomic rename
        time.sleep(0.1)
    raise TimeoutError(f"the pin-mode hook did not answer request {token} within {timeout_s:.0f} s (stats file "
                       f"{path}); is the engine running with PINSIDECAR_HOOK_MODE=pin and this stats path?")

"""The daemon's one reader of pin mode's live stats file: readings with deltas, across restarts and resets.

The hook's side thread rewrites the stats file now and then with *cumulative* counters since the engine booted
(or since the last ``reset`` request). Everything in the daemon that asks what the routing did wants *changes*:
the exporter folds them into ``_total`` series that stay monotonic over engine restarts, the demo and the drift
watch want windows (selections, and how many of them cold, since the last look). :class:`StatsReader` turns
successive snapshots into :class:`StatsReading` objects with those deltas, by one set of rules:

- **restart**: a new ``boot_id``, or ``seq`` going backwards (or another set of MoE layers): the counters started
  again from zero, so the delta is the new snapshot itself, never a negative number. The first reading counts as
  a restart too;
- **reset**: within one boot, some counter (selections, cold selections or tokens, of any layer) went down: a
  ``reset`` request was served. The delta is again the new snapshot (what was counted between the previous look
  and the reset is lost, and the reading says so with ``reset=True``);
- **no new write** (same boot, same ``seq``): zero delta;
- the hook's **error counters** are not zeroed by a reset; each kind's delta is its increase, or its new value
  when it went down (a restart), so it is never negative either.

**Where.** When the hook cannot write its configured path it writes
:func:`pinsidecar_hook.contract.fallback_stats_path` instead (and counts ``errors["stats_write"]``). The reader
looks at both and takes the newer snapshot (by ``written_at``; the configured path on a tie). An older snapshot
left in the other file (the hook fell back for a while, then could write again) is never taken for a restart:
while the newer file cannot be read, the reader reports "no new write" rather than going back in time.

**Tolerance.** A scrape must never fail on a bad file: a missing file is "no stats yet" (``None``), a corrupt or
half-written one is remembered in :attr:`StatsReader.last_error` and also gives ``None``. Nothing here raises on
a bad file. A file is parsed again only when it changed (inode, size, mtime; the hook replaces it atomically).

**One reader per consumer.** A reader's deltas are relative to *its own* previous reading, so two consumers in one
process (the exporter and the drift watch) each hold their own :class:`StatsReader` over the same file, and each
sees every change once. A reader is not thread-safe: one consumer, or a lock around :meth:`StatsReader.read`.

**Asking.** :func:`request_stats` asks the hook to ``flush`` (write now) or ``reset`` (zero, then write) and
returns the snapshot that answers, from whichever of the two files is newer; :func:`load_newest_stats` is the
one-off look it uses.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog
from pinsidecar_hook.contract import ArtifactError, StatsSnapshot, fallback_stats_path, load_stats, request_and_wait

__all__ = ["StatsReader", "StatsReading", "load_newest_stats", "ratio"]

log = structlog.get_logger(__name__)


def ratio(part: int, whole: int) -> float | None:
    """``part / whole``, or None when nothing was counted (a ratio of nothing is unknown, not zero)."""
    return part / whole if whole > 0 else None


@dataclass(frozen=True)
class StatsReading:
    """One look at the stats file, with what changed since the same reader's previous look."""

    snapshot: StatsSnapshot
    source: Path  # the file it came from: the configured path or its fallback
    restarted: bool  # the engine rebooted since the previous reading (or this is the first reading)
    reset: bool  # counters went down within one boot (a reset request was served)
    first: bool  # no previous reading to compare with
    delta_selections: list[int]  # per layer, in snapshot.layer_ids order
    delta_cold_selections: list[int]
    delta_tokens: int
    delta_histogram: np.ndarray | None = field(default=None, repr=False)  # int64 [layers, experts]
    delta_errors: dict[str, int] = field(default_factory=dict)  # per kind of hook error, >= 0

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
        """The hook's error counters since boot (e.g. ``stats_write``: writes to the configured path that failed)."""
        return dict(self.snapshot.errors)

    @property
    def from_fallback(self) -> bool:
        """The hook could not write its configured path; this reading came from the fallback file."""
        return self.source != Path(self.snapshot.meta.get("stats_path", self.source))


def stats_candidates(path: str | os.PathLike[str], *, use_fallback: bool = True) -> list[Path]:
    """The files the hook may have written for the configured ``path``: the path itself, then its fallback."""
    p = Path(path)
    return [p, fallback_stats_path(p)] if use_fallback else [p]


def _newest(found: list[tuple[StatsSnapshot, Path]]) -> tuple[StatsSnapshot, Path]:
    return max(found, key=lambda sp: sp[0].written_at)  # max() keeps the first on a tie: the configured path


def load_newest_stats(path: str | os.PathLike[str], *, use_fallback: bool = True) -> StatsSnapshot:
    """The newer readable snapshot of ``path`` and its fallback; raises ``ArtifactError`` (naming both files)
    when neither can be read.

    For a one-off look, e.g. the answer to a flush request (the hook answers in the fallback file when it fell
    back). For repeated looks use a :class:`StatsReader`: it gives deltas and parses a file only when it changed.
    """
    found: list[tuple[StatsSnapshot, Path]] = []
    errors: list[str] = []
    for p in stats_candidates(path, use_fallback=use_fallback):
        try:
            found.append((load_stats(p), p))
        except ArtifactError as exc:
            errors.append(str(exc))
    if not found:
        raise ArtifactError(path, "no readable stats file: " + "; ".join(errors),
                            "is the engine running in pin mode with this stats path?")
    return _newest(found)[0]


def _file_identity(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of the file, None when there is none. The hook replaces the file atomically (a new
    inode each write), so an unchanged identity is an unchanged file."""
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):  # no file (a parent that is a file: no file either)
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class StatsReader:
    """Reads one engine's stats file (and its fallback) repeatedly; see the module docstring for the rules."""

    def __init__(self, path: str | os.PathLike[str], *, use_fallback: bool = True) -> None:
        self.path = Path(path)
        self.use_fallback = use_fallback
        self.last: StatsReading | None = None
        self.last_error: str | None = None
        # per file: (identity, snapshot or the error it gave); a file is parsed again only when it changed
        self._parsed: dict[Path, tuple[tuple[int, int, int], StatsSnapshot | str]] = {}

    def candidates(self) -> list[Path]:
        return stats_candidates(self.path, use_fallback=self.use_fallback)

    def _load(self, p: Path) -> StatsSnapshot | str | None:
        """The snapshot in ``p``, the reason it cannot be read, or None when there is no file."""
        try:
            ident = _file_identity(p)
        except OSError as exc:
            return f"{p}: cannot stat: {exc.strerror}"
        if ident is None:
            self._parsed.pop(p, None)
            return None
        cached = self._parsed.get(p)
        if cached is not None and cached[0] == ident:
            return cached[1]
        try:
            result: StatsSnapshot | str = load_stats(p)
        except ArtifactError as exc:
            result = str(exc)
        self._parsed[p] = (ident, result)
        return result

    def _load_newest(self) -> tuple[StatsSnapshot, Path] | None:
        found: list[tuple[StatsSnapshot, Path]] = []
        errors: list[str] = []
        for p in self.candidates():
            got = self._load(p)
            if isinstance(got, StatsSnapshot):
                found.append((got, p))
            elif got is not None:
                errors.append(got)
        if not found:
            self.last_error = "; ".join(errors) if errors else None
            return None
        self.last_error = None
        return _newest(found)

    def read(self) -> StatsReading | None:
        """The current reading, or None when there is no readable stats file (see :attr:`last_error`)."""
        loaded = self._load_newest()
        if loaded is None:
            return None
        snap, source = loaded
        last = self.last
        if last is not None and source != last.source and snap.written_at < last.snapshot.written_at:
            # an older snapshot left in the other file while the newer one cannot be read: not a restart
            return compare(last.snapshot, last.snapshot, last.source)
        reading = compare(last.snapshot if last else None, snap, source)
        if reading.restarted and last is not None:
            log.info("stats_restart_detected", path=str(self.path), boot_id=snap.boot_id, seq=snap.seq)
        self.last = reading
        return reading


def _hist(snap: StatsSnapshot) -> np.ndarray | None:
    return None if snap.histogram is None else np.asarray(snap.histogram, dtype=np.int64)


def _error_deltas(prev: dict[str, int], now: dict[str, int]) -> dict[str, int]:
    return {kind: n - prev.get(kind, 0) if n >= prev.get(kind, 0) else n for kind, n in now.items()}


def compare(prev: StatsSnapshot | None, snap: StatsSnapshot, source: Path) -> StatsReading:
    """The reading for ``snap`` given the previous snapshot ``prev`` (None: first look). Pure: the rules alone."""
    first = prev is None
    restarted = prev is None or prev.boot_id != snap.boot_id or snap.seq < prev.seq or prev.layer_ids != snap.layer_ids
    reset = False
    if not restarted:
        assert prev is not None
        reset = (snap.tokens < prev.tokens
                 or any(a < b for a, b in zip(snap.selections, prev.selections, strict=True))
                 or any(a < b for a, b in zip(snap.cold_selections, prev.cold_selections, strict=True)))
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
    d_err = dict(snap.errors) if restarted else _error_deltas(prev.errors if prev else {}, snap.errors)
    return StatsReading(snapshot=snap, source=source, restarted=restarted, reset=reset, first=first,
                        delta_selections=d_sel, delta_cold_selections=d_cold, delta_tokens=d_tok,
                        delta_histogram=d_hist, delta_errors=d_err)


def request_stats(path: str | os.PathLike[str], op: str, timeout_s: float = 60.0,
                  alive: Callable[[], bool] | None = None) -> StatsSnapshot:
    """Ask the pin-mode hook to ``flush`` or ``reset`` its stats, and return the snapshot that answers (the one
    echoing the request's token), read from the configured path or its fallback, whichever is newer.

    :func:`pinsidecar_hook.contract.request_and_wait` does the asking and waiting; pass the engine's ``alive``
    to fail at once when the engine exits. Raises :class:`~pinsidecar_hook.contract.HookRequestError`.
    """
    return request_and_wait(path, op, load_newest_stats, timeout_s=timeout_s, alive=alive)

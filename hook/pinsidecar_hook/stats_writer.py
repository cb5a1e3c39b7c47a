"""Pin mode's side thread: copy the live counters to the stats file now and then, and on request.

The counters live on the device and are filled by the partition pass inside the forward; this thread is the only
reader. It never blocks serving and never fails it:

- every ``flush_interval_s`` (and when the daemon drops a ``flush``/``reset`` request next to the stats file,
  polled every :data:`REQUEST_POLL_S`) it writes a :class:`~pinsidecar_hook.contract.StatsSnapshot` atomically;
  ``boot_id`` is new each boot and ``seq`` grows by one per write, so a reader can tell a restart from a reset;
- an unwritable stats directory does not stop serving: the error is logged **once**, counted in
  ``errors["stats_write"]``, and the snapshot goes to :func:`fallback_stats_path` instead (a per-path file in the
  system temp directory, which :mod:`pinsidecar.live_stats` also reads), so the daemon can still see the counters and
  the error count. If the fallback fails too, the engine log line is all there is;
- the map file changing on disk while serving is noticed (size/mtime/inode), logged once, and recorded as
  ``meta["map_changed_on_disk"]``: the running placement stays the one loaded at boot until the next boot.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from pinsidecar_hook.contract import StatsSnapshot, fallback_stats_path, read_hook_request, request_path
from pinsidecar_hook.contract.env import HookConfig

__all__ = ["REQUEST_POLL_S", "StatsWriter", "fallback_stats_path"]

log = logging.getLogger("pinsidecar_hook")

# How often the thread looks for a flush/reset request: short enough that `pinsidecar` commands that wait for
# their request to be served feel immediate, long enough that the stat() calls are noise.
REQUEST_POLL_S = 0.2


def _file_identity(path: Path | None) -> tuple[int, int, int] | None:
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return (-1, -1, -1)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class StatsWriter(threading.Thread):
    """Writes the pin state's counters to ``cfg.stats_path``. Start it once the engine is ready."""

    def __init__(self, pin_state: Any, cfg: HookConfig) -> None:
        super().__init__(name="pinsidecar-stats", daemon=True)
        assert cfg.stats_path is not None
        self.pin_state = pin_state
        self.cfg = cfg
        self.path = Path(cfg.stats_path)
        self.boot_id = uuid.uuid4().hex
        self.seq = 0
        self.errors: dict[str, int] = {}
        self.flush_token = ""
        self.last_written: Path | None = None
        self._stop_event = threading.Event()
        self._write_lock = threading.Lock()
        self._map_identity = _file_identity(cfg.map_path)
        self._map_changed = False
        self._logged_write_error = False

    # ------------------------------------------------------------------------------------------------ public

    def stop(self, final_flush: bool = True) -> None:
        self._stop_event.set()
        if final_flush:
            self.flush()

    def snapshot(self) -> StatsSnapshot:
        """Copy the device counters (small) into a snapshot. Counts may be mid-step: a periodic flush can land
        between two layers of one forward, so only a snapshot taken between steps is exactly layers x tokens x k."""
        st = self.pin_state
        emap = st.emap
        hist = [layer.expert_counts.to("cpu").tolist() for layer in st.layers]
        cold = [int(layer.cold_counts.to("cpu").item()) for layer in st.layers]
        tokens = int(st.layers[0].token_counts.to("cpu").item()) if st.layers else 0
        return StatsSnapshot(
            boot_id=self.boot_id, seq=self.seq, layer_ids=[layer.layer_id for layer in st.layers],
            num_experts=emap.num_experts, top_k=emap.top_k, selections=[int(sum(row)) for row in hist],
            cold_selections=cold, tokens=tokens, map_hash=emap.content_hash, map_label=emap.label, pid=os.getpid(),
            written_at=time.time(), tier_bytes=dict(st.summary["tier_bytes"]),
            histogram=hist if self.cfg.histogram else None, errors=dict(self.errors),
            meta={"flush_token": self.flush_token, "map_path": str(self.cfg.map_path or ""),
                  "map_changed_on_disk": self._map_changed, "backend": st.backend, "tp_size": st.tp_size,
                  "peak_extra_bytes": st.summary["peak_extra_total_bytes"],
                  "predicted_cold_rate": emap.predicted_cold_rate, "stats_path": str(self.path)},
        )

    def flush(self) -> Path | None:
        """Write a snapshot now; returns the path written (the stats path or the fallback), or None."""
        with self._write_lock:
            self.seq += 1
            snap = self.snapshot()
            try:
                snap.save(self.path)
                self.last_written = self.path
                return self.path
            except OSError as exc:
                self.errors["stats_write"] = self.errors.get("stats_write", 0) + 1
                snap.errors = dict(self.errors)
                fallback = fallback_stats_path(self.path)
                if not self._logged_write_error:
                    self._logged_write_error = True
                    log.error("pinsidecar pin: cannot write stats to %s (%s); serving goes on, stats go to %s "
                              "(errors counted in errors.stats_write)", self.path, exc, fallback)
                try:
                    snap.save(fallback)
                    self.last_written = fallback
                    return fallback
                except OSError:
                    return None

    def reset(self) -> None:
        for layer in self.pin_state.layers:
            layer.reset()

    # ------------------------------------------------------------------------------------------------ thread

    def run(self) -> None:
        next_flush = time.monotonic()
        while not self._stop_event.is_set():
            try:
                self._serve_request()
                self._check_map_file()
                if time.monotonic() >= next_flush:
                    self.flush()
                    next_flush = time.monotonic() + self.cfg.flush_interval_s
            except Exception:  # never let the side thread die silently, never let it touch serving
                self.errors["stats_thread"] = self.errors.get("stats_thread", 0) + 1
                if self.errors["stats_thread"] == 1:
                    log.exception("pinsidecar pin: stats thread error (further ones are only counted)")
            self._stop_event.wait(REQUEST_POLL_S)

    def _serve_request(self) -> None:
        req = read_hook_request(self.path)
        if req is None:
            return
        op, token = req
        with contextlib.suppress(OSError):
            request_path(self.path).unlink()
        if token == self.flush_token:  # served already; the request file could not be removed
            return
        if op == "reset":
            self.reset()
        self.flush_token = token
        self.flush()

    def _check_map_file(self) -> None:
        if self._map_changed or self.cfg.map_path is None:
            return
        if _file_identity(self.cfg.map_path) != self._map_identity:
            self._map_changed = True
            log.warning("pinsidecar pin: map file %s changed on disk while serving; ignored until the next boot "
                        "(the running placement is still map %s)", self.cfg.map_path, self.pin_state.emap.short_hash)


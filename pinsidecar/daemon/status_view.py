"""What ``GET /status`` (and ``pinsidecar status``) answers: one document gathered from the daemon's parts when asked.

Like a Prometheus collector, the view holds no state of its own and refreshes nothing in the background: every
call reads its sources as they are now (the supervisor's snapshot, the gate's, the maps folder, the last
drain-reboot, the hook's newest stats file, the drift watch, the remap pipeline). A source the daemon has not
built yet (before :meth:`~pinsidecar.daemon.service.Daemon.start`, or one the config turns off) is reported as
absent, never as an error, so status answers from the first moment the control API listens.

The sources are read through :class:`StatusSources`, which the daemon implements; the view never imports it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Protocol

from pinsidecar_hook.contract import ArtifactError

from pinsidecar import __version__
from pinsidecar.daemon.config import Config
from pinsidecar.daemon.drain import DrainReboot
from pinsidecar.daemon.drift_loop import DriftLoop
from pinsidecar.daemon.engine_state import EngineState
from pinsidecar.daemon.map_library import MapLibrary
from pinsidecar.daemon.supervisor import Supervisor
from pinsidecar.drift import NO_SKEW, DriftWatch
from pinsidecar.live_stats import load_newest_stats
from pinsidecar.metrics.cache import cache_status
from pinsidecar.remap.pipeline import RemapPipeline

__all__: list[str] = []  # nothing here is another package's business


class StatusSources(Protocol):
    """The daemon's parts, as the status view reads them (each may still be None before the daemon started)."""

    cfg: Config
    started_at: float  # monotonic: uptime is an interval, never the wall clock
    maps: MapLibrary
    drains: DrainReboot
    drift: DriftLoop
    remaps: RemapPipeline

    @property
    def supervisor(self) -> Supervisor | None: ...

    @property
    def gate(self) -> Any: ...

    @property
    def control(self) -> Any: ...  # its .address

    @property
    def exporter(self) -> Any: ...


class StatusView:
    """The status document of one daemon (:meth:`document`)."""

    def __init__(self, sources: StatusSources) -> None:
        self.sources = sources

    def document(self) -> dict[str, Any]:
        d = self.sources
        cfg, sup, gate = d.cfg, d.supervisor, d.gate
        return {
            "daemon": {"version": __version__, "pid": os.getpid(),
                       "uptime_s": round(time.monotonic() - d.started_at, 1),
                       "config": str(cfg.path) if cfg.path else None,
                       "control": d.control.address if d.control else None,
                       "metrics": f"http://{cfg.metrics.host}:{cfg.metrics.port}/metrics"
                       if d.exporter else None,
                       "launcher": cfg.engine.launcher, "hook_mode": cfg.engine.hook_mode},
            "engine": sup.snapshot() if sup else {"state": EngineState.STOPPED},
            "gate": gate.snapshot() if gate is not None else None,
            "maps": {"dir": str(d.maps.directory), "entries": [e.to_json() for e in d.maps.entries()]},
            "last_drain_reboot": d.drains.last,
            "pin": pin_status(d.drift.stats_path, cfg.engine.hook_mode),
            "drift": drift_status(d.drift.watch),
            "remap": d.remaps.status(),
        }


def pin_status(stats_path: Path | None, hook_mode: str) -> dict[str, Any] | None:
    """What the engine's hook says about its split (from its newest stats file): the backend, whether it has been
    checked on hardware, bytes per expert, the attach-time self-check when one ran, and the cache tier
    (:func:`~pinsidecar.metrics.cache.cache_status`, None without one). None when the engine is not in pin mode or
    has not written stats yet."""
    if stats_path is None or hook_mode != "pin":
        return None
    try:
        snap = load_newest_stats(stats_path)
    except (ArtifactError, OSError):
        return None
    meta = snap.meta or {}
    ranks = meta.get("tp_size") if isinstance(meta.get("tp_size"), int) else 1
    tiers = dict(snap.tier_bytes or {})
    # Rank 0 writes the stats; under tensor parallel every rank holds an equal shard of every expert, and
    # routing (so every count) is the same on all of them.
    return {"backend": meta.get("backend"), "backend_verified": bool(meta.get("backend_verified", True)),
            "backend_guarantee": meta.get("backend_guarantee"),
            "expert_bytes": meta.get("expert_bytes"), "tier_bytes": tiers, "tp_size": ranks,
            "lane_tier_bytes": {k: v * ranks for k, v in tiers.items()}, "selfcheck": meta.get("selfcheck"),
            "cache": cache_status(snap)}


def drift_status(watch: DriftWatch | None) -> dict[str, Any] | None:
    """The drift watch's status, with the one line ``pinsidecar status`` prints for it. None outside pin mode."""
    if watch is None:
        return None
    st = watch.status()
    last = watch.last_record
    if last is None:
        line = "no window closed yet"
    elif last.signals is not None and last.signals.exploitable_skew is False:
        line = NO_SKEW
    else:
        line = last.status
    return {**st, "line": line}

"""The daemon as the remap pipeline's host: what a remap may read of the daemon, and do to the engine serving now.

:class:`DaemonRemapHost` is the daemon's implementation of :class:`~pinsidecar.remap.host.RemapHost`, the narrow
protocol the pipeline asks for (it never imports the daemon). Every answer is read from the daemon's parts at the
moment it is asked, through :class:`HostParts`, because most parts are built only when the daemon starts, and a
test may swap the config in between. What it adds is the translation only: the engine serving now is the
supervisor's, the one drain-reboot is :class:`~pinsidecar.daemon.drain.DrainReboot`'s (a remap's leaves
``active-map.json`` to its commit), and a map applied in place is followed by the supervisor (status, what a
restart boots, the exporter through it) and by the drift loop.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pinsidecar_hook.contract import ExpertMap

from pinsidecar.daemon.config import Config
from pinsidecar.daemon.drain import DrainReboot
from pinsidecar.daemon.drift_loop import DriftLoop
from pinsidecar.daemon.map_library import MapEntry, MapLibrary
from pinsidecar.daemon.supervisor import Supervisor
from pinsidecar.drift import DriftWatch
from pinsidecar.remap.host import RebootHook

__all__: list[str] = []  # nothing here is another package's business


class HostParts(Protocol):
    """The daemon's parts the host reads (the daemon implements it; each may still be None before it started)."""

    cfg: Config
    state_dir: Path
    maps: MapLibrary
    drains: DrainReboot
    drift: DriftLoop

    @property
    def supervisor(self) -> Supervisor | None: ...

    @property
    def exporter(self) -> Any: ...  # the exporter's remap counters, or None without metrics

    @property
    def capture(self) -> Any: ...  # the gate's CaptureStore, or None


class DaemonRemapHost:
    """:class:`~pinsidecar.remap.host.RemapHost` over one daemon's parts."""

    def __init__(self, parts: HostParts) -> None:
        self.parts = parts

    # what a remap reads

    @property
    def cfg(self) -> Config:
        return self.parts.cfg

    @property
    def state_dir(self) -> Path:
        return self.parts.state_dir

    @property
    def watch(self) -> DriftWatch | None:
        return self.parts.drift.watch

    @property
    def exporter(self) -> Any:
        return self.parts.exporter

    @property
    def capture(self) -> Any:
        return self.parts.capture

    def library_entries(self) -> list[MapEntry]:
        return self.parts.maps.entries()

    # the engine serving now

    @property
    def served_map(self) -> tuple[Path | None, ExpertMap | None]:
        sup = self.parts.supervisor
        return (sup.map_path, sup.map) if sup is not None else (None, None)

    @property
    def engine_url(self) -> str | None:
        sup = self.parts.supervisor
        launcher = sup.launcher if sup is not None else None
        return launcher.base_url if launcher is not None else None

    @property
    def model_name(self) -> str:
        return self.parts.cfg.engine_spec(None).model_name

    @property
    def stats_path(self) -> Path | None:
        return self.parts.drift.stats_path

    # deploying

    def engine_map_path(self, path: Path) -> str:
        """``path`` as the engine sees it: the same file through the container's mount of the state folder, or
        the absolute path for a local engine."""
        cfg = self.parts.cfg
        if cfg.engine.launcher == "container":
            from pinsidecar.engine.container import container_path

            return container_path(path, cfg.container, self.parts.state_dir)
        return str(Path(path).absolute())

    def engine_alive_probe(self) -> Callable[[], bool]:
        """True while the engine serving now still runs and is still the supervisor's (callable from a thread:
        a process poll or the container's init pid, no event loop)."""
        sup = self.parts.supervisor
        launcher = sup.launcher if sup is not None else None
        if sup is None or launcher is None:
            return lambda: False
        return lambda: sup.launcher is launcher and launcher.alive()

    def applied_in_place(self, path: Path, emap: ExpertMap) -> None:
        """The hook swapped the engine onto ``emap``: the supervisor (status, what a restart boots), the exporter
        (through it) and the drift loop follow."""
        sup = self.parts.supervisor
        if sup is not None:
            sup.applied_in_place(path, emap)
        self.parts.drift.follow_map(path, emap)

    async def reboot_with(self, map_path: Path, *, reason: str, before_stop: RebootHook | None = None,
                          after_boot: RebootHook | None = None) -> dict[str, Any]:
        """A remap's drain-reboot onto ``map_path`` (``active-map.json`` is left to the commit)."""
        return await self.parts.drains.run(map_path, self.parts.cfg.control.drain_timeout_s, reason=reason,
                                           record_active=False, before_stop=before_stop, after_boot=after_boot)

    def committed(self, path: Path, map_hash: str) -> None:
        """A remap wrote ``active-map.json`` for ``map_hash``: a map applied in place is what a restart boots now."""
        sup = self.parts.supervisor
        if sup is not None:
            sup.committed(map_hash)
